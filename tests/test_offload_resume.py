"""Train state (offloaded or not, pipelined or not) saves and restores exactly, onto any grid and mode.

3 steps + save + restore + 3 steps equal 6 uninterrupted steps bit for bit
(same grid), and a restore onto another grid, with or without a pipeline or
offload, holds the saved values and trains on to the same losses.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from checkpoint_cases import host_leaves, read_with_plain_orbax

import axonn_jax
from axonn_jax.checkpoint import Checkpointer
from axonn_jax.models import GPT, GPTConfig, next_token_loss

MODEL = GPT(GPTConfig(vocab_size=64, num_layers=2, hidden=32, num_heads=2, max_seq_len=16))
BATCHES = [np.random.default_rng(s).integers(0, 64, (8, 16)).astype(np.int32) for s in range(6)]
OPTIMIZER = optax.adamw(optax.cosine_decay_schedule(1e-2, 6))


@functools.cache
def _partitioned_step(grid: tuple, precision: str, offload: bool):
    """(pm, train step) on ``dict(grid)``, built once per process: the tests that train on the
    same grid and mode share its compiled programs (each test starts from its own state)."""
    grid = dict(grid)
    pm = axonn_jax.partition(MODEL, axonn_jax.Grid(**grid), BATCHES[0])
    microbatches = 2 if grid.get("pipeline", 1) > 1 else 1
    step = pm.train_step(next_token_loss, OPTIMIZER, offload=offload, precision=precision,
                         microbatches=microbatches)  # fmt: skip
    return pm, step


def _step(grid: dict, precision: str, offload: bool = True, seed: int = 0):
    pm, step = _partitioned_step(tuple(sorted(grid.items())), precision, offload)
    params, opt_state = step.init(pm.init(jax.random.key(seed)))
    return pm, step, params, opt_state


def _saved_form(step, params, opt_state) -> dict:
    """``{path: host value}`` of the state in the form checkpoints store."""
    params, opt_state = step.checkpoint_state(params, opt_state)
    return {**host_leaves("params", params), **host_leaves("opt_state", opt_state)}


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
                ckpt.save_train_state(3, step, params, opt_state)
                by_path = _saved_form(step, params, opt_state)
    return dict(precision=precision, directory=directory, losses=losses, final=_host(params),
                final_state=_host(opt_state), by_path=by_path)  # fmt: skip


def _assert_read_by_plain_orbax(step_dir, expected: dict, tmp_path) -> None:
    plain = read_with_plain_orbax(step_dir, tmp_path)
    assert sorted(plain) == sorted(expected)
    for path, value in expected.items():
        assert plain[path].dtype == value.dtype, path
        np.testing.assert_array_equal(plain[path], value, err_msg=path)


def test_plain_orbax_reads_offloaded_state(saved_run, tmp_path):
    """fp32 masters and moments saved from pinned host memory, read without axonn_jax."""
    assert all(v.dtype == np.float32 for p, v in saved_run["by_path"].items() if p.startswith("params/"))
    _assert_read_by_plain_orbax(saved_run["directory"] / "3", saved_run["by_path"], tmp_path)


def test_three_plus_three_steps_equal_six(saved_run):
    pm, step, params, opt_state = _step(dict(x=2, z=2, data=2), saved_run["precision"], seed=1)
    restored = Checkpointer(saved_run["directory"], read_only=True).restore_train_state(
        step, params, opt_state)  # fmt: skip
    assert _memory_kinds(restored.opt_state) == _memory_kinds(opt_state)
    params, opt_state = restored.params, restored.opt_state
    losses = saved_run["losses"][:3]
    for batch in BATCHES[3:]:
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    assert losses == saved_run["losses"]
    for got, want in zip(_host(params) + _host(opt_state), saved_run["final"] + saved_run["final_state"]):
        np.testing.assert_array_equal(got, want)


#: each grid and mode restored from one precision's run, both precisions onto a pipeline
RESTORES = [("fp32", dict(pipeline=2, x=2, z=2), True), ("fp32", dict(z=4, data=2), False),
            ("bf16", dict(pipeline=2, z=2, data=2), False), ("bf16", dict(pipeline=2, virtual=2, x=2, z=2), True)]


@pytest.mark.parametrize("saved_run,grid,offload", RESTORES, indirect=["saved_run"])
def test_restore_onto_another_grid_and_mode_holds_the_saved_values(saved_run, grid, offload):
    """Saved offloaded on x=2,z=2,data=2; restored with or without a pipeline and offload."""
    pm, step, params, opt_state = _step(grid, saved_run["precision"], offload=offload, seed=1)
    restored = Checkpointer(saved_run["directory"], read_only=True).restore_train_state(
        step, params, opt_state)  # fmt: skip
    assert _memory_kinds(restored.opt_state) == _memory_kinds(opt_state)
    params, opt_state = restored.params, restored.opt_state
    got = _saved_form(step, params, opt_state)
    assert sorted(got) == sorted(saved_run["by_path"])
    for path, want in saved_run["by_path"].items():
        np.testing.assert_array_equal(got[path], want, err_msg=path)
    for t, batch in enumerate(BATCHES[3:]):  # training goes on from there on the new grid
        params, opt_state, loss = step(params, opt_state, batch)
        np.testing.assert_allclose(float(loss), saved_run["losses"][3 + t],
                                   rtol=1e-5 if saved_run["precision"] == "fp32" else 1e-2)  # fmt: skip
    assert not any(bool(jnp.isnan(x).any()) for x in _host(params))


def test_pipeline_state_resumes_exactly_and_restores_onto_a_flat_grid(devices, tmp_path):
    """pipeline=2 in one process: {stage: offloaded state} saved at step 2 and resumed gives
    the same losses; the same checkpoint restores onto a flat grid without offload."""
    losses, by_path = _four_steps_saved_after_two(*_step(dict(pipeline=2, x=2, z=2), "fp32", offload=True)[1:],
                                                  tmp_path)  # fmt: skip
    _assert_read_by_plain_orbax(tmp_path / "2", by_path, tmp_path)
    for grid, offload in ((dict(pipeline=2, x=2, z=2), True), (dict(x=2, z=2, data=2), False)):
        _assert_resumes(tmp_path, *_step(grid, "fp32", offload=offload, seed=1)[1:], losses,  # other values
                        exact="pipeline" in grid)  # fmt: skip


def _four_steps_saved_after_two(step, params, opt_state, directory) -> tuple[list[float], dict]:
    """Four steps, the train state saved after the second: the losses and the saved form."""
    losses = []
    with Checkpointer(directory) as ckpt:
        for t, batch in enumerate(BATCHES[:4]):
            params, opt_state, loss = step(params, opt_state, batch)
            losses.append(float(loss))
            if t == 1:
                ckpt.save_train_state(2, step, params, opt_state)
                by_path = _saved_form(step, params, opt_state)
    return losses, by_path


def _assert_resumes(directory, step, params, opt_state, losses: list[float], *, exact: bool) -> None:
    """Restored into ``step`` (``params, opt_state``: its init's), the last two steps of
    :func:`_four_steps_saved_after_two` give its losses (bit for bit where ``exact``)."""
    restored = Checkpointer(directory, read_only=True).restore_train_state(step, params, opt_state)
    params, opt_state = restored.params, restored.opt_state
    resumed = losses[:2]
    for batch in BATCHES[2:4]:
        params, opt_state, loss = step(params, opt_state, batch)
        resumed.append(float(loss))
    if exact:
        assert resumed == losses
    else:
        np.testing.assert_allclose(resumed, losses, rtol=1e-5)


def test_a_raw_pipeline_train_state_onto_a_flat_grid_names_save_train_state(devices, tmp_path):
    """ckpt.save(n, params, opt_state) of a pipeline step is in the pipeline's form ({stage: state}):
    restoring it onto a flat step's opt_state names the calls that work across grids."""
    step, params, opt_state = _step(dict(pipeline=2, x=2, z=2), "fp32", offload=False)[1:]
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, params, opt_state)
    flat_params, flat_state = _step(dict(x=2, z=2, data=2), "fp32", offload=False)[2:]
    with pytest.raises(ValueError, match=r"(?s)opt_state/optimizer/inner.*save_train_state"
                                         r".*restore_train_state\(step, params, opt_state\)"):  # fmt: skip
        Checkpointer(tmp_path, read_only=True).restore(params=flat_params, opt_state=flat_state)


