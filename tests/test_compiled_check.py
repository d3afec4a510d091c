"""The ahead-of-time check of planned configurations (one tiny MLP, compiled, never run): memory and step time."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

from axonn_jax.cli import _grid_flag, main
from axonn_jax.compiled_check import CompiledCheck, check_compiled, format_checks, program_cost, rerank
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

    def fake(model, inputs, predictions, *, limit_bytes, machine):
        assert isinstance(model, MLP) and inputs == (INPUTS,) and len(predictions) == 3
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


def test_cli_refuses_a_negative_check_count(capsys):
    """``--check -1`` (either spelling) is a usage error naming the flag, before any planning."""
    for flag in ("--check", "--check-memory"):
        with pytest.raises(SystemExit) as exit_info:
            main(["plan", "--gpus", "8", "--machine", "frontier", "--layers", "2", "--hidden", "128",
                  "--heads", "4", "--seq", "64", "--batch", "16", "--vocab", "256", flag, "-1"])  # fmt: skip
        assert exit_info.value.code == 2
        assert "--check must be >= 0, got -1" in capsys.readouterr().err
