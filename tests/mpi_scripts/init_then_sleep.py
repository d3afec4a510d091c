"""Joins the job (``axonn_jax.init``), starts JAX's backends, prints ``ready <rank>``, then
sleeps SECONDS: a job for a test to signal."""

import sys
import time

import axonn_jax

info = axonn_jax.init()
import jax  # noqa: E402

jax.devices()
print(f"ready {info.process_index}", flush=True)
time.sleep(float(sys.argv[1]))
