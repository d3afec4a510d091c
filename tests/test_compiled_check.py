"""The ahead-of-time check of planned configurations (one tiny MLP, compiled, never run): memory and step time."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

from axonn_jax.cli import _grid_flag, main
from axonn_jax.compiled_check import (CompiledCheck, check_compiled, format_checks, program_cost, rerank,
                                      synthetic_batch, to_check)
from axonn_jax.models import MLP
from axonn_jax.partitioner.grid import Grid
from axonn_jax.perf import machines
from axonn_jax.perf.compiled import ProgramTime
from axonn_jax.perf.options import Options
from axonn_jax.perf.step import predict
from axonn_jax.perf.traced import spec_from_model
from axonn_jax.search import search
from compiled_steps import compile_apply_step

MODEL = MLP(features=(64, 64, 16))
INPUTS = jax.ShapeDtypeStruct((16, 32), jnp.float32)


def test_compiled_bytes_are_reported_and_a_config_over_the_limit_is_dropped(devices):
    spec = spec_from_model(MODEL, INPUTS)
    [top] = search(spec, 8, machines.get("frontier"), top=1, pipeline=False).ranked
    piped = predict(spec, Grid(x=2, y=2, pipeline=2), machines.get("frontier"))
    checks = check_compiled(MODEL, (INPUTS,), [top, piped], limit_bytes=4096, devices=devices,
                            machine=machines.get("frontier"))  # fmt: skip
    compiled, unchecked = checks
    assert compiled.time.total > compiled.time.compute > 0 and unchecked.time is None
    # at least the fp32 parameters, gradients and both Adam moments this device holds
    params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(MODEL.init, jax.random.key(0), INPUTS)))
    assert compiled.compiled >= 4 * 4 * params / top.grid.size
    assert not compiled.fits and compiled.predicted == top.memory.device
    assert unchecked.compiled is None and unchecked.fits and "pipelined" in unchecked.note
    assert dataclasses.replace(compiled, limit=compiled.compiled).fits
    table = format_checks(checks)
    assert "dropped (> 0.00 MiB)" in table and "kept, unchecked (pipelined" in table
    assert f"{compiled.time.total * 1e3:.4g}" in table.splitlines()[2]


def test_the_check_compiles_the_offloaded_update_the_prediction_priced(monkeypatch, devices):
    """An offloaded configuration is compiled with the update where the planner priced it
    (streamed, in its buckets); its compiled device bytes hold no Adam state."""
    import axonn_jax.compiled_check as compiled_check

    asked = []
    partition = compiled_check.partition

    def recording_partition(*args, **kwargs):
        pm = partition(*args, **kwargs)
        train_step = pm.train_step

        def recording_train_step(*a, **k):
            asked.append({key: k[key] for key in ("offload", "update_on", "bucket_bytes")})
            return train_step(*a, **k)

        pm.train_step = recording_train_step
        return pm

    monkeypatch.setattr(compiled_check, "partition", recording_partition)
    spec, grid = spec_from_model(MODEL, INPUTS), Grid(x=2, z=2, data=2)
    frontier = machines.get("frontier")
    priced = {o: predict(spec, grid, frontier, Options(offload=o, update_on="device", bucket_bytes=1024))
              for o in (False, True)}  # fmt: skip
    on_device, streamed = check_compiled(MODEL, (INPUTS,), [priced[False], priced[True]], limit_bytes=2**30,
                                         devices=devices)  # fmt: skip
    assert asked[1] == {"offload": True, "update_on": "device", "bucket_bytes": 1024}
    assert asked[0]["offload"] is False
    # the fp32 masters and Adam state live on the host: the device holds bf16 weights and gradients
    assert streamed.compiled < on_device.compiled


def test_cli_check_drops_what_does_not_fit_and_reorders_by_the_compiled_time(monkeypatch, capsys):
    """The CLI's wiring, with the compilation stubbed (the tests above compile): the top K are
    handed to check_compiled with the machine's memory as the limit and the machine itself;
    one that does not fit is dropped, the checked ones are reordered by their compiled step
    time (the launch line names the faster), the rest are listed unchecked after them. The
    old flag name still works."""
    import axonn_jax.compiled_check as compiled_check

    handed = []

    def fake(model, inputs, predictions, *, limit_bytes, machine, trial_steps):
        assert isinstance(model, MLP) and inputs == (INPUTS,) and len(predictions) == 3 and trial_steps == 0
        assert limit_bytes == machine.memory_gib * 2**30 and machine.name == "frontier"
        handed[:] = predictions
        # the second is faster compiled than the first; the third is over the limit by a byte
        return [compiled_check.CompiledCheck(p, limit_bytes, compiled=int(limit_bytes) - 1 + i,
                                             time=ProgramTime(compute=2.0 - i, memory=0.0, comm=0.0))
                for i, p in enumerate(predictions)]  # fmt: skip

    monkeypatch.setattr(compiled_check, "check_compiled", fake)
    monkeypatch.setattr("axonn_jax.cli._factory", lambda parser, target: lambda: (MODEL, INPUTS))
    for flag in ("--check", "--check-memory"):
        argv = ["plan", "--gpus", "8", "--machine", "frontier", "--model", "tiny:make", "--no-pipeline",
                "--top", "4", flag, "3"]  # fmt: skip
        assert main([*argv, "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert [r["grid_flag"] for r in rows] == [_grid_flag(handed[1].grid), _grid_flag(handed[0].grid),
                                                  rows[2]["grid_flag"]]  # fmt: skip
        assert [r["compiled_check"]["compiled_seconds"] for r in rows] == [1.0, 2.0, None]
        assert rows[2]["compiled_check"]["note"] == "beyond the top 3"
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "compiled ahead of time" in out and out.count("dropped (>") == 1 and "beyond the top 3" in out
    assert _grid_flag(handed[1].grid) in out.splitlines()[-1]  # the launch line: the faster compiled


def test_rerank_orders_the_checked_among_the_places_they_hold():
    """Checked configurations trade places by compiled time; an unchecked one keeps its place;
    one that does not fit is dropped."""
    spec = spec_from_model(MODEL, INPUTS)
    frontier = machines.get("frontier")
    a, p, b, c = (predict(spec, g, frontier) for g in (Grid(x=8), Grid(x=2, pipeline=4), Grid(y=8), Grid(data=8)))
    timed = lambda pred, s, fits=True: CompiledCheck(pred, 1.0, compiled=1 if fits else 2,  # noqa: E731
                                                     time=ProgramTime(s, 0.0, 0.0))  # fmt: skip
    checks = [timed(a, 3.0), CompiledCheck(p, 1.0, note="pipelined"), timed(b, 1.0), timed(c, 0.5, fits=False)]
    assert [x.prediction for x in rerank(checks)] == [b, p, a]
    assert [x.prediction for x in rerank([timed(a, 1.0), timed(b, 2.0)])] == [a, b]


def test_a_trial_times_each_checked_step_on_the_devices(devices):
    """``trial_steps``: every one-program configuration that fits runs on the devices and gets
    its median step; a pipelined one is not timed; the table shows the measured ms."""
    spec = spec_from_model(MODEL, INPUTS)
    frontier = machines.get("frontier")
    preds = [predict(spec, g, frontier) for g in (Grid(x=2, y=2, z=2), Grid(data=8), Grid(x=2, pipeline=4))]
    calls = []

    class Counted:  # counts the steps run through each compiled program
        def __init__(self, trial):
            self.trial = trial

        def __call__(self, *args):
            calls.append(id(self))
            return self.trial(*args)

    import axonn_jax.compiled_check as compiled_check

    real = compiled_check._Trial.__init__

    def counted_init(self, compiled, make_args):
        real(self, Counted(compiled), make_args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compiled_check._Trial, "__init__", counted_init)
        checks = check_compiled(MODEL, (INPUTS,), preds, limit_bytes=2**30, machine=frontier, devices=devices,
                                trial_steps=3)  # fmt: skip
    # two passes of a warm-up and 3 timed steps, for each of the two one-program configurations
    assert len(calls) == 2 * 2 * (1 + 3) and len(set(calls)) == 2
    assert all(c.measured > 0 for c in checks[:2]) and checks[2].measured is None
    assert f"{checks[1].measured * 1e3:.4g}" in format_checks(checks).splitlines()[3]
    assert check_compiled(MODEL, (INPUTS,), preds[:1], limit_bytes=2**30, devices=devices)[0].measured is None
    with pytest.raises(ValueError, match="trial_steps must be >= 0"):
        check_compiled(MODEL, (INPUTS,), preds, limit_bytes=2**30, trial_steps=-1)


@pytest.mark.mpi
@pytest.mark.timeout(210)
def test_a_trial_under_mpi_gives_every_rank_the_same_times():
    """Two processes time the same steps a little differently; each configuration's measured
    time is the slowest process's on every rank, so every rank reranks alike."""
    from mpi_util import run_mpi

    result = run_mpi(2, "trial_agreement.py", devices_per_process=4, timeout=180)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    lines = sorted(line.split() for line in result.stdout.splitlines() if line.startswith("TRIAL"))
    assert [line[1] for line in lines] == ["0", "1"], result.stdout
    assert lines[0][2:] == lines[1][2:] and all(float(t) > 0 for t in lines[0][2:4]), lines


