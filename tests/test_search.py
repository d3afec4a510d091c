"""The planner's search over grid × virtual stages × recompute × schedule × offload × microbatches.

Pure (no devices): the search is checked against a brute force that prices every
configuration with :func:`~axonn_jax.perf.step.predict` and
:func:`~axonn_jax.perf.memory.memory` directly (no shortcuts), and against IPDPS'22
eq. 3 by hand where recompute is what makes a grid fit.
"""

from __future__ import annotations

import dataclasses
import itertools
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
                    Options(recompute=rec, schedule=s, offload=off, microbatches=mb))
            for v in (virtuals if p > 1 else [1])
            for rec, s, off in itertools.product((False, True), schedules, (False, True))
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
                     ("offload", o.offload), ("schedule", o.schedule)}  # fmt: skip
        assert len(result.ranked) == len(chosen) == result.feasible
    assert {("virtual", True), ("recompute", True), ("recompute", False), ("offload", True),
            ("schedule", "zb"), ("schedule", "zb-h1"), ("schedule", "message")} <= used  # fmt: skip


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
