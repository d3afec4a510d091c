"""The main example runs in one process and unchanged under mpiexec, with equal losses."""

import csv
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi_util import mpiexec

from axonn_jax.runtime.pipeline.timeline import concurrent_seconds

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--steps", "6", "--layers", "1", "--hidden", "64", "--sample-tokens", "8"]


def _run(prefix, out, timeout=300):
    # XLA's default flags, as a user runs it (the other example runs compile at the tests' level)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    command = [*prefix, sys.executable, str(ROOT / "examples" / "train_gpt.py"), *ARGS, "--out", str(out)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    with (out / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert (out / "loss.png").stat().st_size > 0
    # the train step's aux (has_aux=True): its next-token accuracy, from the same forward pass
    assert all(0.0 <= float(r["accuracy"]) <= 1.0 for r in rows), rows
    return result.stdout, np.array([float(r["loss"]) for r in rows])


@pytest.mark.slow
@pytest.mark.mpi
def test_example_single_process_and_mpiexec_agree(tmp_path):
    stdout, single = _run([], tmp_path / "one")
    assert "Plan for Grid(x=2, y=1, z=2, data=1, pipeline=2)" in stdout and "sample:" in stdout
    assert (tmp_path / "one" / "timeline.png").stat().st_size > 0  # the default grid pipelines
    # one process drives both stages, and they compute at the same time
    events = json.loads((tmp_path / "one" / "trace.json").read_text())["traceEvents"]
    rows = [(0, e["tid"], e["name"], 0, e["ts"], e["ts"] + e["dur"], 0.0) for e in events if e["ph"] == "X"]
    assert concurrent_seconds(rows) > 0, rows
    assert len(single) == 6 and single[-1] < single[0]
    stdout_two, two = _run([mpiexec(), "-n", "2"], tmp_path / "two")
    np.testing.assert_allclose(two, single, rtol=1e-5)
    # validation and sampling run forward-only through the stages, across the two processes too
    sample = [line for line in stdout.splitlines() if line.startswith("sample:")]
    assert sample and sample == [line for line in stdout_two.splitlines() if line.startswith("sample:")]
    # rank 0 speaks for the job: one plan, one summary, no Gloo connection lines
    assert stdout_two.count("Plan for Grid(") == 1 and stdout_two.count("sample:") == 1
    assert "[Gloo]" not in stdout_two and stdout_two.count("compiling the train step") == 1


def test_bad_cli_arguments():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--steps", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "--steps must be >= 1" in result.stderr
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--grid", "w=2", "--steps", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0 and "expected AXIS=SIZE" in result.stderr


@pytest.mark.parametrize("flag", ["--batch", "--seq", "--microbatches", "--layers", "--hidden", "--heads"])
def test_sizes_below_one_are_refused_at_parsing(flag, capsys):
    """``--batch 0`` used to reach the loader ("need at least one array to stack")."""
    with pytest.raises(SystemExit) as exit_:
        _example_module().parse_args([flag, "0"])
    assert exit_.value.code == 2 and f"{flag} must be >= 1, got 0" in capsys.readouterr().err


def _example_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_gpt_example", ROOT / "examples" / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _documented_commands() -> list[list[str]]:
    """The example's flags in every command of its docstring and of the README."""
    import shlex

    example = _example_module()
    text = example.__doc__ + (ROOT / "README.md").read_text()
    commands = []
    for line in text.splitlines():
        if "examples/train_gpt.py" in line and not line.lstrip().startswith(("`", "#", "|")):
            words = shlex.split(line.split("#")[0])
            commands.append(words[[w.endswith("examples/train_gpt.py") for w in words].index(True) + 1 :])
    return commands


def test_every_documented_command_parses():
    """Grid, batch and microbatch checks happen at argument parsing, for every documented command."""
    commands = _documented_commands()
    assert len(commands) >= 7, commands
    example = _example_module()
    for argv in commands:
        example.parse_args(argv)  # exits 2 with the reason if the command could not run
    assert example.parse_args(["--grid", "z=4,data=2"]).microbatches == 1  # no pipeline: 1
    assert example.parse_args([]).microbatches == 4  # the default grid pipelines


