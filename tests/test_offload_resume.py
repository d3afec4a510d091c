"""Offloaded optimizer state (pinned_host) saves and restores exactly, onto any grid.

3 steps + save + restore + 3 steps equal 6 uninterrupted steps bit for bit
(same grid), and a restore onto another grid (with or without offload) holds
the saved values.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from checkpoint_cases import host_leaves, read_with_plain_orbax

import axonn_jax
from axonn_jax.checkpoint import Checkpointer
from axonn_jax.models import GPT, GPTConfig, next_token_loss

MODEL = GPT(GPTConfig(vocab_size=64, num_layers=1, hidden=32, num_heads=2, max_seq_len=16))
BATCHES = [np.random.default_rng(s).integers(0, 64, (8, 16)).astype(np.int32) for s in range(6)]
OPTIMIZER = optax.adamw(optax.cosine_decay_schedule(1e-2, 6))


def _step(grid: dict, precision: str, offload: bool = True):
    pm = axonn_jax.partition(MODEL, axonn_jax.Grid(**grid), BATCHES[0])
    step = pm.train_step(next_token_loss, OPTIMIZER, offload=offload, precision=precision)
    params, opt_state = step.init(pm.init(jax.random.key(0)))
    return pm, step, params, opt_state


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _memory_kinds(tree) -> set:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree) if hasattr(x, "sharding")}


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def saved_run(request, devices, tmp_path_factory):
    precision = request.param
    pm, step, params, opt_state = _step(dict(x=2, z=2, data=2), precision)
    assert "pinned_host" in _memory_kinds(opt_state)
    directory = tmp_path_factory.mktemp(f"offload-{precision}")
    losses = []
    with Checkpointer(directory) as ckpt:
        for t, batch in enumerate(BATCHES):
            params, opt_state, loss = step(params, opt_state, batch)
            losses.append(float(loss))
            if t == 2:
                ckpt.save(3, params, opt_state)
                at_3 = (_host(params), _host(opt_state))
                by_path = {**host_leaves("params", params), **host_leaves("opt_state", opt_state)}
    return dict(precision=precision, directory=directory, losses=losses, final=_host(params),
                final_state=_host(opt_state), at_3=at_3, by_path=by_path)  # fmt: skip


def _assert_read_by_plain_orbax(step_dir, expected: dict, tmp_path) -> None:
    plain = read_with_plain_orbax(step_dir, tmp_path)
    assert sorted(plain) == sorted(expected)
    for path, value in expected.items():
        assert plain[path].dtype == value.dtype, path
        np.testing.assert_array_equal(plain[path], value, err_msg=path)


def test_plain_orbax_reads_offloaded_state(saved_run, tmp_path):
    """Masters and moments saved from pinned host memory, read without axonn_jax."""
    assert any("/master/" in p for p in saved_run["by_path"])
    _assert_read_by_plain_orbax(saved_run["directory"] / "3", saved_run["by_path"], tmp_path)


def test_three_plus_three_steps_equal_six(saved_run):
    pm, step, params, opt_state = _step(dict(x=2, z=2, data=2), saved_run["precision"])
    restored = Checkpointer(saved_run["directory"], read_only=True).restore(
        params=params, opt_state=opt_state)  # fmt: skip
    assert _memory_kinds(restored.opt_state) == _memory_kinds(opt_state)
    params, opt_state = restored.params, restored.opt_state
    losses = saved_run["losses"][:3]
    for batch in BATCHES[3:]:
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    assert losses == saved_run["losses"]
    for got, want in zip(_host(params) + _host(opt_state), saved_run["final"] + saved_run["final_state"]):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("grid,offload", [(dict(x=2, y=2, z=2), True), (dict(data=8), True),
                                          (dict(z=4, data=2), False)])  # fmt: skip
def test_restore_onto_another_grid_holds_the_saved_values(saved_run, grid, offload):
    pm, step, params, opt_state = _step(grid, saved_run["precision"], offload=offload)
    if saved_run["precision"] == "fp32" and not offload:  # fp32 on device keeps no master copy
        with pytest.raises(ValueError, match=r"missing from the checkpoint \['opt_state/optimizer/master'\]"):
            Checkpointer(saved_run["directory"], read_only=True).restore(params=params,
                                                                         opt_state=opt_state)  # fmt: skip
        return
    restored = Checkpointer(saved_run["directory"], read_only=True).restore(
        params=params, opt_state=opt_state)  # fmt: skip
    saved_params, saved_state = saved_run["at_3"]
    for got, want in zip(_host(restored.params) + _host(restored.opt_state), saved_params + saved_state):
        np.testing.assert_array_equal(got, want)
    assert _memory_kinds(restored.opt_state) == _memory_kinds(opt_state)
    params, opt_state = restored.params, restored.opt_state
    for t, batch in enumerate(BATCHES[3:]):  # training goes on from there on the new grid
        params, opt_state, loss = step(params, opt_state, batch)
        np.testing.assert_allclose(float(loss), saved_run["losses"][3 + t],
                                   rtol=1e-5 if saved_run["precision"] == "fp32" else 1e-2)  # fmt: skip
    assert not any(bool(jnp.isnan(x).any()) for x in _host(params))


def test_pipeline_with_offload_resumes_exactly(devices, tmp_path):
    """pipeline=2 in one process: {stage: offloaded state} saved at step 2, resumed, same losses."""
    model = GPT(GPTConfig(vocab_size=64, num_layers=2, hidden=32, num_heads=2, max_seq_len=16))

    def fresh(seed):
        pm = axonn_jax.partition(model, axonn_jax.Grid(pipeline=2, x=2, z=2), BATCHES[0][:4])
        step = pm.train_step(next_token_loss, OPTIMIZER, offload=True, microbatches=2)
        return (step, *step.init(pm.init(jax.random.key(seed))))

    step, params, opt_state = fresh(0)
    losses = []
    with Checkpointer(tmp_path) as ckpt:
        for t, batch in enumerate(BATCHES[:4]):
            params, opt_state, loss = step(params, opt_state, batch)
            losses.append(float(loss))
            if t == 1:
                ckpt.save(2, params, opt_state)
                by_path = {**host_leaves("params", params), **host_leaves("opt_state", opt_state)}
    step, params, opt_state = fresh(1)  # other initial values: the restore must replace them
    restored = Checkpointer(tmp_path, read_only=True).restore(params=params, opt_state=opt_state)
    params, opt_state = restored.params, restored.opt_state
    resumed = losses[:2]
    for batch in BATCHES[2:4]:
        params, opt_state, loss = step(params, opt_state, batch)
        resumed.append(float(loss))
    assert resumed == losses
    _assert_read_by_plain_orbax(tmp_path / "2", by_path, tmp_path)
