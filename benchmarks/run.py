"""Run every benchmark and print a markdown table (``make bench``).

Each row is a ratio measured inside one process, never an absolute time
compared across runs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main() -> None:
    import partition_overhead
    import planning_time

    overhead = partition_overhead.main([])
    planning = planning_time.main([])
    print()
    print("| benchmark | result |")
    print("| --- | --- |")
    print(f"| train step, grid all-1, axonn_jax / plain jax.jit (median of {overhead['steps']}) "
          f"| {overhead['ratio']:.3f} |")  # fmt: skip
    print(f"| planning time, {planning['params']/1e9:.0f}B-param GPT for {planning['gpus']} GPUs "
          f"| {planning['seconds']:.1f} s |")  # fmt: skip


if __name__ == "__main__":
    main()