def test_indivisible_batch_fails_at_parsing():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--grid", "z=4,data=2",
         "--microbatches", "4"], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--batch 16 is not divisible by microbatches × data × z = 4 × 2 × 4 = 32" in result.stderr
    assert "Remedy: --batch 32" in result.stderr


@pytest.mark.slow
def test_docstring_command_without_pipeline_runs(tmp_path):
    """`python examples/train_gpt.py --grid z=4,data=2 --steps 100`, for 2 steps."""
    from test_data import example_env

    env = example_env()
    command = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--grid", "z=4,data=2",
               "--steps", "2", "--sample-tokens", "8", "--out", str(tmp_path)]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    with (tmp_path / "metrics.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 2


def test_bf16_computes_in_bf16(devices):
    """The example's compute dtype; the bf16 model really runs its matmuls in bf16."""
    import jax
    import jax.numpy as jnp

    import axonn_jax
    from axonn_jax.models import GPT, GPTConfig

    compute_dtype = _example_module().compute_dtype
    assert compute_dtype("bf16") == ("bfloat16", None)
    assert compute_dtype("fp32") == ("float32", None)
    assert compute_dtype("fp16")[0] == "float32"
    # what the example partitions: matmuls in bf16, parameters stored in fp32 (the plan's dtype)
    config = GPTConfig(vocab_size=64, num_layers=1, hidden=32, num_heads=2, max_seq_len=8, dtype="bfloat16")
    tokens = jnp.zeros((4, 8), jnp.int32)
    pm = axonn_jax.partition(GPT(config), axonn_jax.Grid(x=2, z=2, data=2), tokens)
    assert {p.dtype for p in pm.plan.params} == {"float32"}
    params = jax.eval_shape(pm.init, jax.random.key(0))
    jaxpr = str(jax.make_jaxpr(pm.apply)(params, tokens))
    dots = [line for line in jaxpr.splitlines() if "dot_general" in line]
    assert dots and all("bf16[" in line for line in dots)


@pytest.mark.slow
def test_bf16_on_cpu_computes_in_bf16_and_trains(tmp_path):
    """``--precision bf16`` computes in bf16 on CPU too (x/y grids aborted XLA:CPU before
    tests/test_bf16_compute.py's fix), without a notice, and the loss falls. At XLA's default flags."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    command = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--precision", "bf16",
               "--grid", "x=2,z=2,data=2", *ARGS[2:], "--steps", "3", "--out", str(tmp_path)]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "note:" not in result.stdout, result.stdout
    with (tmp_path / "metrics.csv").open() as f:
        losses = [float(row["loss"]) for row in csv.DictReader(f)]
    assert len(losses) == 3 and losses[-1] < losses[0], losses


def _losses(out: Path) -> np.ndarray:
    with (out / "metrics.csv").open() as f:
        return np.array([float(r["loss"]) for r in csv.DictReader(f)])


@pytest.mark.slow
def test_interrupted_and_resumed_runs_equal_the_uninterrupted_one_also_on_another_grid(tmp_path):
    """4 steps straight, checkpointing every 2; a run that stopped after step 2 (its
    directory without step 4) resumed on the same pipeline grid gives the same losses
    exactly, and resumed on a flat grid the same losses to rounding."""
    import shutil

    from test_data import run_example

    small = ["--steps", "4", "--layers", "2", "--hidden", "32", "--heads", "2", "--seq", "16",
             "--sample-tokens", "1", "--ckpt-every", "2"]  # fmt: skip
    run_example(tmp_path / "straight", *small, "--grid", "pipeline=2,x=2,z=2")
    straight = _losses(tmp_path / "straight")
    assert len(straight) == 4
    for name, grid in (("cut", "pipeline=2,x=2,z=2"), ("flat", "z=4,data=2")):
        shutil.copytree(tmp_path / "straight", tmp_path / name)
        shutil.rmtree(tmp_path / name / "ckpt" / "4")  # as if killed after the save of step 2
        result = run_example(tmp_path / name, *small, "--grid", grid, "--resume")
        assert "resumed from" in result.stdout and "at step 2" in result.stdout
    assert not (tmp_path / "flat" / "timeline.png").exists()  # the pipelined run's, removed
    assert "removed an earlier pipeline run's timeline.png and trace.json" in result.stdout
    np.testing.assert_array_equal(_losses(tmp_path / "cut"), straight)
    np.testing.assert_allclose(_losses(tmp_path / "flat"), straight, rtol=1e-5)


# --- a run's directory, resuming, and what the example prints -----------------------------


def test_own_data_gets_its_own_default_directory():
    example = _example_module()
    assert example.default_out(example.parse_args([])) == "runs/gpt-pipeline2_x2_z2"  # the demo's
    assert example.default_out(example.parse_args(["--data", "my/notes.txt"])) == "runs/gpt-notes-pipeline2_x2_z2"


def test_checkpoints_of_another_run_are_named_without_suggesting_resume(tmp_path):
    example = _example_module()
    demo = {"layers": 4, "hidden": 128, "data": None, "tokens": 1000}
    mine = {"layers": 4, "hidden": 128, "data": "/d/notes.txt", "tokens": 50}
    message = example._occupied_message(tmp_path, [300], demo, mine)
    assert "of another run (--data None → /d/notes.txt; the data's length 1000 → 50 tokens)" in message
    assert "--resume" not in message and "another --out" in message
    same = example._occupied_message(tmp_path, [300], demo, dict(demo))
    assert "--resume to continue" in same


def test_resume_keeps_the_checkpoints_learning_rate_schedule_unless_told():
    example = _example_module()
    previous = {"schedule_steps": 300, "lr": 3e-3}
    steps, notes = example.learning_rate_schedule(example.parse_args(["--steps", "600"]), previous)
    assert steps == 300 and "keeps the checkpoint's schedule, a cosine over 300 steps" in notes[0]
    steps, notes = example.learning_rate_schedule(
        example.parse_args(["--steps", "600", "--schedule-steps", "600"]), previous)
    assert steps == 600 and "now decays over 600 steps" in notes[0]
    assert example.learning_rate_schedule(example.parse_args(["--steps", "600"]), None) == (600, [])


def test_the_tensorboard_hint_says_how_to_get_tensorboard(monkeypatch, tmp_path):
    import importlib.util

    example = _example_module()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert example._tensorboard_hint(tmp_path) == f"to view: pip install tensorboard, then tensorboard --logdir {tmp_path}"


def test_readme_lists_every_flag_of_the_example():
    parser = _example_module().build_parser()
    parser_flags = {o for action in parser._actions for o in action.option_strings if o.startswith("--")}
    readme = (ROOT / "README.md").read_text()
    listed = readme[readme.index("Flags of the example:"):]
    listed = listed[: listed.index("\n\n")]
    missing = sorted(f for f in parser_flags - {"--help", "--sample-bytes"}
                     if not re.search(rf"{re.escape(f)}(?![\w-])", listed))  # fmt: skip
    assert not missing, f"README's flag list omits {missing}"


@pytest.mark.slow
def test_resume_extends_a_run_on_its_schedule_and_refuses_another_model(tmp_path):
    """2 steps, then --resume --steps 4: the same losses as 4 steps on a 2-step schedule;
    --resume with another --hidden is an error line naming the flag, not a traceback."""
    from test_data import example_env, run_example

    small = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16", "--sample-tokens", "1",
             "--grid", "z=4,data=2", "--ckpt-every", "0", "--eval-every", "0"]  # fmt: skip
    run_example(tmp_path / "straight", "--steps", "4", "--schedule-steps", "2", *small)
    run_example(tmp_path / "cut", "--steps", "2", *small)
    resumed = run_example(tmp_path / "cut", "--steps", "4", "--resume", *small)
    assert "keeps the checkpoint's schedule, a cosine over 2 steps" in resumed.stdout
    np.testing.assert_array_equal(_losses(tmp_path / "cut"), _losses(tmp_path / "straight"))
    assert [int(r["step"]) for r in csv.DictReader((tmp_path / "cut" / "metrics.csv").open())] == [1, 2, 3, 4]

    env = example_env()
    other = [a if a != "32" else "64" for a in small]
    refused = subprocess.run([sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--steps", "6",
                              "--resume", *other, "--out", str(tmp_path / "cut")],
                             env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert "error: --resume: the checkpoints in" in refused.stderr and "--hidden 32 → 64" in refused.stderr
