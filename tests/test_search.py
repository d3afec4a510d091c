"""The planner's search over grid × virtual stages × recompute × schedule × offload × microbatches.

Pure (no devices): the search is checked against a brute force that prices every
configuration with :func:`~axonn_jax.perf.step.predict` and
:func:`~axonn_jax.perf.memory.memory` directly (no shortcuts), and against IPDPS'22
eq. 3 by hand where recompute is what makes a grid fit.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re

import pytest

from axonn_jax.cli import main
from axonn_jax.partitioner.grid import Grid
from axonn_jax.perf import machines
from axonn_jax.perf.memory import memory
from axonn_jax.perf.options import Options
from axonn_jax.perf.spec import gpt_spec
from axonn_jax.perf.step import predict
from axonn_jax.search import PRICED_SCHEDULES, grids, search

SPEC = gpt_spec(layers=8, hidden=1024, heads=8, seq=256, batch=8, vocab=4096)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _every_configuration(spec, devices, machine):
    """{grid: [prediction, ...]}: every virtual, recompute, schedule, offload and
    microbatch count of every grid that divides ``spec``, priced in full."""
    out = {}
    for grid in grids(devices):
        if spec.problems(grid):
            continue
        p = grid.pipeline
        virtuals = [v for v in range(1, spec.layers // p + 1) if v == 1 or spec.layers % (p * v) == 0]
        schedules = PRICED_SCHEDULES if p > 1 else PRICED_SCHEDULES[:1]
        out[grid] = [
            predict(spec, dataclasses.replace(grid, virtual=v), machine,
                    Options(recompute=rec, schedule=s, offload=off, update_on=where, microbatches=mb))
            for v in (virtuals if p > 1 else [1])
            for rec, s, (off, where) in itertools.product(
                (False, True), schedules, ((False, "host"), (True, "host"), (True, "device")))
            for mb in _divisors(spec.batch // grid.batch_shards)
        ]  # fmt: skip
    return out


def test_search_takes_each_grids_fastest_fitting_configuration():
    """At two memory sizes the search's choice for every grid is the brute force's (time and
    fit), and between them every searched dimension decides some grid's configuration."""
    frontier = machines.get("frontier")
    everything = _every_configuration(SPEC, 8, frontier)
    used = set()
    for gib in (0.4, 0.8):
        machine = dataclasses.replace(frontier, memory_gib=gib)
        limit, host = gib * 2**30, machine.host_memory_gib * 2**30
        result = search(SPEC, 8, machine, top=1000, schedules=PRICED_SCHEDULES)
        chosen = {dataclasses.replace(p.grid, virtual=1): p for p in result.ranked}
        for grid, preds in everything.items():
            fits = [q for q in preds if q.memory.device <= limit and q.memory.host <= host]
            if not fits:
                assert grid not in chosen
                continue
            best = min(q.step_seconds for q in fits)
            got = chosen[grid]
            assert got.step_seconds == pytest.approx(best, rel=1e-9), (gib, grid, got.options)
            assert got.memory.device <= limit
            o = got.options
            used |= {("virtual", got.grid.virtual > 1), ("recompute", o.recompute),
                     ("offload", o.offload and o.update_on), ("schedule", o.schedule)}  # fmt: skip
        assert len(result.ranked) == len(chosen) == result.feasible
    assert {("virtual", True), ("recompute", True), ("recompute", False), ("offload", "host"),
            ("schedule", "zb"), ("schedule", "zb-h1"), ("schedule", "message")} <= used  # fmt: skip


def test_an_offloaded_update_is_streamed_where_the_host_updates_slowly():
    """Offload must be on (the state does not fit the device). Where the host's update is
    slow the step streams the host state through the device instead (24 B/param over the
    link against 4, the update at device speed), if a bucket fits; the launch line says so."""
    spec = gpt_spec(layers=4, hidden=1024, heads=8, seq=256, batch=8, vocab=4096)
    # z=8: 179 MiB per device without offload, 98 with it, 110 with one 4 MiB bucket streamed
    tight = dataclasses.replace(machines.get("h100-node"), memory_gib=0.12)
    small_buckets = Options(bucket_bytes=4 * 2**20)
    grid = Grid(z=8)
    for host_gbps, where in ((1.0, "device"), (1e4, "host")):
        machine = dataclasses.replace(tight, host_memory_gbps=host_gbps)
        ranked = search(spec, 8, machine, options=small_buckets, top=1000, pipeline=False, recompute="on").ranked
        [got] = [p for p in ranked if p.grid == grid]
        assert got.options.offload and got.options.update_on == where, (host_gbps, got.options)
        other = predict(spec, grid, machine, dataclasses.replace(
            got.options, update_on="host" if where == "device" else "device"))  # fmt: skip
        assert got.step_seconds < other.step_seconds
    assert grid not in {p.grid for p in search(spec, 8, tight, options=small_buckets, top=1000, pipeline=False,
                                               recompute="on", offload="off").ranked}  # fmt: skip
    roomy = search(spec, 8, dataclasses.replace(tight, memory_gib=80), top=1000, pipeline=False).ranked
    assert not any(p.options.offload for p in roomy)
    with pytest.raises(ValueError, match="update_on must be one of"):
        search(spec, 8, tight, update_on="gpu")


