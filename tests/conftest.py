"""Test set-up: 8 simulated CPU devices (set before JAX is imported)."""

import os

from xla_flags import xla_flags

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import itertools  # noqa: E402

import pytest  # noqa: E402


def grids_of(total: int, sizes=(1, 2, 4, 8)):
    """All (x, y, z, data) with entries in ``sizes`` whose product is ``total``."""
    return [
        dict(x=x, y=y, z=z, data=d)
        for x, y, z, d in itertools.product(sizes, repeat=4)
        if x * y * z * d == total
    ]


def grid_id(grid: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in grid.items() if v != 1) or "single"


@pytest.fixture(scope="session")
def devices():
    import jax

    devs = jax.devices()
    assert len(devs) == 8, "tests expect 8 simulated CPU devices"
    return devs


def _pytest_timeout(item) -> float | None:
    """pytest-timeout's limit for ``item``: its marker, else --timeout, else the ini value."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        return float(marker.args[0] if marker.args else marker.kwargs.get("timeout", 0)) or None
    value = item.config.getoption("timeout", None)
    if value is None:
        value = item.config.getini("timeout")
    return float(value) if value else None


@pytest.fixture(autouse=True)
def _subprocess_budget(request):
    """Child processes of this test (mpi_util.run_mpi) must end before pytest-timeout fires."""
    import mpi_util

    mpi_util.PYTEST_TIMEOUT = _pytest_timeout(request.node)
    yield
    mpi_util.PYTEST_TIMEOUT = None
