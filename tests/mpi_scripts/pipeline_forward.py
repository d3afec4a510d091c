"""Under mpiexec -n 2: forward-only ``pm.apply`` / ``pm.forward`` on Grid(pipeline=2) equal model.apply.

One stage per process. Every rank computes the plain references itself and
checks the outputs (they reach every process, as host arrays) of: the tied-
embedding GPT with 1 and 2 microbatches, HF GPT-2 (a dataclass of outputs),
GPT-2 with dropout (the key passes through), a BatchNorm net with
``mutable=["batch_stats"]`` and an nnx net with state (the state leaves it
holds). Prints "OK rank R" or the failures.
"""

import axonn_jax

info = axonn_jax.init()
import jax  # noqa: E402
from forward_cases import (batchnorm_forward_failures, dropout_forward_failures,  # noqa: E402
                           forward_failures, nnx_state_forward_failures)

assert info.distributed and jax.process_count() == 2, "expected mpiexec -n 2"
grid = axonn_jax.Grid(pipeline=2)
failures = forward_failures("gpt_linen", grid, 1) + forward_failures("gpt_linen", grid, 2)
failures += forward_failures("hf_gpt2", grid, 2) + dropout_forward_failures(grid)
failures += batchnorm_forward_failures(grid, 2) + nnx_state_forward_failures(grid)
if failures:
    print(f"FAIL rank {info.process_index}:\n  " + "\n  ".join(failures), flush=True)
    raise SystemExit(1)
print(f"OK rank {info.process_index} forward {grid}", flush=True)