def test_cli_launch_line_streams_the_update_it_priced(capsys):
    args = ["plan", "--gpus", "8", "--machine", "h100-node", "--top", "1", "--no-pipeline", "--offload", "on",
            "--update-on", "device", "--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32",
            "--batch", "8", "--vocab", "256"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    [row] = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert row[10] == "device"
    launch = out.rstrip().splitlines()[-1]
    assert "--offload --update-on device" in launch and 'offload=True, update_on="device"' in launch
    assert main([*args, "--json"]) == 0
    [config] = json.loads(capsys.readouterr().out)
    assert config["offload"] and config["update_on"] == "device"


def test_recompute_is_picked_where_only_it_fits_and_priced_with_its_extra_forward():
    """GPT on data=2, one sequence per replica: 138 MiB per device without recompute, 92 MiB
    with it. Under a 100 MiB limit the search must pick recompute, and its compute time is
    IPDPS'22 eq. 3 (which counts recompute's extra forward: 4 passes, not 3) by hand."""
    b, s, l, h, v = 2, 1024, 4, 256, 1024
    spec = gpt_spec(layers=l, hidden=h, heads=4, seq=s, batch=b, vocab=v)
    machine = dataclasses.replace(machines.get("frontier"), memory_gib=100 / 1024)
    ranked = search(spec, 2, machine, top=1000, pipeline=False).ranked
    [got] = [p for p in ranked if p.grid == Grid(data=2)]
    assert got.options.recompute and got.options.microbatches == 1
    eq3 = 96 * b * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))
    assert got.compute_seconds == pytest.approx(eq3 / 2 / machine.flops_per_second, rel=1e-12)
    roomy = search(spec, 2, machines.get("frontier"), top=1000, pipeline=False, recompute="off").ranked
    [free] = [p for p in roomy if p.grid == Grid(data=2)]
    assert not free.options.recompute and free.compute_seconds < got.compute_seconds


def test_cli_table_shows_the_searched_dimensions(capsys):
    """The table has a column per searched dimension; `--schedule auto` prices the zero-bubble
    schedules, and the launch line names the top row's choices."""
    args = ["plan", "--gpus", "8", "--machine", "frontier", "--top", "3", "--schedule", "auto",
            "--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "32", "--batch", "8", "--vocab", "256"]
    assert main(args) == 0
    out = capsys.readouterr().out
    header = next(line.split() for line in out.splitlines() if line.lstrip().startswith("rank"))
    assert header[:11] == ["rank", "x", "y", "z", "data", "pipe", "mb", "virt", "remat", "sched", "offload"]
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "3"] and "configurations priced" in out
    top = rows[0]
    assert top[5] != "1" and top[9] in ("zb", "zb-h1")  # a pipeline wins here, zero-bubble
    launch = out.rstrip().splitlines()[-1]
    assert re.search(rf'schedule="{top[9]}"', launch) and f"--microbatches {top[6]}" in launch


def test_the_planner_prices_the_loss_planned_with_the_model(capsys):
    """`axonn-jax plan` ranks the program its launch line runs: `pm.train_step` plans the
    softmax cross-entropy with the model, so the vocabulary-split logits are not gathered and
    their max and sums are all-reduced over x, one row per token (`collectives(loss_rows=)`).
    Every ranked configuration's comm is that program's; `--loss gathered` prices the gathers."""
    shape = dict(layers=2, hidden=64, heads=4, seq=32, batch=16, vocab=512)
    argv = ["plan", "--gpus", "8", "--machine", "frontier", "--top", "1000", "--json", "--no-pipeline",
            *itertools.chain.from_iterable((f"--{k}", str(v)) for k, v in shape.items())]
    spec, machine = gpt_spec(**shape), machines.get("frontier")
    priced = {}
    for loss, rows in (("planned", 16 * 32), ("gathered", 0)):
        assert main([*argv, "--loss", loss]) == 0
        configs = json.loads(capsys.readouterr().out)
        assert {c["x"] for c in configs} >= {1, 2, 4}
        for c in configs:
            grid = Grid(x=c["x"], y=c["y"], z=c["z"], data=c["data"])
            options = Options(recompute=c["recompute"], offload=c["offload"], microbatches=c["microbatches"],
                              loss_rows=rows)  # fmt: skip
            p = predict(spec, grid, machine, options)
            assert c["comm_bytes_per_gpu"] == pytest.approx(p.comm_bytes, rel=1e-12), (loss, grid)
            assert c["comm_seconds"] == pytest.approx(p.comm_seconds, rel=1e-12), (loss, grid)
            assert any(q.what == "loss reductions" for q in p.collectives) == (loss == "planned" and grid.x > 1)
            priced[loss, grid, c["microbatches"], c["recompute"]] = c["comm_bytes_per_gpu"]
    # the same configuration sends less with the planned loss where x splits the logits (no
    # gathers of the logits over x, nor of their batch over y)
    both = [(g, k) for (loss, g, *k) in priced if loss == "planned" and ("gathered", g, *k) in priced]
    assert any(g.x > 1 for g, _ in both)
    for g, k in both:
        planned, gathered = priced[("planned", g, *k)], priced[("gathered", g, *k)]
        assert planned <= gathered and (planned < gathered or g.x == 1), g


def test_search_ranks_with_the_options_loss_rows():
    """`search(options=Options(loss_rows=...))` prices every configuration with the loss's
    all-reduces (the search keeps the options' program form)."""
    spec, machine = gpt_spec(layers=2, hidden=64, heads=4, seq=32, batch=16, vocab=512), machines.get("frontier")
    ranked = search(spec, 8, machine, options=Options(loss_rows=spec.tokens), top=1000, pipeline=False).ranked
    assert any(p.grid.x > 1 for p in ranked)
    for p in ranked:
        assert p.options.loss_rows == spec.tokens
        assert any(c.what == "loss reductions" for c in p.collectives) == (p.grid.x > 1)
