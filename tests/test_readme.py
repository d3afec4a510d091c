"""The README's code runs as written, and its jitted train step compiles once.

Compilations are counted with JAX's own backend-compile event (and the jitted
function's cache size); losses only need to be finite.
"""

import contextlib
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring

ROOT = Path(__file__).resolve().parents[1]
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def readme_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


@contextlib.contextmanager
def count_compiles():
    """``counter[0]``: XLA compilations started inside the block."""
    counter = [0]

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            counter[0] += 1

    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counter
    finally:
        monitoring.unregister_event_duration_listener(listener)


@pytest.fixture(scope="module")
def readme(devices):
    """The namespace after the README's complete example ran (3 steps)."""
    namespace: dict = {}
    exec(compile(readme_blocks()[0], "README.md (complete example)", "exec"), namespace)
    return namespace


def test_readme_example_trains_and_compiles_its_step_once(readme):
    assert np.isfinite(float(readme["loss"]))
    assert readme["train_step"]._cache_size() == 1  # 3 steps ran in the README block
    step, loader = readme["train_step"], readme["loader"]
    params, opt_state = readme["params"], readme["opt_state"]
    with count_compiles() as compiles:
        for _ in range(3):
            params, opt_state, loss = step(params, opt_state, next(loader))
        float(loss)
    assert compiles[0] == 0 and step._cache_size() == 1


def test_plain_optimizer_init_compiles_twice(readme):
    """Why the README uses pm.init_optimizer: optax puts the step counter on one device."""
    optimizer, loader = readme["optimizer"], readme["loader"]
    step = jax.jit(readme["train_step"].__wrapped__)
    params, opt_state = readme["params"], optimizer.init(readme["params"])
    for _ in range(3):
        params, opt_state, _ = step(params, opt_state, next(loader))
    assert step._cache_size() == 2


def test_init_optimizer_refuses_pipelines(readme):
    import axonn_jax

    pm = axonn_jax.partition(readme["model"], axonn_jax.Grid(pipeline=2, x=2, z=2), readme["tokens"][:4])
    with pytest.raises(ValueError, match="stage meshes.*step.init"):
        pm.init_optimizer(readme["optimizer"], pm.init(jax.random.key(0)))


def test_train_step_compiles_once(readme):
    """pm.train_step(...).init places the state as the step returns it (no pipeline)."""
    import optax

    from axonn_jax.models import next_token_loss, window_inputs

    pm, loader = readme["pm"], readme["loader"]
    step = pm.train_step(next_token_loss, optax.adamw(1e-3), inputs=window_inputs)
    params, opt_state = step.init(pm.init(jax.random.key(1)))
    params, opt_state, loss = step(params, opt_state, next(loader))
    with count_compiles() as compiles:
        for _ in range(2):
            params, opt_state, loss = step(params, opt_state, next(loader))
        float(loss)
    assert compiles[0] == 0


def test_gathering_again_compiles_nothing(readme):
    """pm.gather replicates each mesh's leaves with one compiled program, which later calls reuse."""
    pm, params, opt_state = readme["pm"], readme["params"], readme["opt_state"]
    first = pm.gather(params, opt_state)
    with count_compiles() as compiles:
        again = pm.gather(params, opt_state)
    assert compiles[0] == 0
    jax.tree.map(np.testing.assert_array_equal, first, again)


@pytest.mark.slow
def test_readme_convenient_form_runs(readme):
    """The pipelined bf16 + offload + remat step of the README, as written, one step."""
    namespace = dict(readme)
    exec(compile(readme_blocks()[1], "README.md (convenient form)", "exec"), namespace)
    assert np.isfinite(float(namespace["loss"]))
    # evaluation with the step's bf16 params: pm.apply casts them as the plan was traced
    pm, params, batch = namespace["pm"], namespace["params"], namespace["batch"]
    cast = jax.tree.map(lambda x: None if x is None else x.astype(jnp.float32), params,
                        is_leaf=lambda x: x is None)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(namespace["logits"]), np.asarray(pm.apply(cast, batch[:, :-1])))


@pytest.mark.mpi
@pytest.mark.slow
def test_readme_example_runs_under_mpiexec_as_written_without_gloo_lines():
    """The README says the same script runs under MPI: two ranks of 4 devices, one loss."""
    from mpi_util import run_mpi

    result = run_mpi(2, "readme_example.py", devices_per_process=4, timeout=400)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    losses = re.findall(r"^rank (\d) of 2: loss (\S+)$", result.stdout, re.M)
    assert sorted(rank for rank, _ in losses) == ["0", "1"], (result.stdout + result.stderr)[-3000:]
    assert losses[0][1] == losses[1][1], losses
    assert "[Gloo]" not in result.stdout + result.stderr
