"""The layering of docs/architecture.md, enforced: import-linter contracts and import side effects.

``partitioner/`` and ``runtime/`` sit at the top of the repository and become
``axonn_jax.partitioner`` / ``axonn_jax.runtime`` only when installed, so the
contracts are checked on a staged copy laid out as the installed package.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from mpi_util import subprocess_timeout

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _stage(tmp: Path) -> Path:
    """A copy of the package in its installed shape, plus the contracts."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "axonn_jax", tmp / "axonn_jax", ignore=ignore)
    shutil.copytree(ROOT / "partitioner", tmp / "axonn_jax" / "partitioner", ignore=ignore)
    shutil.copytree(ROOT / "runtime", tmp / "axonn_jax" / "runtime", ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", tmp / "pyproject.toml")
    return tmp


def _lint(staged: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(staged), "PATH": "/usr/bin:/bin", "HOME": str(staged)}
    return subprocess.run([str(LINT), "--config", "pyproject.toml", "--no-cache"], cwd=staged, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> Path:
    return _stage(tmp_path_factory.mktemp("staged"))


def test_contracts_hold(staged):
    result = _lint(staged)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"Contracts: 7 kept, 0 broken", result.stdout), result.stdout


@pytest.mark.parametrize(
    "module, line, contract",
    [
        ("layout.py", "from axonn_jax.runtime import launch", "runtime builds on the partitioner"),
        ("layout.py", "import axonn_jax.partitioned", "never import the face"),
        ("../runtime/mesh.py", "from axonn_jax.checkpoint import Checkpointer", "never import the face"),
        ("stages.py", "from mpi4py import MPI", "speak MPI"),
        ("../runtime/placement.py", "from mpi4py import MPI", "speak MPI"),
        ("../runtime/engine/base.py", "import axonn_jax.partitioned", "never import the face"),
        ("../runtime/train_step.py", "from axonn_jax.partitioned import Partitioned", "never import the face"),
        ("../runtime/pipeline/dispatch.py", "from axonn_jax.runtime.engine import Engine", "runs below the engine"),
        ("../runtime/pipeline/setup.py", "from axonn_jax.runtime.train_step import OptState", "runs below the engine"),
        ("../runtime/pipeline/transport.py", "from axonn_jax.runtime.checkpoint import save", "runs below the engine"),
        ("../checkpoint.py", "from axonn_jax.runtime.checkpoint.targets import keyed", "only the public API"),
        ("../partitioned.py", "from axonn_jax.runtime.pipeline.dispatch import DispatchQueue", "never its parts"),
        ("../health.py", "from axonn_jax.runtime.probe import badness", "never its parts"),
        ("../perf/memory.py", "from axonn_jax.runtime.pipeline.schedules import make_schedule", "analytical"),
    ],
)
def test_a_back_import_breaks_a_contract(tmp_path, module, line, contract):
    staged = _stage(tmp_path)
    target = staged / "axonn_jax" / "partitioner" / module
    target.write_text(target.read_text() + f"\n{line}  # deliberate back-import\n")
    result = _lint(staged)
    assert result.returncode != 0, result.stdout
    assert re.search(rf"{re.escape(contract)}.*BROKEN", result.stdout), result.stdout


def test_contract_lists_every_face_module():
    """The forbidden list names every module of axonn_jax/ (a new face module cannot slip by)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    [face] = [c for c in config["contracts"] if c["name"] == "partitioner and runtime never import the face"]
    modules = {f"axonn_jax.{p.stem}" for p in (ROOT / "axonn_jax").glob("*.py") if p.stem != "__init__"}
    modules |= {f"axonn_jax.{p.name}" for p in (ROOT / "axonn_jax").iterdir()
                if p.is_dir() and (p / "__init__.py").exists()}  # fmt: skip
    assert set(face["forbidden_modules"]) == modules


def _imported_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return set(out.stdout.split())


def test_partitioner_import_loads_no_runtime_and_starts_nothing():
    loaded = _imported_after("import axonn_jax.partitioner")
    assert not {m for m in loaded if m.startswith("axonn_jax.runtime")}, "partitioner loaded the runtime"
    assert "mpi4py" not in loaded and "axonn_jax.partitioned" not in loaded


def test_import_axonn_jax_has_no_side_effects():
    code = ("import axonn_jax, sys; from jax._src import xla_bridge; "
            "assert not xla_bridge.backends_are_initialized(); "
            "assert 'axonn_jax.runtime.executor' not in sys.modules; print('ok')")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "ok", out.stderr


def test_planning_a_large_model_needs_only_the_partitioner():
    """The 87.6B GPT for 1,024 GPUs, planned with axonn_jax.partitioner alone (no devices)."""
    code = """
import sys, jax, jax.numpy as jnp
from axonn_jax.partitioner import Grid, plan_model
from axonn_jax.models import GPT, GPTConfig
config = GPTConfig(vocab_size=51200, num_layers=48, hidden=12288, num_heads=96, max_seq_len=2048)
plan, program = plan_model(GPT(config), Grid(x=8, y=4, z=4, data=8),
                           jax.ShapeDtypeStruct((1024, 2048), jnp.int32))
from jax._src import xla_bridge
assert not any(m.startswith("axonn_jax.runtime") for m in sys.modules)
print(plan.grid.size, round(plan.total_param_bytes / 4 / 1e9, 1), plan.param_bytes_per_device)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=subprocess_timeout(None, default=540))  # fmt: skip
    assert out.returncode == 0, out.stderr
    gpus, billions, per_device = out.stdout.split()
    assert gpus == "1024" and float(billions) > 80
    assert int(per_device) < 4 * float(billions) * 1e9 / 100  # split over ≥ 100 of the 128 shards


