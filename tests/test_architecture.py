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
    assert re.search(r"Contracts: 3 kept, 0 broken", result.stdout), result.stdout


@pytest.mark.parametrize(
    "module, line, contract",
    [
        ("layout.py", "from axonn_jax.runtime import launch", "runtime builds on the partitioner"),
        ("layout.py", "import axonn_jax.partitioned", "never import the face"),
        ("../runtime/mesh.py", "from axonn_jax.checkpoint import Checkpointer", "never import the face"),
        ("stages.py", "from mpi4py import MPI", "speak MPI"),
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
