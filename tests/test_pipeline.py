"""The pipeline runtime: per-stage programs, dispatch queue, transports, traces.

Numerics follow tests/pipeline_cases.py (pipelined == plain Flax/optax, fp32).
In one process the stages sit on disjoint groups of the 8 simulated devices;
the MPI cases launch real processes (one or two stages per process).
"""

import json

import jax
import numpy as np
import pytest
from mpi_util import run_mpi
from pipeline_cases import (assert_compiles_once, compare_grads, compare_params, partitioned, reference, run_case,
                            save_references)

import axonn_jax
from axonn_jax.runtime.pipeline import schedules, timeline as trace
from axonn_jax.runtime.pipeline.tasks import Task, TaskKind

# pipeline 2 and 4, 4D-sharded stages, the repo's GPT and a third-party model
SINGLE_PROCESS = [("gpt", "pipeline=2,x=2,z=2"), ("hf_gpt2", "pipeline=4,z=2")]


@pytest.mark.slow
@pytest.mark.parametrize("model,grid", SINGLE_PROCESS)
def test_pipelined_equals_unpartitioned(model, grid, devices):
    schedules_ = ("message", "1f1b", "gpipe") if model == "gpt" else ("message",)
    # the AdamW steps run with master weights and optimizer state offloaded: the GPT's
    # updated on the host, GPT-2's streamed through each stage's devices in buckets
    failures = run_case(model, axonn_jax.Grid.parse(grid), schedules=schedules_, offload=True,
                        update_on="host" if model == "gpt" else "device")  # fmt: skip
    assert not failures, "\n".join(failures)


# automatic stages of the kinds that used to be cut 100/0 (or refused at pipeline=4): each
# stage holds parameters, and the pipelined run equals the plain one (5 AdamW steps)
NEW_CUTS = [("mlp", "pipeline=4,z=2"), ("cnn", "pipeline=2,x=2,z=2"), ("cnn", "pipeline=4,data=2"),
            ("encdec", "pipeline=4,z=2")]  # fmt: skip


@pytest.mark.parametrize("model,grid", NEW_CUTS)
def test_pipelined_equals_unpartitioned_on_automatic_cuts(model, grid, devices):
    plan = partitioned(model, grid)[1].plan  # the pm run_case then trains
    assert all(stage.params and stage.flops > 0 for stage in plan.stages), str(plan)
    failures = run_case(model, axonn_jax.Grid.parse(grid), microbatches=(4,))
    assert not failures, "\n".join(failures)


def _pm(model="gpt", grid="pipeline=2,x=2,z=2"):
    return partitioned(model, grid)  # the one run_case trains: its stage programs compiled once


@pytest.fixture(scope="module")
def gpt_two_stages(devices):
    """One partitioned GPT (pipeline=2, x=2, z=2) shared by the quick tests: compiled once."""
    case, pm = _pm()
    return case, pm, pm.init(jax.random.key(0))


def test_stage_flows_chain(devices):
    """Each stage receives exactly what the previous one sends; parameters match the plan."""
    case, pm = _pm(grid="pipeline=4,z=2")
    step = pm.value_and_grad(case.loss, inputs=case.inputs)
    programs = step.stage_programs(case.inputs(case.batch(1)))
    flows = [p.flow for p in programs]
    for a, b in zip(flows, flows[1:]):
        assert a.outbound == b.inbound and a.outbound_layouts == b.inbound_layouts
    assert flows[0].inbound == ()
    for flow, stage in zip(flows, pm.plan.stages):
        assert {pm.plan.params[i].path for i in flow.params} == set(stage.params)
    # the tied embedding is used by the first and last stage only
    assert pm.param_homes.users[[p.path for p in pm.plan.params].index("embed/embedding")] == (0, 3)


def test_compiles_once_across_steps(gpt_two_stages, caplog):
    """A recompilation guard: after the first step, steps compile nothing at all."""
    case, pm, params = gpt_two_stages
    assert_compiles_once(case, pm, params, caplog)