def test_rerank_follows_the_measured_time_over_the_compiled_one():
    """After a trial the measured step orders the checked configurations, even against the
    compiled estimate; one not timed keeps its place."""
    spec = spec_from_model(MODEL, INPUTS)
    frontier = machines.get("frontier")
    a, p, b = (predict(spec, g, frontier) for g in (Grid(x=8), Grid(x=2, pipeline=4), Grid(y=8)))
    timed = lambda pred, compiled_s, measured: CompiledCheck(pred, 1.0, compiled=1,  # noqa: E731
                                                             time=ProgramTime(compiled_s, 0.0, 0.0),
                                                             measured=measured)  # fmt: skip
    checks = [timed(a, 1.0, 0.3), CompiledCheck(p, 1.0, note="pipelined"), timed(b, 2.0, 0.2)]
    assert [x.prediction for x in rerank(checks)] == [b, p, a]
    assert [x.as_dict()["measured_seconds"] for x in rerank(checks)] == [0.2, None, 0.3]


def test_a_synthetic_batch_has_the_examples_shapes_and_sharding(devices):
    """Floats are drawn, integers (token ids) are zeros, arrays are kept; all on the sharding."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(Mesh(devices, ("b",)), P("b"))
    given = jnp.arange(8.0)
    floats, ints, kept = synthetic_batch([jax.ShapeDtypeStruct((8, 4), jnp.bfloat16),
                                          jax.ShapeDtypeStruct((8, 3), jnp.int32), given], sharding)  # fmt: skip
    assert floats.dtype == jnp.bfloat16 and floats.shape == (8, 4) and float(jnp.std(floats.astype(float))) > 0.1
    assert ints.dtype == jnp.int32 and not ints.any() and (kept == given).all()
    assert all(x.sharding == sharding for x in (floats, ints, kept))


def test_the_compiled_time_prices_the_programs_flops_bytes_and_collectives(devices):
    """A compiled MLP step on x=2,y=2,z=2: XLA's FLOPs are one device's (the three matmuls of
    forward and backward, split 8 ways, within the elementwise work and the optimizer); its
    collectives run over groups of 2 nested inside 1 (x), 2 (y) and 4 (z) devices; each term
    is priced with the profile as the module says; on data=8 only all-reduces over all 8."""
    cost = program_cost(compile_apply_step(MODEL, INPUTS, Grid(x=2, y=2, z=2)), 8)
    matmul_flops = 3 * 2 * INPUTS.shape[0] * (32 * 64 + 64 * 64 + 64 * 16) / 8
    assert matmul_flops < cost.flops < 2 * matmul_flops
    assert cost.bytes_accessed > 0
    assert {c.size for c in cost.collectives} == {2} and {c.inner for c in cost.collectives} == {1, 2, 4}
    frontier = machines.get("frontier")
    t = cost.time(frontier)
    assert t.compute == cost.flops / frontier.flops_per_second
    assert t.memory == cost.bytes_accessed / (frontier.memory_gbps * 1e9)
    assert t.comm == sum(frontier.seconds(c.wire_bytes, 1, c.inner, c.size) for c in cost.collectives) > 0
    data = program_cost(compile_apply_step(MODEL, INPUTS, Grid(data=8)), 8)  # gradients, loss: all 8
    assert {(c.kind, c.size, c.inner) for c in data.collectives} == {("all-reduce", 8, 1)}


def test_cli_trial_reorders_by_the_measured_step(monkeypatch, capsys):
    """``--trial`` hands its steps to check_compiled; the measured step orders the checked
    configurations and the launch line; the JSON carries it. Without --check it is refused."""
    import axonn_jax.compiled_check as compiled_check

    def fake(model, inputs, predictions, *, limit_bytes, machine, trial_steps):
        assert trial_steps == 4
        # compiled says the first is faster; measured says the last
        return [compiled_check.CompiledCheck(p, limit_bytes, compiled=1, time=ProgramTime(1.0 + i, 0.0, 0.0),
                                             measured=0.5 - 0.1 * i) for i, p in enumerate(predictions)]  # fmt: skip

    monkeypatch.setattr(compiled_check, "check_compiled", fake)
    monkeypatch.setattr("axonn_jax.cli._factory", lambda parser, target: lambda: (MODEL, INPUTS))
    argv = ["plan", "--gpus", "8", "--machine", "frontier", "--model", "tiny:make", "--no-pipeline", "--top", "3",
            "--check", "2", "--within", "0", "--trial", "4"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["compiled_check"]["measured_seconds"] for r in rows] == [0.4, 0.5, None]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "reranked by the median of 4 steps run here" in out
    assert rows[0]["grid_flag"] in out.splitlines()[-1]
    for bad, message in ((["--trial", "3"], "add --check"), (["--check", "--trial", "-1"], "--trial must be >= 0"),
                         (["--within", "0.1"], "add --check"), (["--check", "--within", "-0.1"], "--within must be >= 0")):
        with pytest.raises(SystemExit) as exit_info:
            main(["plan", "--gpus", "8", "--machine", "frontier", "--layers", "2", "--hidden", "128", "--heads",
                  "4", "--seq", "64", "--batch", "16", "--vocab", "256", *bad])  # fmt: skip
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_the_check_takes_the_top_k_and_the_near_ties_of_the_first():
    """:func:`to_check`: the top K, widened to every configuration predicted within ``within``
    of the first's step time (the model does not order those), in the ranked order."""
    spec = spec_from_model(MODEL, INPUTS)
    ranked = search(spec, 8, machines.get("frontier"), top=8, pipeline=False).ranked
    first = ranked[0].step_seconds
    near = [p for p in ranked if p.step_seconds <= 1.1 * first]
    assert 1 < len(near) < len(ranked)  # the case tests something: near ties, and others beyond them
    assert to_check(ranked, 1, within=0.1) == near
    assert to_check(ranked, 1, within=0.0) == [ranked[0]] == to_check(ranked[:1], 1)
    assert to_check(ranked, len(near) + 1, within=0.1) == list(ranked[: len(near) + 1])  # K beyond the ties
    assert to_check((), 3) == []