def test_train_state_restores_across_precisions_fp16_included(devices, tmp_path):
    """docs/checkpoints.md: the saved train state does not depend on the precision. An fp16
    step's state (its dynamic loss scale beside the masters) restores into a bf16 step, which
    drops the scale, and a bf16 state into an fp16 step, which starts a fresh scale; both
    used to be refused ("in the checkpoint but not in the target ['opt_state/loss_scale/...']",
    blaming the model and optimizer). The masters come back exactly either way."""
    grid = dict(x=2, z=2, data=2)
    step16, params, opt_state = _step(grid, "fp16", offload=False)[1:]
    params, opt_state, _ = step16(params, opt_state, BATCHES[0])
    with Checkpointer(tmp_path / "fp16") as ckpt:
        ckpt.save_train_state(1, step16, params, opt_state)
    saved16 = _saved_form(step16, params, opt_state)
    assert any(p.startswith("opt_state/loss_scale/") for p in saved16)

    step_bf16, fresh, fresh_state = _step(grid, "bf16", offload=False, seed=1)[1:]
    restored = Checkpointer(tmp_path / "fp16", read_only=True).restore_train_state(step_bf16, fresh, fresh_state)
    as_bf16 = _saved_form(step_bf16, restored.params, restored.opt_state)
    assert sorted(as_bf16) == sorted(p for p in saved16 if not p.startswith("opt_state/loss_scale/"))
    for path, value in as_bf16.items():
        np.testing.assert_array_equal(value, saved16[path], err_msg=path)
    params, opt_state, loss = step_bf16(restored.params, restored.opt_state, BATCHES[1])
    assert np.isfinite(float(loss))
    with Checkpointer(tmp_path / "bf16") as ckpt:
        ckpt.save_train_state(2, step_bf16, params, opt_state)

    fresh, fresh_state = step16.init(axonn_jax.partition(MODEL, axonn_jax.Grid(**grid), BATCHES[0]).init(
        jax.random.key(2)))
    restored = Checkpointer(tmp_path / "bf16", read_only=True).restore_train_state(step16, fresh, fresh_state)
    np.testing.assert_array_equal(np.asarray(restored.opt_state.loss_scale.scale),
                                  np.asarray(fresh_state.loss_scale.scale))  # a fresh scale
    saved_bf16 = _saved_form(step_bf16, params, opt_state)
    for path, value in _saved_form(step16, restored.params, restored.opt_state).items():
        if not path.startswith("opt_state/loss_scale/"):
            np.testing.assert_array_equal(value, saved_bf16[path], err_msg=path)


