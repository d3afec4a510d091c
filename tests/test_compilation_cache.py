"""JAX's persistent compilation cache keeps no XLA:CPU program whose collectives a reload would
leave unordered (runtime/compilation_cache.py): a scan whose body communicates next to a
collective outside it is compiled anew in every process; a program whose collectives sit in
one computation is stored and reloaded."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from axonn_jax.runtime.compilation_cache import collective_computations

#: compiles both programs with the cache in argv[1]; prints each one's verdict
SCRIPT = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from axonn_jax.runtime.compilation_cache import reloads_in_order

mesh = Mesh(np.array(jax.devices()[:4]), ("i",))

def looped(x, ys):
    step = lambda c, y: (jnp.tanh(c + jax.lax.psum(y, "i")), None)
    return jax.lax.psum_scatter(x, "i", tiled=True), jax.lax.scan(step, jnp.zeros_like(ys[0]), ys)[0]

def flat(x, ys):
    return jax.lax.psum_scatter(x, "i", tiled=True), jnp.tanh(jax.lax.psum(ys.sum(0), "i"))

x = jax.device_put(np.ones((64, 8), np.float32), NamedSharding(mesh, P("i")))
ys = jax.device_put(np.ones((3, 16, 8), np.float32), NamedSharding(mesh, P(None, "i")))
for f in (looped, flat):
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("i"), P(None, "i")), out_specs=(P("i"), P()),
                              check_vma=False))
    compiled = g.lower(x, ys).compile()
    print(f.__name__, reloads_in_order(compiled.runtime_executable()), float(g(x, ys)[1].sum()))
"""


def _run(cache: Path) -> list[str]:
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", "import axonn_jax.runtime\n" + SCRIPT], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split("\n")


def test_programs_with_loop_collectives_are_not_cached(tmp_path):
    cold = _run(tmp_path)
    assert [line.split()[:2] for line in cold if line] == [["looped", "False"], ["flat", "True"]]
    stored = {p.name.split("-")[0] for p in tmp_path.iterdir()}
    assert "jit_flat" in stored and "jit_looped" not in stored, stored
    assert _run(tmp_path) == cold  # the flat program reloaded, the looped one compiled again: same values


@pytest.mark.parametrize("text,names", [
    ("ENTRY %main (p: f32[4]) -> f32[4] {\n  ROOT %a = f32[4]{0} all-reduce(%p), to_apply=%add\n}", {"main"}),
    ("%add (a: f32[], b: f32[]) -> f32[] {\n  ROOT %s = f32[] add(%a, %b)\n}\n"
     "ENTRY %main (p: f32[8]) -> (f32[2], f32[8]) {\n"
     "  %r = f32[2]{0} reduce-scatter(%p), dimensions={0}, to_apply=%add\n"
     "  %g = (f32[8]{0}, f32[8]{0}) all-gather-start(%p), dimensions={0}\n}", {"main"}),
    ("%body (p: f32[4]) -> f32[4] {\n  ROOT %g = f32[4]{0} all-gather(%p), dimensions={0}\n}\n"
     "ENTRY %main (p: f32[4]) -> f32[4] {\n  %w = f32[4]{0} while(%p), condition=%c, body=%body\n"
     "  ROOT %x = f32[4]{0} collective-permute(%w), source_target_pairs={{0,1}}\n}", {"body", "main"}),
    ("ENTRY %main (p: f32[4]) -> f32[4] {\n  ROOT %f = f32[4]{0} fusion(%p), kind=kLoop, "
     'calls=%all-reduce.fused, metadata={op_name="all-reduce(x)"}\n}', set()),
])  # fmt: skip
def test_collective_computations(text, names):
    assert collective_computations("HloModule m\n\n" + text) == names
