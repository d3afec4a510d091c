"""Virtual (interleaved) pipeline stages: ``Grid(pipeline=p, virtual=v)``.

The model is cut into p·v stages (the same DP), stage s runs on the mesh of
pipeline rank s mod p, or with ``placement="v"`` (virtual=2) on rank s for
s < p and 2p − 1 − s for the others. Numerics follow tests/pipeline_cases.py (pipelined ==
plain Flax/optax, fp32, the same bounds); the schedules' logic is checked on
idealised devices by tests/schedule_sim.py. The MPI case (two processes,
pipeline=2, virtual=2) is in test_pipeline.py's mpiexec table.
"""

import jax
import numpy as np
import pytest
from pipeline_cases import assert_compiles_once, build, partitioned, run_case
from schedule_sim import simulate

import axonn_jax
from axonn_jax.runtime.mesh import device_array
from axonn_jax.runtime.pipeline import schedules
from axonn_jax.runtime.pipeline.timeline import bubble_theory, idle_fractions


# --- the grid -------------------------------------------------------------------
def test_grid_parses_and_places_virtual_stages():
    grid = axonn_jax.Grid.parse("pipeline=2,virtual=2,x=2,z=2")
    assert grid == axonn_jax.Grid(x=2, z=2, pipeline=2, virtual=2)
    assert (grid.size, grid.stages) == (8, 4)  # no extra devices
    assert [grid.pipeline_rank(s) for s in range(4)] == [0, 1, 0, 1]
    assert repr(grid) == "Grid(x=2, y=1, z=2, data=1, pipeline=2, virtual=2)"
    assert repr(axonn_jax.Grid(pipeline=2)) == "Grid(x=1, y=1, z=1, data=1, pipeline=2)"
    with pytest.raises(ValueError, match="stage 4 is not one of the 4 stages"):
        grid.pipeline_rank(4)
    # V-shaped: rank r holds stages r and 2p − 1 − r; rank 0 the first and the last
    v = axonn_jax.Grid.parse("pipeline=4,virtual=2,placement=v,z=2")
    assert v == axonn_jax.Grid(z=2, pipeline=4, virtual=2, placement="v")
    assert v.placements == (0, 1, 2, 3, 3, 2, 1, 0) and grid.placements == (0, 1, 0, 1)
    assert repr(v) == "Grid(x=1, y=1, z=2, data=1, pipeline=4, virtual=2, placement='v')"
    assert axonn_jax.Grid.parse("pipeline=2,virtual=2,placement=interleaved") == axonn_jax.Grid(pipeline=2, virtual=2)


def test_v_placement_places_meshes_and_the_queue_reads_it(devices):
    """stage_meshes follow Grid.pipeline_rank; the dispatch queue numbers ranks by the order their
    meshes first appear, so its schedules get the grid's placement back."""
    from types import SimpleNamespace

    from axonn_jax.runtime.mesh import stage_meshes
    from axonn_jax.runtime.pipeline.dispatch import DispatchQueue, stage_ranks

    for text in ("pipeline=2,virtual=2,placement=v,x=2,z=2", "pipeline=4,virtual=2,placement=v,z=2",
                 "pipeline=4,virtual=2,z=2"):  # fmt: skip
        grid = axonn_jax.Grid.parse(text)
        meshes, ranks = stage_meshes(grid), device_array(grid)
        for s, mesh in enumerate(meshes):
            assert list(mesh.devices.flat) == list(ranks[grid.pipeline_rank(s)].flat), (text, s)
        programs = [SimpleNamespace(mesh=m) for m in meshes]
        assert stage_ranks(programs) == grid.placements
        for name in ("message", "zb"):  # the queue hands the placement to its schedule
            schedule = DispatchQueue(programs, [], None, schedule=name).schedule
            assert [schedule.rank(s) for s in range(grid.stages)] == list(grid.placements), (text, name)