def test_a_step_leaves_no_runtime_thread_inside_jax(gpt_two_stages):
    """The queue's task watchers and the in-process transport's copy watchers have ended when
    a step returns: a daemon thread still inside JAX when the interpreter exits aborts the
    process ("FATAL: exception not rethrown", seen once under load)."""
    import threading

    case, pm, params = gpt_two_stages
    step = pm.value_and_grad(case.loss, inputs=case.inputs, microbatches=4)
    for _ in range(2):
        jax.block_until_ready(step(params, case.batch(4)))
        left = [t.name for t in threading.enumerate() if t.name.startswith(("axonn-task-watcher", "axonn-ready-"))]
        assert left == [], left


def test_trace_exports(tmp_path, gpt_two_stages):
    case, pm, params = gpt_two_stages
    step = pm.value_and_grad(case.loss, inputs=case.inputs, microbatches=4)
    step(params, case.batch(4))
    rows = step.trace(tmp_path / "t.json", tmp_path / "t.png")
    events = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert sorted((e["tid"], e["name"]) for e in events) == sorted(
        [(0, f"F{m}") for m in range(4)] + [(0, f"B{m}") for m in range(4)] + [(1, f"FB{m}") for m in range(4)]
    )
    assert (tmp_path / "t.png").stat().st_size > 10_000
    fractions = trace.idle_fractions(rows)
    assert set(fractions) == {0, 1} and all(0.0 <= f < 1.0 for f in fractions.values())


def test_stages_of_one_process_compute_at_the_same_time(gpt_two_stages):
    """Asynchronous dispatch: tasks of the two stages overlap in the trace, and the results
    equal, bit for bit, those of the same tasks run one at a time (``asynchronous=False``)."""
    case, pm, params = gpt_two_stages
    batch = case.batch(8)
    runs = {}
    for asynchronous in (True, False):
        step = pm.value_and_grad(case.loss, inputs=case.inputs, microbatches=8,
                                 asynchronous=asynchronous)  # fmt: skip
        step(params, batch)  # compile
        loss, grads = step(params, batch)
        runs[asynchronous] = (loss, grads, step.trace())
    (loss_a, grads_a, rows_a), (loss_s, grads_s, rows_s) = runs[True], runs[False]
    assert np.asarray(loss_a) == np.asarray(loss_s)
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_s), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    span = max(r[5] for r in rows_a) - min(r[4] for r in rows_a)
    assert trace.concurrent_seconds(rows_s) == 0.0  # one after another
    assert trace.concurrent_seconds(rows_a) > 0.1 * span, trace.concurrent_seconds(rows_a) / span


def test_remat_gives_the_same_gradients(gpt_two_stages):
    """Stage forwards under full rematerialisation (and without): the backward recomputes, and
    loss and gradients equal plain Flax on one device within pipeline_cases' bounds."""
    case, pm, _ = gpt_two_stages
    batch = case.batch(2)
    ref = reference(case, batch, steps=1)
    params = pm.shard(ref.init)
    for remat in ("none", "full"):
        step = pm.value_and_grad(case.loss, inputs=case.inputs, microbatches=2, remat=remat)
        loss, grads = step(params, batch)
        assert abs(float(loss) - ref.losses[0]) <= 1e-5 * abs(ref.losses[0]), (remat, loss, ref.losses)
        failures = compare_grads(pm.gather(grads), ref.grads, f"remat={remat}")
        assert not failures, "\n".join(failures)


def test_comparisons_fail_on_a_missing_leaf():
    """compare_grads/compare_params check every reference leaf: None or absent is a failure."""
    ref = {"a": {"kernel": np.ones((2, 2)), "bias": np.ones(2)}, "b": np.full(3, 2.0)}
    init = jax.tree.map(np.zeros_like, ref)
    assert not compare_grads(ref, ref, "same") and not compare_params(ref, ref, init, ref, "same")
    for got in ({"a": {"kernel": np.ones((2, 2)), "bias": None}, "b": np.full(3, 2.0)},
                {"a": {"kernel": np.ones((2, 2))}, "b": np.full(3, 2.0)}):  # fmt: skip
        assert compare_grads(got, ref, "t") == ["t grad a/bias: missing (None or absent)"]
        assert compare_params(got, ref, init, ref, "t") == ["t param a/bias: missing (None or absent)"]
    extra = {**ref, "c": np.ones(1)}
    assert compare_grads(extra, ref, "t") == ["t grad c: not in the reference"]


