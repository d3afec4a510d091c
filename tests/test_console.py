"""What a user reads: the plan summary, the example's log (line-oriented without a terminal),
its summary after --resume, and the pipeline timeline's legend."""

import re

import jax.numpy as jnp
import pytest
from test_data import SMALL, run_example

import axonn_jax
from axonn_jax.models import GPT, GPTConfig


def test_plan_prints_a_summary_and_a_table_on_request():
    model = GPT(GPTConfig(vocab_size=256, num_layers=4, hidden=64, num_heads=4, max_seq_len=16))
    pm = axonn_jax.partition(model, axonn_jax.Grid(pipeline=2, x=2, z=2), jnp.zeros((4, 16), jnp.int32))
    summary = str(pm.plan).splitlines()
    assert summary[0].startswith("Plan for Grid(") and len(summary) < 15 < len(pm.plan.params)
    assert summary[1] == "warnings:" and "used by stages [0, 1]" in summary[2]  # warnings first
    [roles] = [line for line in summary if line.startswith("parameters by role: ")]
    counts = [int(n) for n in re.findall(r"(?:normal|transposed|activation|replicated|state) (\d+) ", roles)]
    assert sum(counts) == len(pm.plan.params)
    assert any(line.startswith("  stage 1: ") for line in summary)
    assert summary[-1] == "every parameter's layout: print(pm.plan.table())"
    table = pm.plan.table().splitlines()
    assert len(table) == 2 + len(pm.plan.params) and table[0].split()[:2] == ["parameter", "shape"]


def test_timeline_legend_leaves_the_bars_alone():
    import matplotlib.pyplot as plt

    from axonn_jax.runtime.pipeline.timeline import timeline_figure

    rows = [(0, 0, "F", mb, mb * 1.0, mb + 0.9, 0.0) for mb in range(4)]
    rows += [(1, 1, "FB", mb, mb + 1.0, mb + 1.9, 0.0) for mb in range(4)]  # the last bar ends last
    fig = timeline_figure(rows, "test")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    [legend] = fig.legends
    assert not legend.get_window_extent(renderer).overlaps(fig.axes[0].get_window_extent(renderer))
    plt.close(fig)


@pytest.mark.slow
def test_example_log_without_a_terminal_is_line_oriented_and_resume_counts_its_steps(tmp_path):
    args = ["--grid", "z=4,data=2", "--eval-every", "2", "--log-every", "2", *SMALL]
    first = run_example(tmp_path, "--steps", "5", *args).stdout
    assert "\r" not in first and "\x1b" not in first  # no progress-bar redraws in a log file
    assert re.search(r"^step 1/5: compiling the train step…\ncompiled and ran it in \d+\.\d s \(loss \d",
                     first, re.M)  # fmt: skip
    progress = re.findall(r"^step (\d)/5  loss \d\.\d{3}  acc \d\.\d{3}(  valid \d\.\d{3})?  tok/s [\d,]+  "
                          r"[\d.]+ s/step  eta \d:\d\d:\d\d$", first, re.M)  # fmt: skip
    assert [int(step) for step, _ in progress] == [3, 5]  # every 2 steps after the compiling one
    assert re.search(r"^loss \d\.\d{3} \(step 1\) -> \d\.\d{3} \(mean of steps 1-5\) in 5 steps "
                     r"\(1-5 of 5\)", first, re.M)  # fmt: skip
    assert [r["step"] for r in _metrics(tmp_path)] == ["1", "2", "3", "4", "5"]  # as the console counts
    assert f"TensorBoard: {tmp_path / 'tensorboard'}" in first
    assert f"checkpoints: {tmp_path / 'ckpt'} (steps 5;" in first
    assert first.count("Plan for Grid(") == 1 and "every parameter's layout" in first

    resumed = run_example(tmp_path, "--steps", "7", "--resume", *args).stdout
    assert re.search(r"^loss \d\.\d{3} \(step 6\) -> \d\.\d{3} \(mean of steps 6-7\) in 2 steps "
                     r"\(6-7 of 7, resumed from the checkpoint of step 5\)", resumed, re.M)  # fmt: skip
    assert [r["step"] for r in _metrics(tmp_path)] == [str(i) for i in range(1, 8)]
    assert "\r" not in resumed


def test_rerunning_without_resume_is_refused_before_training(tmp_path):
    (tmp_path / "ckpt").mkdir()
    result = run_example(tmp_path, "--steps", "1", *SMALL, "--grid", "data=8",
                         "--batch", "8", "--sample-tokens", "1")  # fmt: skip
    assert "sample:" in result.stdout
    import subprocess
    import sys

    from test_data import ROOT

    again = subprocess.run([sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--steps", "1",
                            *SMALL, "--grid", "data=8", "--batch", "8", "--out", str(tmp_path)],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert again.returncode == 1 and "already holds checkpoints (steps [1])" in again.stderr
    assert "--resume to continue" in again.stderr and "--fresh" in again.stderr
    # --fresh deletes the checkpoints and the run record, not the user's files beside them
    # (it used to delete the whole --ckpt-dir)
    (tmp_path / "ckpt" / "notes.txt").write_text("the user's")
    fresh = run_example(tmp_path, "--steps", "1", *SMALL, "--grid", "data=8", "--batch", "8", "--fresh")
    assert "--fresh: deleting the checkpoints" in fresh.stdout and "other files stay" in fresh.stdout
    assert (tmp_path / "ckpt" / "notes.txt").read_text() == "the user's"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name[0].isdigit()) == ["1"]


def _metrics(out) -> list[dict]:
    import csv

    with (out / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


GLOO = b"[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"


def test_gloo_lines_are_stripped_also_mid_line_and_across_chunks():
    from axonn_jax.runtime.console import strip_gloo

    assert strip_gloo(b"a\n" + GLOO + b"b\n") == (b"a\nb\n", b"")
    assert strip_gloo(b"compiling... " + GLOO + b"done\n") == (b"compiling... done\n", b"")
    ready, held = strip_gloo(b"step 1 " + GLOO[:20])  # a line cut by the pipe: held back whole
    assert ready == b"" and held == b"step 1 " + GLOO[:20]
    assert strip_gloo(held + GLOO[20:] + b"x") == (b"step 1 ", b"x")
    assert strip_gloo(b"[Glo") == (b"", b"[Glo") and strip_gloo(b"[x]\n") == (b"[x]\n", b"")


def test_gloo_reports_interleaved_by_its_threads_are_dropped():
    """Gloo's threads write their reports in pieces that interleave (seen under mpiexec -n 2)."""
    from axonn_jax.runtime.console import strip_gloo

    mixed = (b"[Gloo] Rank 0 is connected to [Gloo] Rank 11 peer ranks.  is connected to Expected number "
             b"of connected peer ranks is : 11 peer ranks. Expected number of connected peer ranks is : \n"
             b"[Gloo] Rank 1\n is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
             b"loss 4.6 after 3 steps\n")  # fmt: skip
    assert strip_gloo(mixed) == (b"loss 4.6 after 3 steps\n", b"")


def test_a_process_that_drops_gloo_lines_prints_everything_else():
    """What C++ writes to file descriptor 1 is filtered too, and nothing is lost at exit."""
    import subprocess
    import sys

    code = ("import os, sys\nfrom axonn_jax.runtime.console import drop_gloo_lines\ndrop_gloo_lines()\n"
            "print('before', end=' ', flush=True)\n"
            f"os.write(1, {GLOO!r} * 3)\n"
            "print('after')\nsys.stdout.write('tail without newline')\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).stdout
    assert out == b"before after\ntail without newline"
