"""Under mpiexec: several of these scripts, one after the other, in one job.

Usage: mpiexec -n P python run_scripts.py SCRIPT [SCRIPT ...]

One launch and one ``jax.distributed`` start for checks that need the same ranks and
devices (``axonn_jax.init`` returns the job of the first script to every later one).
Each script prints its own "OK rank R" line; the first one that fails (raises or
exits non-zero) ends the job with its status.
"""

import runpy
import sys
from pathlib import Path

for script in sys.argv[1:]:
    runpy.run_path(str(Path(__file__).with_name(script)), run_name="__main__")