def _labels(order) -> list[str]:
    return [f"{t.kind}{t.microbatch}" for t in order]


def test_static_schedules():
    assert _labels(schedules.gpipe(0, 2, 2)) == ["F0", "F1", "B0", "B1"]
    order = schedules.one_f_one_b(1, 4, 6)  # stage 1 of 4: 2 warm-up forwards
    assert _labels(order[:4]) == ["F0", "F1", "F2", "B0"] and {t.stage for t in order} == {1}
    for stage in range(4):
        order = schedules.one_f_one_b(stage, 4, 6)
        in_flight = np.cumsum([1 if t.kind is TaskKind.FORWARD else -1 for t in order])
        assert in_flight.max() <= 4 - stage or stage == 3
        assert sorted(_labels(order)) == sorted(_labels(schedules.gpipe(stage, 4, 6)))
    assert trace.bubble_theory(4, 8) == pytest.approx(3 / 11)


class _Stage:
    """A stage's progress as the dispatch queue shows it to a schedule."""

    def __init__(self, forwards=0, backwards=0, cotangents=()):
        self.forwards, self.backwards = forwards, backwards
        self.cotangents = dict.fromkeys(cotangents)


def test_message_driven_schedule_picks_backward_first_and_keeps_the_limit():
    schedule = schedules.make_schedule("message", limit=2, stages=2)
    assert isinstance(schedule, schedules.MessageDriven) and schedule.limit == 2
    schedule.start([0], 2, 4)
    everything = lambda task: True  # noqa: E731
    F, B = TaskKind.FORWARD, TaskKind.BACKWARD
    # a returned gradient runs before a new forward
    assert schedule.pick({0: _Stage(1, 0, cotangents=[0])}, everything, 4) == Task(0, B, 0)
    # right after that backward, the next forward is injected at once (before gradient 1)
    assert schedule.pick({0: _Stage(2, 1, cotangents=[1])}, everything, 4) == Task(0, F, 2)
    # stage 0 keeps at most `limit` microbatches in flight
    assert schedule.pick({0: _Stage(2, 0)}, everything, 4) is None
    assert schedule.pick({0: _Stage(1, 0)}, everything, 4) == Task(0, F, 1)
    assert schedule.in_flight_bound(0) == 2 and schedule.in_flight_bound(1) == 1
    # nothing whose input has not arrived
    assert schedule.pick({1: _Stage(0, 0)}, lambda task: False, 4) is None


def test_static_schedule_follows_its_order():
    schedule = schedules.make_schedule("1f1b", limit=None, stages=2)
    schedule.start([0], 2, 3)
    ran = []
    for _ in range(6):
        task = schedule.pick({0: _Stage()}, lambda task: True, 3)
        ran.append(task)
        schedule.ran(task)
    assert ran == schedules.one_f_one_b(0, 2, 3)
    assert schedule.pick({0: _Stage()}, lambda task: True, 3) is None
    assert schedule.in_flight_bound(0) is None
    with pytest.raises(ValueError, match="schedule must be one of"):
        schedules.make_schedule("zigzag", limit=None, stages=2)


def test_single_process_host_collectives():
    from axonn_jax.runtime.collectives import SingleProcess, host_comm

    t = SingleProcess()
    assert t.allgather(3) == [3] and t.gather("x") == ["x"] and t.broadcast(5, root=0) == 5
    assert t.all_true(np.bool_(True)) is True and t.all_true(False) is False
    grads = [object()]
    assert t.sum_shared(grads, [(0, 1)], [0], [0], []) is grads
    assert isinstance(host_comm(), SingleProcess)  # no MPI job here