@pytest.mark.parametrize("kwargs,match", [
    (dict(pipeline=2, virtual=0), r"Grid.virtual must be >= 1, got 0.*Remedy: virtual=1"),
    (dict(pipeline=2, virtual=-1), r"Grid.virtual must be >= 1"),
    (dict(virtual=2), r"Grid\(virtual=2\) needs a pipeline.*Remedy: Grid\(pipeline=2, virtual=2\)"),
    (dict(pipeline=4, virtual=3, placement="v"), r"Grid\(.*pipeline=4, virtual=3, placement='v'\) cannot take "
     r"placement='v'.*needs exactly virtual=2.*Remedy: Grid\(pipeline=4, virtual=2, placement='v'\)"),
    (dict(pipeline=2, placement="v"), r"needs exactly virtual=2 stages per rank, got virtual=1"),
    (dict(pipeline=2, virtual=2, placement="zigzag"), r"Grid.placement must be one of \('interleaved', 'v'\)"),
])  # fmt: skip
def test_bad_virtual_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        axonn_jax.Grid(**kwargs)
    with pytest.raises(TypeError, match="Grid.virtual must be a positive int"):
        axonn_jax.Grid(pipeline=2, virtual=1.5)


def test_too_few_cut_points_names_model_grid_and_remedy():
    """The 4-block GPT has 68 cut points (one between each two parameter uses): 69 stages at
    most; 8 × 10 = 80 is refused."""
    case = build("gpt")
    grid = axonn_jax.Grid(pipeline=8, virtual=10)
    with pytest.raises(ValueError) as err:
        axonn_jax.partition(case.model, grid, *case.inputs(case.batch(1)))
    text = str(err.value)
    assert f"GPT on {grid}" in text and "68 layer boundaries" in text
    assert "79 needed for 80 pipeline stages" in text
    assert "Remedy: at most 69 stages (fewer virtual stages per rank" in text
    # explicit boundaries must give p·v − 1 patterns
    with pytest.raises(ValueError, match=r"GPT on .*stages= gives 1 boundaries for 4 pipeline stages"):
        axonn_jax.partition(case.model, axonn_jax.Grid(pipeline=2, virtual=2), *case.inputs(case.batch(1)),
                            stages=["block_2"])  # fmt: skip


def test_plan_cuts_p_times_v_stages_balanced():
    plain = partitioned("gpt", axonn_jax.Grid(pipeline=4, z=2, x=2))[1].plan
    virtual = partitioned("gpt", axonn_jax.Grid(pipeline=2, virtual=2, z=2, x=2))[1].plan
    # the same DP: p·v stages over the same equations as a pipeline of p·v ranks (stages of
    # the same size: a stage's devices split its FLOPs, not its kernels' least times)
    assert [(s.start, s.stop) for s in virtual.stages] == [(s.start, s.stop) for s in plain.stages]
    text = str(virtual)
    assert "pipeline stages (4 = pipeline 2 × virtual 2, cut for the fastest slowest stage: " \
           "compute + boundary transfer; slowest: stage " in text  # fmt: skip
    assert "; stage s runs on pipeline rank s mod 2):" in text
    for s in range(4):
        assert f"  stage {s} (rank {s % 2}): " in text
    vee = partitioned("gpt", axonn_jax.Grid(pipeline=2, virtual=2, z=2, x=2, placement="v"))[1]
    text = str(vee.plan)
    assert [(s.start, s.stop) for s in vee.plan.stages] == [(s.start, s.stop) for s in plain.stages]
    assert "; V-shaped: stage s runs on rank s, or 2·2 − 1 − s from stage 2):" in text and " mod 2" not in text
    for s, r in enumerate((0, 1, 1, 0)):
        assert f"  stage {s} (rank {r}): " in text


# --- placement and numerics (8 simulated devices) ----------------------------------------
@pytest.fixture(scope="module")
def virtual_gpt(devices):
    case, pm = partitioned("gpt", "pipeline=2,virtual=2,x=2,z=2")  # run_case's, compiled once
    return case, pm, pm.init(jax.random.key(0))


