"""Test set-up: 8 simulated CPU devices (set before JAX is imported)."""

import os

from xla_flags import xla_flags

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One XLA compilation cache for the run's processes (pytest-xdist workers, mpiexec ranks,
# example subprocesses): many files compile the same plain reference and example programs.
# The key is the program, the flags and JAX's version, so a stale entry is never used.
# AXONN_TEST_COMPILATION_CACHE=0 turns it off. XLA:CPU reloads a program whose collectives sit
# in more than one computation (a scan body that communicates next to a collective outside it)
# without their order: each nested thunk sequence gets its own communicator resource
# (ThunkSequenceSerDesProtobuf::FromProto), so devices of one program may enter different
# collectives first and wait forever (gdb on the aborting scan_gpt_nnx pipeline stage: two
# devices in the top-level ReduceScatter, two in an AllGather of the WhileThunk's body).
# runtime/compilation_cache.py keeps such programs out of the cache (installed with the runtime,
# so in every process that runs axonn_jax, and here for the plain JAX programs).
if os.environ.get("AXONN_TEST_COMPILATION_CACHE", "1") == "1":
    _CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "xla")
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))

    import axonn_jax.runtime  # noqa: E402, F401  (installs the cache guard)

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


def spread(names, grids, per_name: int = 2) -> list[tuple]:
    """``(name, grid)`` cases: every name on ``per_name`` grids, every grid on some name.

    The suite's budget (about 20 minutes on 2 CPU cores) has no room for every model on
    every grid; rotating through the table keeps each grid of it under test, each model
    on ``per_name`` different grids, and the pairs varied::

        spread(["a", "b", "c"], [g0, g1, g2, g3, g4])
        # [("a", g0), ("a", g1), ("b", g2), ("b", g3), ("c", g4), ("c", g0)]
    """
    names, grids = list(names), list(grids)
    if len(names) * per_name < len(grids):
        raise ValueError(f"{len(names)} names x {per_name} grids leave some of the {len(grids)} grids untested")
    return [(name, grids[(i * per_name + j) % len(grids)]) for i, name in enumerate(names) for j in range(per_name)]


# --- opt-in XLA compilation counts (AXONN_TEST_COUNT_COMPILES=1) -------------------
# The suite is compile-bound, and compile counts, unlike seconds, do not depend on the
# machine's load: the summary lists, per file, the tests' seconds and XLA compilations
# (backend compiles, persistent-cache hits included) and writes the per-test numbers to
# .pytest_cache/compiles.json (with the compiled functions' names, to find repeats). Works
# under pytest-xdist (the counts ride on the reports).
_COUNT_COMPILES = os.environ.get("AXONN_TEST_COUNT_COMPILES", "0") == "1"
_compiles = {"count": 0, "seconds": 0.0, "names": {}}
_per_test: dict = {}


def _on_event_duration(event: str, duration: float, fun_name: str = "?", **_) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles["count"] += 1
        _compiles["seconds"] += duration
        _compiles["names"][fun_name] = _compiles["names"].get(fun_name, 0) + 1


def pytest_configure(config):
    if _COUNT_COMPILES:
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(_on_event_duration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Attach the compilations of this phase (setup, call or teardown) to its report."""
    outcome = yield
    if _COUNT_COMPILES:
        report = outcome.get_result()
        report.user_properties.append(("xla_compiles", (_compiles["count"], _compiles["seconds"], _compiles["names"])))
        _compiles.update(count=0, seconds=0.0, names={})


def pytest_runtest_logreport(report):
    for _, (count, seconds, names) in (p for p in report.user_properties if p[0] == "xla_compiles"):
        row = _per_test.setdefault(report.nodeid, {"seconds": 0.0, "compiles": 0, "compile_seconds": 0.0, "names": {}})
        row["seconds"] += report.duration
        row["compiles"] += count
        row["compile_seconds"] += seconds
        for name, n in names.items():
            row["names"][name] = row["names"].get(name, 0) + n


def pytest_terminal_summary(terminalreporter, config):
    if not _per_test or hasattr(config, "workerinput"):
        return
    import json

    files: dict = {}
    for nodeid, row in _per_test.items():
        f = files.setdefault(nodeid.split("::")[0], {"tests": 0, "seconds": 0.0, "compiles": 0, "compile_seconds": 0.0})
        f["tests"] += 1
        for key in ("seconds", "compiles", "compile_seconds"):
            f[key] += row[key]
    terminalreporter.section("XLA compilations per file")
    terminalreporter.line(f"{'seconds':>8} {'compiles':>8} {'compile s':>9} {'tests':>5}  file")
    for name, f in sorted(files.items(), key=lambda kv: -kv[1]["seconds"]):
        terminalreporter.line(f"{f['seconds']:8.1f} {f['compiles']:8d} {f['compile_seconds']:9.1f} {f['tests']:5d}  {name}")
    out = os.path.join(str(config.rootpath), ".pytest_cache", "compiles.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(_per_test, fh, indent=1, sort_keys=True)


# --- the heaviest files first ------------------------------------------------------
# `make test` gives each pytest-xdist worker whole files (--dist loadfile: a file's
# module fixtures and cached plain references are computed once, not once per worker)
# and the next file when one ends; starting with the longest files keeps the two
# workers' finishing times close. Ordered by serial seconds per file, as measured in a
# full run (--junitxml durations); the rest follow in their usual order.
HEAVIEST_FILES = ["test_example.py", "test_virtual_stages.py", "test_control_flow.py", "test_redundancy.py",
                  "test_rng_and_state.py", "test_partition.py", "test_zero_bubble.py", "test_idioms.py",
                  "test_pipeline.py", "test_offload_resume.py", "test_offload.py", "test_inputs.py"]


def pytest_collection_modifyitems(session, config, items):
    """Stable-sort the items so that the files of ``HEAVIEST_FILES`` come first, in its order."""
    rank = {name: i for i, name in enumerate(HEAVIEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
