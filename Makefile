# Everything runs through .venv/bin/...; nothing needs the venv to be activated.
# `make setup` is cheap when nothing changed (scripts/setup.sh keeps a stamp).
PYTHON_VENV := .venv/bin/python
# The venv's bin first, so a plain `mpiexec` in a child process is the one that
# matches mpi4py (the MPICH wheel's); with a system MPI there is none there.
WITH_VENV := PATH="$(CURDIR)/.venv/bin:$$PATH"
PYTEST_ARGS ?=
# Tests that launch mpiexec jobs run alone, after the others ran on TEST_WORKERS
# processes (pytest-xdist), each given whole files, the heaviest first (the order of
# tests/conftest.py's HEAVIEST_FILES; --no-loadscope-reorder keeps it): a file's
# module fixtures and plain references are then computed once, not once per worker.
# Pytest's exit code 5 (no test collected) fails the whole suite (`make test`, which
# .ci/run calls); it is accepted only when PYTEST_ARGS narrows the run and one of the
# two halves selects nothing.
TEST_WORKERS ?= 2
TEST_DIST ?= --dist loadfile --no-loadscope-reorder
# --fresh: a second `make demo` starts over (DEMO_ARGS=--resume continues instead)
DEMO_ARGS ?=
NONE_SELECTED_OK := $(if $(strip $(PYTEST_ARGS)),|| [ $$? -eq 5 ],)
BENCH_ARGS ?=

.PHONY: all setup test demo bench clean distclean

all: setup

setup:
	bash scripts/setup.sh

test: setup
	$(WITH_VENV) $(PYTHON_VENV) -m pytest -q -n $(TEST_WORKERS) $(TEST_DIST) -m "not mpi" $(PYTEST_ARGS) $(NONE_SELECTED_OK)
	$(WITH_VENV) $(PYTHON_VENV) -m pytest -q -m mpi $(PYTEST_ARGS) $(NONE_SELECTED_OK)

demo: setup
	$(WITH_VENV) $(PYTHON_VENV) examples/train_gpt.py --fresh $(DEMO_ARGS)

bench: setup
	$(WITH_VENV) $(PYTHON_VENV) benchmarks/run.py $(BENCH_ARGS)

# Build artefacts and caches; keeps .venv (and runs/, which holds results).
clean:
	rm -rf build dist .pytest_cache .hypothesis
	find . -path ./.venv -prune -o -name '*.egg-info' -type d -prune -exec rm -rf {} +
	find . -path ./.venv -prune -o -name '__pycache__' -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf .venv