def test_stage_s_runs_on_the_devices_of_rank_s_mod_p(virtual_gpt, devices):
    case, pm, params = virtual_gpt
    ranks = device_array(pm.grid)  # (pipeline, data, z, y, x)
    meshes = pm.stage_meshes
    assert len(meshes) == 4 and meshes[0] is meshes[2] and meshes[1] is meshes[3]
    for s, mesh in enumerate(meshes):
        assert list(mesh.devices.flat) == list(ranks[s % 2].flat)
    assert set(meshes[0].devices.flat).isdisjoint(meshes[1].devices.flat)
    assert pm.local_stages == [0, 1, 2, 3]
    # every parameter lives on the mesh of its first stage, gradients come back there
    step = pm.value_and_grad(case.loss, inputs=case.inputs, microbatches=2)
    _, grads = step(params, case.batch(2))
    programs = step.stage_programs(case.inputs(case.batch(1)))
    for s, prog in enumerate(programs):
        assert set(prog.mesh.devices.flat) == set(ranks[s % 2].flat)
    homes = pm.param_homes
    for i, p in enumerate(pm.plan.params):
        leaf = jax.tree.leaves(params)[i]
        want = set(ranks[homes.home[i] % 2].flat)
        assert set(leaf.sharding.mesh.devices.flat) == want, p.path
        assert set(jax.tree.leaves(grads)[i].sharding.mesh.devices.flat) == want, p.path
    # a stage's tasks and the tasks of the other stages on its rank never overlap in time
    records = step.last_result.records
    for rank in (0, 1):
        spans = sorted((r.start, r.end) for r in records if r.stage % 2 == rank)
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))
    assert set(idle_fractions([(0, r.stage, r.kind, r.microbatch, r.start, r.end, r.wait)
                               for r in records], pipeline=2)) == {0, 1}  # fmt: skip