def _reachable(root):
    """Every object reachable from ``root`` by reference, not through modules, classes or
    module namespaces (a function's globals would reach everything)."""
    import gc
    import types

    namespaces = {id(m.__dict__) for m in list(sys.modules.values()) if m is not None}
    seen, todo = set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or id(obj) in namespaces or isinstance(obj, (types.ModuleType, type)):
            continue
        seen.add(id(obj))
        yield obj
        todo.extend(gc.get_referents(obj))


@pytest.mark.parametrize("grid", ["x=2,z=2,data=2", "pipeline=2,x=2,z=2"])
def test_the_runtime_never_holds_the_face(grid, devices):
    """Zero face↔runtime crossings: a train step, a gradient function and the engine reach no
    ``Partitioned`` and no bound method of one (the runtime is handed its engine, never the face)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import linen as nn

    import axonn_jax
    from axonn_jax.partitioned import Partitioned

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(nn.relu(nn.Dense(16)(x)))

    x = jnp.ones((8, 4))
    pm = axonn_jax.partition(Net(), axonn_jax.Grid.parse(grid), x)
    loss = lambda out, batch: jnp.mean(out**2)  # noqa: E731
    step = pm.train_step(loss, optax.adam(1e-3), microbatches=2)
    params, opt_state = step.init(pm.init(jax.random.key(0)))
    step(params, opt_state, x)
    gradients = pm.value_and_grad(loss)
    gradients(pm.init(jax.random.key(1)), x)
    for root in (step, gradients, pm.engine):
        face = [o for o in _reachable(root) if isinstance(o, Partitioned)
                or isinstance(getattr(o, "__self__", None), Partitioned)]  # fmt: skip
        assert not face, f"{type(root).__name__} reaches the face: {face[:3]}"


def _pipeline_comparisons() -> list[str]:
    """Code lines (not docs or comments) comparing ``<x>.pipeline`` with an int literal."""
    import ast

    found = []
    for folder in ("axonn_jax", "partitioner", "runtime"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Compare):
                    continue
                sides = [node.left, *node.comparators]
                if any(isinstance(s, ast.Attribute) and s.attr == "pipeline" for s in sides) and any(
                        isinstance(s, ast.Constant) and isinstance(s.value, int) for s in sides):  # fmt: skip
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_pipeline_or_not_is_decided_once():
    """The engine is chosen in one place (runtime/engine/__init__.py); the few other
    comparisons are the Grid's own check and the analytical model and grid search, which
    reason about pipelines without running one."""
    found = _pipeline_comparisons()
    files = sorted(line.rsplit(":", 1)[0] for line in found)
    assert len(found) <= 4, found
    assert [f for f in files if f.startswith("runtime/")] == ["runtime/engine/__init__.py"], found
    assert set(files) <= {"runtime/engine/__init__.py", "partitioner/grid.py", "axonn_jax/perf/comm.py",
                          "axonn_jax/search.py"}, found  # fmt: skip
