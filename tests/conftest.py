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