def test_forward_only_on_virtual_stages(virtual_gpt):
    """pm.apply / pm.forward (forward tasks only) equal the plain model on gathered params."""
    from forward_cases import ATOL, RTOL

    case, pm, params = virtual_gpt
    tokens = case.batch(2)
    want = case.model.apply({"params": pm.gather(params)}, tokens)
    np.testing.assert_allclose(pm.apply(params, tokens), want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(pm.forward(params, tokens, microbatches=2), want, rtol=RTOL, atol=ATOL)

# (grid, microbatch counts, schedules): pipeline 2 and 4, virtual 1, 2 and 4
EQUIVALENCE = [
    ("pipeline=2,virtual=2,x=2,z=2", (1, 4, 8), ("message", "1f1b", "gpipe")),
    ("pipeline=4,virtual=2,z=2", (4, 8), ("message", "1f1b")),
    ("pipeline=2,virtual=4,z=2,data=2", (4,), ("message",)),
    ("pipeline=4,z=2", (1, 8), ("message",)),  # virtual=1: the baseline on the same model
    # V-shaped placement: every schedule at p=2, the message-driven ones at p=4 (5 steps with zb)
    ("pipeline=2,virtual=2,placement=v,x=2,z=2", (1, 4, 8), schedules.SCHEDULES),
    ("pipeline=4,virtual=2,placement=v,z=2", (4, 8), ("message", "zb")),
]
#: ZB-V (static, V only): pipeline 2 and 4, then 5 AdamW steps with it
ZB_V_EQUIVALENCE = [("pipeline=2,virtual=2,placement=v,x=2,z=2", (1, 4, 8)),
                    ("pipeline=4,virtual=2,placement=v,z=2", (4, 8))]


@pytest.mark.slow
@pytest.mark.parametrize("grid,microbatches,schedules_", EQUIVALENCE)
def test_virtual_stages_equal_unpartitioned(grid, microbatches, schedules_, devices):
    """Loss and gradients per microbatch count and schedule, then 5 AdamW steps through
    pm.train_step: all equal the plain single-device run (pipeline_cases' bounds)."""
    grid = axonn_jax.Grid.parse(grid)
    failures = run_case("gpt", grid, microbatches=microbatches, schedules=schedules_,
                        trajectory_schedule="zb" if grid.placement == "v" else "message")  # fmt: skip
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("grid,microbatches", ZB_V_EQUIVALENCE)
def test_zb_v_equals_unpartitioned(grid, microbatches, devices):
    """ZB-V: loss and gradients per microbatch count, then 5 AdamW steps with "zb-v", equal
    the plain single-device run (pipeline_cases' bounds)."""
    failures = run_case("gpt", axonn_jax.Grid.parse(grid), microbatches=microbatches, schedules=("zb-v",),
                        trajectory_schedule="zb-v")  # fmt: skip
    assert not failures, "\n".join(failures)


def test_compiles_once_across_steps_with_virtual_stages(virtual_gpt, caplog):
    """After the first step, steps of a virtual-stage pipeline compile nothing."""
    case, pm, params = virtual_gpt
    assert_compiles_once(case, pm, params, caplog)


# --- the schedules on virtual stages (simulated devices, no JAX) -------------------------
@pytest.mark.parametrize("schedule", schedules.SCHEDULES)
@pytest.mark.parametrize("pipeline,virtual,placement", [
    (2, 1, "interleaved"), (2, 2, "interleaved"), (2, 4, "interleaved"), (4, 2, "interleaved"),
    (4, 4, "interleaved"), (2, 2, "v"), (4, 2, "v"),
])  # fmt: skip
def test_schedules_finish_on_virtual_stages(schedule, pipeline, virtual, placement):
    """No deadlock, each rank busy exactly its work (the stages its placement gives it),
    message-driven keeps its bounds."""
    n = pipeline * virtual
    rank = axonn_jax.Grid(pipeline=pipeline, virtual=virtual, placement=placement).pipeline_rank
    if schedule == "zb-v" and placement != "v":  # ZB-V's order is the V's
        with pytest.raises(ValueError, match="V-shaped placement"):
            simulate(schedule, pipeline, virtual, 1, placement=lambda s, v, p: rank(s))
        return
    for m in (1, 3, 8):
        for latency in (0.0, 0.3):
            sim = simulate(schedule, pipeline, virtual, m, latency=latency,
                           placement=lambda s, v, p: rank(s))  # fmt: skip
            weights = [(s, "W", mb) for s in range(n) for mb in range(m)] if schedules.splits_weights(schedule) else []
            for r, order in sim.order.items():
                assert sorted((s, k, mb) for s, k, mb, _ in order) == sorted(
                    [(s, "FB", mb) for s in range(n) if s == n - 1 and rank(s) == r
                     for mb in range(m)]
                    + [(s, k, mb) for s in range(n - 1) if rank(s) == r
                       for k in ("F", "B") for mb in range(m)]
                    + [t for t in weights if rank(t[0]) == r])  # fmt: skip
            if schedule in ("message", "zb"):
                assert all(sim.peak_full[s] <= max(schedules.default_limit(n) - s, 1) for s in range(n - 1)), sim.peak


def test_interleaving_shrinks_the_bubble():
    # the simulation reproduces the formula without virtual stages ...
    for p, m in ((2, 4), (4, 8), (4, 16)):
        assert simulate("message", p, 1, m).idle == pytest.approx(bubble_theory(p, m))
        assert simulate("1f1b", p, 1, m).idle == pytest.approx(bubble_theory(p, m))
    # ... and interleaving lowers it (message-driven: exactly to (p−1)/(v·m+p−1) here)
    assert simulate("message", 2, 2, 4).idle == pytest.approx(bubble_theory(2, 4, virtual=2))
    assert simulate("message", 2, 4, 8).idle == pytest.approx(bubble_theory(2, 8, virtual=4))
    assert simulate("gpipe", 4, 2, 16).idle < bubble_theory(4, 16)
    assert simulate("1f1b", 2, 2, 8).idle < bubble_theory(2, 8)


# --- the performance model and `axonn-jax plan` -------------------------------------------
def test_perf_model_prices_virtual_stages():
    import dataclasses

    from axonn_jax.perf import machines
    from axonn_jax.perf.comm import collectives
    from axonn_jax.perf.memory import in_flight, memory
    from axonn_jax.perf.options import Options
    from axonn_jax.perf.spec import gpt_spec
    from axonn_jax.perf.step import predict

    spec = gpt_spec(layers=8, hidden=512, heads=8, seq=256, batch=64, vocab=4096)
    machine = machines.get("frontier")
    plain = axonn_jax.Grid(z=2, pipeline=4)
    virtual = dataclasses.replace(plain, virtual=2)
    opts = Options(microbatches=16)
    a, b = predict(spec, plain, machine, opts), predict(spec, virtual, machine, opts)
    assert (a.bubble, b.bubble) == (pytest.approx(3 / 19), pytest.approx(3 / 35))
    assert a.compute_seconds == b.compute_seconds and b.step_seconds < a.step_seconds
    for mb in (1, 4, 16):  # the microbatch shortcut stays exact
        exact = predict(spec, virtual, machine, Options(microbatches=mb)).step_seconds
        assert b.step_seconds_with(mb) == pytest.approx(exact, rel=1e-12)
    # each microbatch crosses each rank boundary v times
    sends = {grid: [c for c in collectives(spec, grid, recompute=True, microbatches=16) if c.kind == "send"]
             for grid in (plain, virtual)}  # fmt: skip
    for x, y in zip(sends[plain], sends[virtual]):
        assert (y.elements, y.calls) == (2 * x.elements, 2 * x.calls)
    # activations in flight on the first rank: Σ_c min(m, limit − c·p) / v stage-microbatches
    assert in_flight(16, 4) == 5 and in_flight(16, 4, 2) == 7 and in_flight(3, 4, 2) == 3
    assert in_flight(1, 1) == 1
    ma, mb_ = memory(spec, plain, opts), memory(spec, virtual, opts)
    assert mb_.activations == pytest.approx(ma.activations * in_flight(16, 4, 2) / in_flight(16, 4))
    assert (mb_.params, mb_.grads, mb_.optimizer) == (ma.params, ma.grads, ma.optimizer)
    # V-shaped: the same bubble and messages; activations of the busiest rank min(2m, 2p + 1)/2
    # microbatches (tests/test_schedule_sim.py), below interleaved rank 0's 7 at m=16
    vee = dataclasses.replace(virtual, placement="v")
    c = predict(spec, vee, machine, opts)
    assert (c.bubble, c.step_seconds) == (b.bubble, b.step_seconds)
    assert (in_flight(16, 4, 2, placement="v"), in_flight(3, 4, 2, placement="v")) == (4.5, 3.0)
    assert memory(spec, vee, opts).activations == pytest.approx(ma.activations * 4.5 / 5)
    assert spec.problems(axonn_jax.Grid(pipeline=4, virtual=4, z=2)) == [
        "pipeline=4 × virtual=4 stages exceed the 8 blocks"]


def test_cli_plan_with_virtual_stages(capsys):
    from axonn_jax.cli import main

    argv = ["plan", "--gpus", "8", "--machine", "frontier", "--layers", "8", "--hidden", "64",
            "--heads", "4", "--seq", "32", "--batch", "8", "--vocab", "256", "--top", "50"]
    assert main([*argv, "--virtual", "2", "--json"]) == 0
    configs = __import__("json").loads(capsys.readouterr().out)
    piped = [c for c in configs if c["pipeline"] > 1]
    assert piped and all(c["virtual"] == 2 and "virtual=2" in c["grid_flag"] for c in piped)
    assert all(c["virtual"] == 1 for c in configs if c["pipeline"] == 1)
    for c in piped:
        grid = axonn_jax.Grid.parse(c["grid_flag"])
        assert (grid.pipeline, grid.virtual) == (c["pipeline"], 2)
        assert c["bubble"] == pytest.approx(bubble_theory(grid.pipeline, c["microbatches"], 2))
    assert main([*argv, "--virtual", "2"]) == 0  # the table: pipe and virt columns
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    assert {(str(c["pipeline"]), "2") for c in piped} <= {(r[5], r[7]) for r in rows}
    with pytest.raises(SystemExit):
        main([*argv, "--virtual", "0"])
    assert "--virtual must be >= 1" in capsys.readouterr().err
    assert main([*argv, "--virtual", "2", "--placement", "v", "--json"]) == 0
    piped = [c for c in __import__("json").loads(capsys.readouterr().out) if c["pipeline"] > 1]
    assert piped and all(axonn_jax.Grid.parse(c["grid_flag"]).placement == "v" for c in piped)
    assert main([*argv, "--virtual", "2", "--placement", "v"]) == 0  # the virt column: "2V"
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    assert {r[7] for r in rows if r[5] != "1"} == {"2V"}
    with pytest.raises(SystemExit):
        main([*argv, "--placement", "v"])
    assert "--placement v needs --virtual 2" in capsys.readouterr().err
