"""A user's own model that computes in bf16 trains on x/y grids on CPU (issue 29, item 1).

XLA:CPU promotes bf16 all-reduces and reduce-scatters to fp32
(``AllReducePromotion``) by cloning each one's reduction body, and aborts the
process ("Invalid binary instruction opcode copy", exit 134) when that body ends
in anything but the binary op. A ``shard_map`` that is manual over only some mesh
axes gives every reduction body such an ending (a sharding annotation that
becomes a ``copy``); :func:`axonn_jax.runtime.sharded.on_mesh` is therefore
manual over every axis of the mesh (size-1 axes move nothing either way).

The case (tests/bf16_compute_case.py) runs in a subprocess, so that the abort
this guards against fails the test instead of killing the pytest worker.

Bounds, against the plain single-device run of the same bf16 arithmetic:

* the first step's gradient of every leaf: max|Δ| ≤ 8u·max|g| with u = 2⁻⁸ the
  unit roundoff of bf16 (8 significant bits). The two runs round the same values
  at different points (x-split partial sums are rounded to bf16 before the
  all-reduce, per-shard batch sums before the data reduction); a gradient element
  passes through at most ~8 such roundings (activation and cotangent of each of
  4 layers), each ≤ u of the values involved. Observed ≤ 1.32% (Dense_2/bias;
  the bound is 3.1%). The bound still separates real faults: a dropped or
  doubled all-reduce is off by O(100%), and even fp32 compute differs from the
  bf16 reference by 12.7% (Dense_0/kernel), which the test checks too;
* the loss of each of 5 Adam steps (``precision="bf16", offload=True``):
  relative difference ≤ 1% (a mean of 2,048 squared errors of bf16 outputs that
  differ by a few u; observed ≤ 0.11%). Parameters after Adam steps are not
  compared: Adam turns a near-zero gradient's rounding into a ±lr step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_util import subprocess_timeout
from xla_flags import xla_flags

TESTS = Path(__file__).resolve().parent
GRAD_BOUND = 8 * 2.0**-8
LOSS_RTOL = 1e-2


def _run_case(grid: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(8))
    done = subprocess.run([sys.executable, str(TESTS / "bf16_compute_case.py"), grid], env=env, cwd=TESTS,
                          capture_output=True, text=True, timeout=subprocess_timeout(None, default=400))  # fmt: skip
    if done.returncode in (134, -6):  # SIGABRT: a CHECK failure inside XLA
        pytest.fail(f"the process aborted (exit {done.returncode}) on {grid}:\n{done.stderr[-1500:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.slow
@pytest.mark.parametrize("grid", ["x=2,z=2,data=2", "x=2,data=4"])
def test_own_bf16_model_trains_like_the_plain_bf16_run(grid):
    r = _run_case(grid)
    # it really computes in bf16, with bf16 parameters on the devices
    assert r["output_dtype"] == "bfloat16" and r["device_param_dtype"] == "bfloat16", r
    for path, diff in r["grad_diff"].items():
        assert diff <= GRAD_BOUND, f"{grid} {path}: max|Δgrad| = {diff:.4f}·max|g| > {GRAD_BOUND:.4f}"
    # the bound is tight enough to tell bf16 from fp32 compute
    assert max(r["fp32_compute_grad_diff"].values()) > GRAD_BOUND, r["fp32_compute_grad_diff"]
    for i, (loss, ref) in enumerate(zip(r["losses"], r["reference_losses"], strict=True)):
        assert abs(loss - ref) <= LOSS_RTOL * ref, f"{grid} step {i}: loss {loss} vs {ref}"
    assert r["losses"][-1] < r["losses"][0], r["losses"]