def test_masked_optimizer_state_of_a_pipeline_saves_and_resumes(devices, tmp_path):
    """``optax.multi_transform`` (and ``optax.masked``) keep ``MaskedNode`` where a parameter is
    masked out, and each pipeline stage has ``None`` where a parameter is another stage's.
    Merging the stages' states for a checkpoint failed on that ("different types at key path
    ... MaskedNode ... NoneType"). Now the pipeline's saved state is the flat grid's (same
    paths), it resumes to the uninterrupted run's losses, and restores onto a flat grid."""
    labels = lambda p: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda k, _: "kernel" if "kernel" in jax.tree_util.keystr(k) else "other", p)
    optimizer = optax.multi_transform({"kernel": optax.adam(1e-2), "other": optax.sgd(1e-2, momentum=0.9)}, labels)

    def make(grid):
        pm = axonn_jax.partition(MODEL, axonn_jax.Grid(**grid), BATCHES[0])
        step = pm.train_step(next_token_loss, optimizer, microbatches=2 if grid.get("pipeline") else 1)
        return step, *step.init(pm.init(jax.random.key(0)))

    losses, by_path = _four_steps_saved_after_two(*make(dict(pipeline=2, x=2, z=2)), tmp_path)
    flat = make(dict(x=2, z=2, data=2))
    assert sorted(by_path) == sorted(_saved_form(*flat))
    _assert_resumes(tmp_path, *make(dict(pipeline=2, x=2, z=2)), losses, exact=True)
    _assert_resumes(tmp_path, *flat, losses, exact=False)


def test_a_train_state_restored_into_another_optimizer_is_warned_about(devices, tmp_path):
    """An optimizer state restored into a step with other hyperparameters (here another peak
    learning rate; a helper found AdamW's restored into Adam) was accepted silently: they are
    not in the state. The checkpoint now records the saving step's optimizer update (its
    digest and scalar constants, as ranks compare them), and a restore into another one warns,
    naming both (a new learning rate can be intended); the same optimizer on another grid and
    precision restores quietly. An optimizer whose state has other parts is an error, as
    before."""
    import warnings

    grid = dict(x=2, z=2, data=2)
    _, step, params, opt_state = _step(grid, "fp32", offload=False)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save_train_state(1, step, *step(params, opt_state, BATCHES[0])[:2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, same, params, opt_state = _step(dict(z=4, data=2), "bf16", offload=False, seed=1)
        restored = Checkpointer(tmp_path, read_only=True).restore_train_state(same, params, opt_state)
    assert not [w for w in caught if "optimizer update differs" in str(w.message)]
    assert restored.saved_by == {"optimizer": step.fingerprint["optimizer"]} == {"optimizer": same.fingerprint["optimizer"]}
    pm = axonn_jax.partition(MODEL, axonn_jax.Grid(**grid), BATCHES[0])
    other = pm.train_step(next_token_loss, optax.adamw(optax.cosine_decay_schedule(3e-2, 6)))  # another peak
    params, opt_state = other.init(pm.init(jax.random.key(2)))
    with pytest.warns(UserWarning, match=r"step 1 of .* was saved by a step whose optimizer update differs .*constants"):
        Checkpointer(tmp_path, read_only=True).restore_train_state(other, params, opt_state)