def test_bad_pipeline_inputs(gpt_two_stages):
    case, pm, params = gpt_two_stages
    with pytest.raises(ValueError, match=r"not divisible by microbatches × data × z = 3 × 1 × 2"):
        pm.value_and_grad(case.loss, inputs=case.inputs, microbatches=3)(params, case.batch(2))
    with pytest.raises(ValueError, match="schedule must be one of"):
        pm.value_and_grad(case.loss, inputs=case.inputs, schedule="zigzag")
    with pytest.raises(ValueError, match="limit must be >= 1"):
        pm.value_and_grad(case.loss, inputs=case.inputs, limit=0)
    with pytest.raises(ValueError, match="pm.mesh needs pipeline=1"):
        pm.mesh  # noqa: B018 - the property raises
    with pytest.raises(ValueError, match="parameter 'block_0/attn/key/kernel' is None"):
        broken = jax.tree_util.tree_map_with_path(
            lambda p, x: None if "block_0/attn/key/kernel" in jax.tree_util.keystr(p, simple=True,
                                                                                  separator="/") else x,
            params)  # fmt: skip
        pm.value_and_grad(case.loss, inputs=case.inputs)(broken, case.batch(1))


@pytest.mark.mpi
@pytest.mark.parametrize("sends", ["auto", "mpi4jax"])  # auto on CPU: host buffers
def test_mpi_transport_delivers_sharded_messages_in_flight_together(sends):
    """Six messages each way in flight at once (sharded fp32, bf16, typed keys), some
    handed over while still computing, polled out of order: all arrive intact, sent
    from host buffers or by mpi4jax from the device buffers."""
    result = run_mpi(2, "transport_messages.py", devices_per_process=2, timeout=300,
                     env={"AXONN_PIPELINE_SENDS": sends})  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    # the ranks' lines may interleave in mpiexec's merged stdout: count, do not split
    assert [result.stdout.count(f"OK transport {r}") for r in (0, 1)] == [1, 1], result.stdout


