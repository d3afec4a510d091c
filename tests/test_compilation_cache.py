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


class _Module:
    def __init__(self, text: str):
        self.text = text

    def to_string(self) -> str:
        return self.text


class _Executable:
    """What the guard reads of an executable: its HLO modules' text."""

    def __init__(self, *texts: str):
        self.modules = [_Module(t) for t in texts]

    def hlo_modules(self):
        return self.modules


class _Backend:
    def __init__(self, platform: str):
        self.platform = platform


LOOPED = _Executable("HloModule m\n\n%body (p: f32[4]) -> f32[4] {\n  ROOT %g = f32[4]{0} all-gather(%p), "
                     "dimensions={0}\n}\nENTRY %main (p: f32[4]) -> f32[4] {\n  %w = f32[4]{0} while(%p), "
                     "condition=%c, body=%body\n  ROOT %x = f32[4]{0} all-reduce(%w), to_apply=%add\n}")  # fmt: skip
FLAT = _Executable("HloModule m\n\nENTRY %main (p: f32[4]) -> f32[4] {\n  ROOT %a = f32[4]{0} all-reduce(%p), "
                   "to_apply=%add\n}")  # fmt: skip


def test_the_guard_follows_cache_functions_that_take_more_arguments(monkeypatch):
    """jax 0.11 passes its cache functions another argument than jax 0.10 did: the guard binds
    them by name, passes every argument on, and still keeps unordered CPU programs out."""
    from jax._src import compiler

    from axonn_jax.runtime import compilation_cache

    written, found = [], {}

    def write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks, extra=None):
        written.append((module_name, extra))

    def read(module_name, cache_key, compile_options, backend, executable_devices, extra=None):
        return found[module_name], 1.5

    monkeypatch.setattr(compiler, "_cache_write", write)
    monkeypatch.setattr(compiler, "_cache_read", read)
    compilation_cache.install()
    assert compiler._cache_write is not write and compiler._cache_read is not read
    cpu, gpu = _Backend("cpu"), _Backend("gpu")
    for name, backend, executable in [("looped-cpu", cpu, LOOPED), ("flat-cpu", cpu, FLAT),
                                      ("looped-gpu", gpu, LOOPED)]:  # fmt: skip
        compiler._cache_write("key", 1.0, name, backend, executable, [], "six")
        found[name] = executable
    assert written == [("flat-cpu", "six"), ("looped-gpu", "six")]
    assert compiler._cache_read("looped-cpu", "key", None, cpu, [], "six") == (None, None)
    assert compiler._cache_read("flat-cpu", "key", None, cpu, [], "six") == (FLAT, 1.5)
    assert compiler._cache_read("looped-gpu", "key", None, gpu, [], "six") == (LOOPED, 1.5)


def test_the_guard_leaves_cache_functions_it_does_not_know_alone(monkeypatch):
    from jax._src import compiler

    from axonn_jax.runtime import compilation_cache

    def write(key, value):
        pass

    def read(key):
        return None

    monkeypatch.setattr(compiler, "_cache_write", write)
    monkeypatch.setattr(compiler, "_cache_read", read)
    compilation_cache.install()
    assert compiler._cache_write is write and compiler._cache_read is read
