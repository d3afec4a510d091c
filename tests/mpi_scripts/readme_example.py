"""The README's complete example as written, on each rank of an ``mpiexec`` job."""

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
block = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)[0]
namespace: dict = {}
exec(compile(block, "README.md (complete example)", "exec"), namespace)
import jax  # noqa: E402

print(f"rank {jax.process_index()} of {jax.process_count()}: loss {float(namespace['loss']):.6f}", flush=True)
sys.exit(0)