@pytest.fixture(scope="session")
def saved_references(tmp_path_factory):
    """Path of the plain Flax/optax results for a model, computed once in this process."""
    folder = tmp_path_factory.mktemp("pipeline_references")

    def path(model: str) -> str:
        file = folder / f"{model}.pkl"
        if not file.exists():
            save_references(model, file)
        return str(file)

    return path


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(960)  # the job's own 900 s timeout fires first, with its output
@pytest.mark.parametrize("n,cases,collectives", [
    # cases of one job share its launch: the same process count, devices per process and collectives
    (2, [("gpt", "pipeline=2", ["--schedules=message,1f1b", "--offload"]),
         # interleaved (stages 0,2 | 1,3), zero bubble (B and W split) included
         ("gpt", "pipeline=2,virtual=2", ["--schedules=message,1f1b,zb,zb-h1", "--trajectory-schedule=zb"]),
         # V-shaped (stages 0,3 | 1,2), the same schedules and ZB-V
         ("gpt", "pipeline=2,virtual=2,placement=v", ["--schedules=message,1f1b,zb,zb-h1,zb-v",
                                                      "--trajectory-schedule=zb"]),
         # scan over stacked layers cut into 4 stages: each process's stages read two ranges of
         # rows of the stack; their gradients meet row by row (layer_rows.owned_rows)
         ("scan_gpt", "pipeline=2,virtual=2", ["--schedules=message,zb"])],
     "local"),
    (2, [("gpt", "pipeline=2,x=2,z=2", [])], "local"),  # tensor-parallel collectives inside each process
    (4, [("gpt", "pipeline=2,data=2", [])], "gloo"),  # data parallel across processes in a stage
    (4, [("hf_gpt2", "pipeline=4", ["--schedules=message,gpipe"]),  # a published model
         # zero bubble, one stage per process
         ("gpt", "pipeline=4", ["--schedules=zb,zb-h1", "--trajectory-schedule=zb"]),
         # ZB-V on the V-shaped placement over 4 processes (stages 0,7 | 1,6 | 2,5 | 3,4)
         ("gpt", "pipeline=4,virtual=2,placement=v", ["--schedules=zb-v", "--trajectory-schedule=zb-v"])],
     "local"),
], ids=lambda v: "+".join(f"{m}-{g}" for m, g, _ in v) if isinstance(v, list) else None)  # fmt: skip
def test_pipelined_equals_unpartitioned_under_mpiexec(n, cases, collectives, saved_references):
    """The CPU collectives follow the grid: in-process ("local") where every stage fits in
    one process, gloo where a stage spans processes; training equals the plain run in both."""
    per_process = {axonn_jax.Grid.parse(grid).size // n for _, grid, _ in cases}
    assert len(per_process) == 1, "the cases of one launch need the same devices per process"
    args = []
    for model, grid, options in cases:
        args += ["--and"] * bool(args) + [model, grid, *options, f"--references={saved_references(model)}"]
    result = run_mpi(n, "pipeline_equivalence.py", *args, devices_per_process=per_process.pop(),
                     timeout=900)  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    # the ranks' lines may interleave in mpiexec's merged stdout: count, do not split
    assert result.stdout.count("OK rank") == n * len(cases), result.stdout
    for model, grid, _ in cases:
        assert result.stdout.count(f" {model} {axonn_jax.Grid.parse(grid)} ") == n, (model, grid, result.stdout)
    assert result.stdout.count(f"collectives={collectives}") == n * len(cases), result.stdout


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(960)
def test_mpi4jax_sends_equal_unpartitioned(saved_references):
    """The mpi4jax device-buffer sends (the default for GPUs with a CUDA-aware bridge),
    forced on CPU: pipelined training still equals the plain run."""
    result = run_mpi(2, "pipeline_equivalence.py", "gpt", "pipeline=2", "--schedules=message,1f1b",
                     f"--references={saved_references('gpt')}", timeout=900,
                     env={"AXONN_PIPELINE_SENDS": "mpi4jax"})  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert result.stdout.count("OK rank") == 2, result.stdout


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(660)
def test_message_driven_queue_reorders_around_a_slow_stage():
    """Stage 1 stalls on microbatch 0: the queue keeps stage 0 busy and beats static 1F1B."""
    result = run_mpi(2, "pipeline_schedules.py", timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    message, static = summary["message"], summary["1f1b"]
    assert message["makespan"] <= static["makespan"], summary
    # reordering: stage 0 ran forwards of later microbatches before the first backward
    assert message["forwards_before_first_backward"] > static["forwards_before_first_backward"]
    assert message["peak_in_flight"] <= summary["limit"]
    assert message["idle"]["0"] < static["idle"]["0"], summary


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("n,grid,how", [(2, "pipeline=2", "raise"), (2, "pipeline=2", "kill"),
                                        (4, "pipeline=2,data=2", "kill")])
def test_failing_rank_ends_pipelined_job(n, grid, how):  # fmt: skip
    import time

    per_process = axonn_jax.Grid.parse(grid).size // n
    start = time.monotonic()
    result = run_mpi(n, "pipeline_failure.py", grid, how, devices_per_process=per_process,
                     timeout=300)  # fmt: skip
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert elapsed < 240, f"job took {elapsed:.0f} s to end"
    if how == "raise":
        assert "injected failure on rank 1" in result.stderr, result.stderr[-3000:]


def test_a_train_step_exports_its_trace_as_documented(tmp_path, gpt_two_stages):
    """docs/pipeline.md's ``step.trace("trace.json", "timeline.png")`` on a train step (it had
    only ``step.value_and_grad.trace``: AttributeError)."""
    import optax

    case, pm, params = gpt_two_stages
    step = pm.train_step(case.loss, optax.sgd(0.1), inputs=case.inputs, microbatches=2)
    with pytest.raises(RuntimeError, match="no step has run yet"):
        step.trace()
    step(*step.init(jax.tree.map(lambda x: x.copy(), params)), case.batch(2))  # the fixture's stay undonated
    rows = step.trace(tmp_path / "t.json", tmp_path / "t.png")
    assert rows and (tmp_path / "t.json").stat().st_size > 0 and (tmp_path / "t.png").exists()
