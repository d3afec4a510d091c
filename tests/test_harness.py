"""The test harness itself: CI's exit codes and timeouts that report their own cause."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import mpi_util
import pytest
from mpi_util import run_mpi

ROOT = Path(__file__).resolve().parents[1]


def _pytest_lines(*make_args: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    out = subprocess.run(["make", "-n", "test", *make_args], cwd=ROOT, capture_output=True, env=env,
                         text=True, timeout=60, check=True).stdout  # a `make test X=...` around us: not ours
    lines = [line for line in out.splitlines() if " -m pytest " in line]
    assert len(lines) == 2, out
    return lines


def test_no_tests_collected_fails_the_ci_path():
    """.ci/run calls ``make test``: there pytest's exit 5 (nothing collected) is a failure;
    only a run narrowed by PYTEST_ARGS accepts it (one half may select nothing)."""
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert not any("-eq 5" in line for line in _pytest_lines())
    assert all(line.endswith("|| [ $? -eq 5 ]") for line in _pytest_lines("PYTEST_ARGS=-k kernels"))


def test_a_subprocess_timeout_beyond_the_pytest_timeout_is_refused():
    """Under the default 600 s pytest timeout, a 900 s job would be killed by pytest-timeout
    without its output; run_mpi refuses it before starting anything, naming the remedy."""
    assert mpi_util.PYTEST_TIMEOUT == 600
    with pytest.raises(ValueError, match=r"900 s does not fit in this test's pytest timeout of 600 s"
                                         r".*Remedy: @pytest.mark.timeout\(930\)"):  # fmt: skip
        run_mpi(2, "print_then_sleep.py", "0", timeout=900)
    assert mpi_util.subprocess_timeout(None) == 300


@pytest.mark.timeout(960)
def test_a_marked_test_may_run_longer_jobs():
    assert mpi_util.PYTEST_TIMEOUT == 960 and mpi_util.subprocess_timeout(900) == 900


@pytest.mark.mpi
def test_a_job_past_its_timeout_fails_with_its_own_message_and_output():
    with pytest.raises(AssertionError, match=r"(?s)print_then_sleep.py 60 ran past its timeout of 10 s"
                                             r".*started, now sleeping"):  # fmt: skip
        run_mpi(2, "print_then_sleep.py", "60", timeout=10)


def test_spread_keeps_every_grid_and_gives_each_name_distinct_grids():
    from conftest import spread

    grids = ["g0", "g1", "g2", "g3", "g4"]
    cases = spread(["a", "b", "c"], grids)
    assert cases == [("a", "g0"), ("a", "g1"), ("b", "g2"), ("b", "g3"), ("c", "g4"), ("c", "g0")]
    for names, per in ((list("abcdefghij"), 2), (["x", "y"], 3)):
        cases = spread(names, grids, per_name=per)
        assert {g for _, g in cases} == set(grids)
        assert all(len({g for n, g in cases if n == name}) == per for name in names)
    with pytest.raises(ValueError, match="2 names x 2 grids leave some of the 5 grids untested"):
        spread(["a", "b"], grids)
