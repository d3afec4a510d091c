"""The ahead-of-time memory check of planned configurations (one tiny MLP, compiled, never run)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp

from axonn_jax.cli import main
from axonn_jax.memory_check import check_memory, format_checks
from axonn_jax.models import MLP
from axonn_jax.partitioner.grid import Grid
from axonn_jax.perf import machines
from axonn_jax.perf.step import predict
from axonn_jax.perf.traced import spec_from_model
from axonn_jax.search import search

MODEL = MLP(features=(64, 64, 16))
INPUTS = jax.ShapeDtypeStruct((16, 32), jnp.float32)


def test_compiled_bytes_are_reported_and_a_config_over_the_limit_is_dropped(devices):
    spec = spec_from_model(MODEL, INPUTS)
    [top] = search(spec, 8, machines.get("frontier"), top=1, pipeline=False).ranked
    piped = predict(spec, Grid(x=2, y=2, pipeline=2), machines.get("frontier"))
    checks = check_memory(MODEL, (INPUTS,), [top, piped], limit_bytes=4096, devices=devices)
    compiled, unchecked = checks
    # at least the fp32 parameters, gradients and both Adam moments this device holds
    params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(MODEL.init, jax.random.key(0), INPUTS)))
    assert compiled.compiled >= 4 * 4 * params / top.grid.size
    assert not compiled.fits and compiled.predicted == top.memory.device
    assert unchecked.compiled is None and unchecked.fits and "pipelined" in unchecked.note
    assert dataclasses.replace(compiled, limit=compiled.compiled).fits
    table = format_checks(checks)
    assert "dropped (> 0.00 MiB)" in table and "kept, unchecked (pipelined" in table


def test_cli_check_memory_drops_what_does_not_compile_within_the_limit(monkeypatch, capsys):
    """The CLI's wiring, with the compilation stubbed (the test above compiles): the top K are
    handed to check_memory with the machine's memory as the limit, one that does not fit is
    dropped from the ranking, the rest are listed unchecked."""
    import axonn_jax.memory_check as memory_check

    def fake(model, inputs, predictions, *, limit_bytes):
        assert isinstance(model, MLP) and inputs == (INPUTS,) and len(predictions) == 2
        assert limit_bytes == machines.get("frontier").memory_gib * 2**30
        return [memory_check.MemoryCheck(p, limit_bytes, compiled=int(limit_bytes) + i)
                for i, p in enumerate(predictions)]  # the second one is over the limit by a byte

    monkeypatch.setattr(memory_check, "check_memory", fake)
    monkeypatch.setattr("axonn_jax.cli._factory", lambda parser, target: lambda: (MODEL, INPUTS))
    argv = ["plan", "--gpus", "8", "--machine", "frontier", "--model", "tiny:make", "--no-pipeline",
            "--top", "3", "--check-memory", "2"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["memory_check"]["fits"] for r in rows] == [True, True]
    assert rows[0]["memory_check"]["compiled_bytes"] > 0 and rows[1]["memory_check"]["compiled_bytes"] is None
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "compiled ahead of time" in out and out.count("dropped (>") == 1 and "beyond the top 2" in out