def test_cli_check_compiles_the_near_ties_and_a_trial_may_pick_one_beyond_the_top_k(monkeypatch, capsys):
    """``--check 1``: the first and (by default) every configuration predicted within 10% of
    it are handed to check_compiled; a near tie measured fastest is the launch line's; the
    table says how many near ties were checked."""
    import axonn_jax.compiled_check as compiled_check

    handed = []

    def fake(model, inputs, predictions, *, limit_bytes, machine, trial_steps):
        handed[:] = predictions
        return [compiled_check.CompiledCheck(p, limit_bytes, compiled=1, time=ProgramTime(1.0, 0.0, 0.0),
                                             measured=1.0 - 0.1 * i) for i, p in enumerate(predictions)]  # fmt: skip

    monkeypatch.setattr(compiled_check, "check_compiled", fake)
    monkeypatch.setattr("axonn_jax.cli._factory", lambda parser, target: lambda: (MODEL, INPUTS))
    argv = ["plan", "--gpus", "8", "--machine", "frontier", "--model", "tiny:make", "--no-pipeline", "--top", "8",
            "--check", "1", "--trial", "2"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    first = handed[0].step_seconds
    assert len(handed) > 1 and all(p.step_seconds <= 1.1 * first for p in handed)
    assert all(r["step_seconds"] > 1.1 * first for r in rows[len(handed):]) and rows[len(handed):]
    assert rows[0]["grid_flag"] == _grid_flag(handed[-1].grid)  # measured fastest: the last near tie
    assert rows[len(handed)]["compiled_check"]["note"] == "beyond the top 1 and their near ties"
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"the top 1 and {len(handed) - 1} more predicted within 10% of the first compiled ahead" in out
    assert _grid_flag(handed[-1].grid) in out.splitlines()[-1]


def test_cli_refuses_a_negative_check_count(capsys):
    """``--check -1`` (either spelling) is a usage error naming the flag, before any planning."""
    for flag in ("--check", "--check-memory"):
        with pytest.raises(SystemExit) as exit_info:
            main(["plan", "--gpus", "8", "--machine", "frontier", "--layers", "2", "--hidden", "128",
                  "--heads", "4", "--seq", "64", "--batch", "16", "--vocab", "256", flag, "-1"])  # fmt: skip
        assert exit_info.value.code == 2
        assert "--check must be >= 0, got -1" in capsys.readouterr().err
