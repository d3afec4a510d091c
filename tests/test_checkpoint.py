"""Checkpoints: restore onto other grids, exact resume, killed saves, damaged files.

Equivalence is bitwise throughout: restored values equal the saved ones exactly,
and a resumed run's losses equal the uninterrupted run's exactly (same grid,
same compiled programs).
"""

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from checkpoint_cases import host_leaves, place, read_with_plain_orbax, shardings, values
from conftest import grid_id

import axonn_jax
from axonn_jax import Grid, checkpoint
from axonn_jax.checkpoint import Checkpointer, CheckpointError
from axonn_jax.loader import Loader
from axonn_jax.models import GPT, GPTConfig, next_token_loss
from axonn_jax.runtime.checkpoint import shard_store, writer_lock

TESTS = Path(__file__).resolve().parent
BATCH, SEQ = 8, 15
MODEL = GPT(GPTConfig(vocab_size=64, num_layers=1, hidden=32, num_heads=2, max_seq_len=SEQ + 1))
EXAMPLE = jnp.zeros((BATCH, SEQ + 1), jnp.int32)


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _assert_bitwise(a, b):
    leaves_a, leaves_b = _host(a), _host(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def _train_step(pm, optimizer):
    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: next_token_loss(pm.apply(p, batch), batch))(params)  # fmt: skip
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


@pytest.fixture(scope="module")
def corpus():
    return np.random.default_rng(1).integers(0, 64, size=3_000).astype(np.uint8)


@pytest.fixture(scope="module")
def run(devices, corpus, tmp_path_factory):
    """GPT on x=2,y=2,z=2: 6 AdamW steps, saved asynchronously after step 3 while training goes on."""
    pm = axonn_jax.partition(MODEL, Grid(x=2, y=2, z=2), EXAMPLE)
    optimizer = optax.adamw(optax.cosine_decay_schedule(1e-2, 6))
    step = _train_step(pm, optimizer)
    params = pm.init(jax.random.key(0))
    opt_state = optimizer.init(params)
    loader = Loader(corpus, batch=BATCH, seq=SEQ, mesh=pm.mesh, seed=4)
    directory = tmp_path_factory.mktemp("run")
    losses = []
    for _ in range(6):
        params, opt_state, loss = step(params, opt_state, next(loader))
        losses.append(float(loss))
        if loader.step == 3:
            checkpoint.save(directory, 3, params, opt_state, extra={"loader": loader.state()},
                            rng=jax.random.key(9))  # fmt: skip
            at_3 = dict(params=params, opt_state=opt_state)
    checkpoint.close(directory)
    return dict(pm=pm, optimizer=optimizer, step=step, losses=losses, final=params,
                directory=directory, **at_3)  # fmt: skip


# --- orbax's standard layout -------------------------------------------------------


def test_plain_orbax_reads_the_checkpoint_without_axonn_jax(run, tmp_path):
    """StandardCheckpointer, in a process that never imports axonn_jax, gets every saved value."""
    plain = read_with_plain_orbax(run["directory"] / "3", tmp_path)
    expected = {**host_leaves("params", run["pm"].gather(run["params"])),
                **host_leaves("opt_state", run["opt_state"]),
                **host_leaves("rng", {"key": jax.random.key(9)})}  # fmt: skip
    assert sorted(plain) == sorted(expected)
    for path, value in expected.items():
        assert plain[path].dtype == value.dtype and plain[path].shape == value.shape, path
        np.testing.assert_array_equal(plain[path], value, err_msg=path)


def test_restore_into_a_model_of_another_size_names_the_leaf_and_both_shapes(run):
    bigger = GPT(GPTConfig(vocab_size=64, num_layers=1, hidden=64, num_heads=2, max_seq_len=SEQ + 1))
    pm = axonn_jax.partition(bigger, Grid(x=2, y=2, z=2), EXAMPLE)
    with pytest.raises(ValueError, match=r"'params/block_0/attn/key/bias' is float32\[2, 16\] in checkpoint .* step 3 but the target is float32\[2, 32\]"):  # fmt: skip
        checkpoint.restore(run["directory"], params=pm.param_structs, optimizer=run["optimizer"])
    with pytest.raises(TypeError, match=r"step must be a non-negative int, got '3' \(str\). Remedy: restore\(step=3\)"):  # fmt: skip
        checkpoint.restore(run["directory"], "3", params=run["pm"].param_structs)


# --- restore onto any grid ------------------------------------------------------


@pytest.mark.parametrize("grid", [dict(z=4, data=2), dict(data=8), dict(x=2, y=2, z=2)], ids=grid_id)
def test_restore_onto_another_grid_is_bitwise(run, grid):
    pm = axonn_jax.partition(MODEL, Grid(**grid), EXAMPLE)
    restored = checkpoint.restore(run["directory"], params=pm.param_shardings,
                                  optimizer=run["optimizer"])  # fmt: skip
    assert restored.step == 3 and restored.extra["loader"]["step"] == 3
    _assert_bitwise(pm.gather(restored.params), run["pm"].gather(run["params"]))
    _assert_bitwise(restored.opt_state, run["opt_state"])
    for leaf, target in zip(jax.tree.leaves(restored.params), jax.tree.leaves(pm.param_shardings)):
        assert leaf.sharding == target
    mu = restored.opt_state[0].mu
    for leaf, target in zip(jax.tree.leaves(mu), jax.tree.leaves(pm.param_shardings)):
        assert leaf.sharding == target
    np.testing.assert_array_equal(jax.random.key_data(restored.rng), jax.random.key_data(jax.random.key(9)))  # fmt: skip


def test_explicit_targets_are_checked_against_the_checkpoint(run):
    pm = run["pm"]
    ckpt = Checkpointer(run["directory"], read_only=True)
    # jax.Arrays and ShapeDtypeStructs as targets: their shardings are used
    restored = ckpt.restore(params=run["params"], opt_state=run["opt_state"])
    _assert_bitwise(restored.opt_state, run["opt_state"])

    params = dict(run["params"])
    extra = dict(params, added=params["pos_embed"])
    with pytest.raises(ValueError, match=r"missing from the checkpoint \['params/added'\]"):
        ckpt.restore(params=extra)
    del params["pos_embed"]
    with pytest.raises(ValueError, match=r"not in the target \(of any process\) \['params/pos_embed'\]"):  # fmt: skip
        ckpt.restore(params=params)
    wrong = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), run["params"])  # fmt: skip
    embed = wrong["embed"]["embedding"]
    wrong["embed"]["embedding"] = jax.ShapeDtypeStruct((embed.shape[0], 16), embed.dtype, sharding=embed.sharding)  # fmt: skip
    with pytest.raises(ValueError, match=r"'params/embed/embedding' is float32\[64, 32\] .* target is float32\[64, 16\]"):  # fmt: skip
        ckpt.restore(params=wrong)
    wrong["embed"]["embedding"] = jax.ShapeDtypeStruct(embed.shape, jnp.bfloat16, sharding=embed.sharding)  # fmt: skip
    with pytest.raises(ValueError, match=r"target is bfloat16\[64, 32\]"):
        ckpt.restore(params=wrong)
    with pytest.raises(ValueError, match=r"opt_state target does not match .*'opt_state/0/mu/"):
        ckpt.restore(params=pm.param_shardings, optimizer=optax.sgd(0.1))
    with pytest.raises(CheckpointError, match=r"no complete checkpoint for step 7 .* \[3\]"):
        ckpt.restore(7, params=pm.param_shardings)


# --- exact resume -------------------------------------------------------------------


def test_resume_gives_the_losses_of_an_uninterrupted_run(run, corpus):
    """Restart from the step-3 checkpoint with new state, loader and Checkpointer objects.

    (The jitted train step is reused: a restarted process would compile the same program.)
    """
    pm = run["pm"]
    restored = Checkpointer(run["directory"], read_only=True).restore(
        params=pm.param_shardings, optimizer=run["optimizer"]
    )
    params, opt_state = restored.params, restored.opt_state
    loader = Loader.from_state(corpus, restored.extra["loader"], mesh=pm.mesh)
    resumed = run["losses"][:3]
    for _ in range(3):
        params, opt_state, loss = run["step"](params, opt_state, next(loader))
        resumed.append(float(loss))
    assert resumed == run["losses"]
    assert len(set(run["losses"])) == 6  # the losses really change
    _assert_bitwise(params, run["final"])


# --- asynchrony, atomicity, retention ------------------------------------------------


def test_save_returns_before_writing_and_is_listed_only_when_complete(devices, tmp_path, monkeypatch):  # fmt: skip
    layout = shardings(devices)
    ckpt = Checkpointer(tmp_path, max_to_keep=2)
    ckpt.save(1, place(values(1), layout))
    ckpt.wait()
    gate, original = threading.Event(), shard_store.write

    async def gated(leaf, where, context):
        import asyncio

        await asyncio.to_thread(gate.wait, 60)
        await original(leaf, where, context)

    monkeypatch.setattr(shard_store, "write", gated)
    started = time.perf_counter()
    ckpt.save(2, place(values(2), layout))
    assert time.perf_counter() - started < 30  # did not wait for the gate
    assert ckpt.latest_step() == 1  # step 2 is still being written
    assert any("tmp" in p.name for p in tmp_path.iterdir())
    gate.set()
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]
    for step in (3, 4):
        ckpt.save(step, place(values(step), layout))
    ckpt.wait()
    assert ckpt.all_steps() == [3, 4]  # max_to_keep=2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != writer_lock.NAME) == ["3", "4"]
    _assert_bitwise(ckpt.restore(params=layout).params, values(4))
    with pytest.raises(ValueError, match="already holds step 4"):
        ckpt.save(4, place(values(4), layout))
    ckpt.close()


def test_a_save_killed_midway_leaves_the_previous_checkpoint_restorable(devices, tmp_path):
    directory, marker = tmp_path / "ckpt", tmp_path / "marker"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    script = TESTS / "scripts" / "interrupted_save.py"
    proc = subprocess.Popen([sys.executable, str(script), str(directory), str(marker)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), proc.communicate()[0].decode()[-3000:] if proc.poll() is not None else "timeout"  # fmt: skip
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    partial = [p for p in directory.iterdir() if p.name.startswith("2.")]
    assert partial and any(partial[0].rglob("c.*")), "killed before writing a chunk"

    layout = shardings(devices)
    assert checkpoint.latest_step(directory) == 1
    _assert_bitwise(checkpoint.restore(directory, params=layout).params, values(1))
    with pytest.raises(CheckpointError, match=r"no complete checkpoint for step 2 .*\[1\]"):
        checkpoint.restore(directory, 2, params=layout)
    with Checkpointer(directory) as ckpt:  # a writer removes what the killed save left
        ckpt.save(2, place(values(2), layout))
    assert sorted(p.name for p in directory.iterdir()) == ["1", "2"]
    _assert_bitwise(checkpoint.restore(directory, params=layout).params, values(2))


def test_close_returns_after_what_killed_saves_left_is_removed(devices, tmp_path, monkeypatch):
    """Orbax removes a killed save's temporary folder in a background thread started with
    the writer; ``close`` waits for it (orbax's own ``close`` does not), so a job that
    copies the directory next never meets a half-removed folder. The removal is slowed
    here so that a ``close`` that did not wait would return while the folder is there."""
    from orbax.checkpoint._src.path import temporary_paths

    directory = tmp_path / "ckpt"
    with Checkpointer(directory) as ckpt:
        ckpt.save(1, place(values(1), shardings(devices)))
    leftover = directory / f"2{temporary_paths.TMP_DIR_SUFFIX}"
    (leftover / "params").mkdir(parents=True)
    original = temporary_paths.cleanup_temporary_paths

    async def slow(*args, **kwargs):
        import asyncio

        await asyncio.sleep(1.0)
        await original(*args, **kwargs)

    monkeypatch.setattr(temporary_paths, "cleanup_temporary_paths", slow)
    Checkpointer(directory).close()
    assert sorted(p.name for p in directory.iterdir() if p.name != writer_lock.NAME) == ["1"]


def test_delete_removes_one_committed_step_and_nothing_else(devices, tmp_path):
    directory, layout = tmp_path / "ckpt", shardings(devices)
    directory.mkdir()
    (directory / "notes.txt").write_text("the user's")
    with Checkpointer(directory, max_to_keep=None) as ckpt:
        for step in (1, 2):
            ckpt.save(step, place(values(step), layout))
        ckpt.delete(1)  # waits for step 2's save first
        assert ckpt.all_steps() == [2]
        with pytest.raises(CheckpointError, match=r"no committed step 5 .*\[2\]"):
            ckpt.delete(5)
    assert sorted(p.name for p in directory.iterdir() if not p.name.startswith(".")) == ["2", "notes.txt"]
    with Checkpointer(directory, read_only=True) as reader, pytest.raises(ValueError, match="read-only"):
        reader.delete(2)


def test_folders_that_only_look_like_steps_are_never_deleted(devices, tmp_path):
    """The user's folders named with digits in the checkpoint directory (``7``, ``0042``) are
    no steps: a writer refuses the directory, naming them (orbax counted them as steps, and
    its ``max_to_keep`` deleted ``7`` with the user's files in it), and a reader lists only
    the real steps. A step folder a killed save left behind still counts as the writer's."""
    directory = tmp_path / "ckpt"
    layout = shardings(devices)
    with Checkpointer(directory) as ckpt:
        ckpt.save(1, place(values(1), layout))
    for name in ("7", "0042"):
        (directory / name).mkdir()
        (directory / name / "data.csv").write_text("the user's")
    with pytest.raises(ValueError, match=r"not checkpoints: 0042, 7\..*Remedy: move them out"):
        Checkpointer(directory, max_to_keep=1)
    assert (directory / "7" / "data.csv").read_text() == (directory / "0042" / "data.csv").read_text() == "the user's"
    # a reader says what it skips: an empty "3/" made restore() fall back to step 1 silently
    with pytest.warns(UserWarning, match=r"ignoring folders named like steps that hold no checkpoint: 0042, 7"):
        with Checkpointer(directory, read_only=True) as reader:
            assert reader.all_steps() == [1] and reader.latest_step() == 1
    with pytest.warns(UserWarning, match="ignoring folders"):
        _assert_bitwise(checkpoint.restore(directory, params=layout).params, values(1))
    shutil.rmtree(directory / "7")
    shutil.rmtree(directory / "0042")
    (directory / "5" / "params").mkdir(parents=True)  # what a killed save can leave: the writer's own
    Checkpointer(directory, max_to_keep=1).close()
    file = tmp_path / "a_file"
    file.write_text("")
    with pytest.raises(NotADirectoryError, match="is a file. Remedy"):
        Checkpointer(file)


# --- damaged checkpoints -------------------------------------------------------------


def _chunk(step_dir: Path) -> Path:
    return sorted(step_dir.glob("params/w/c.*"))[0]


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])


DAMAGE = {
    "flipped bit in a chunk": lambda d: _flip_byte(_chunk(d)),
    "truncated chunk": lambda d: _truncate(_chunk(d)),
    "deleted chunk": lambda d: _chunk(d).unlink(),
    "truncated zarr.json": lambda d: _truncate(d / "params" / "b.v" / "zarr.json"),
    "truncated tree metadata": lambda d: _truncate(d / "params" / "_METADATA"),
    "corrupted meta": lambda d: (d / "meta" / "metadata").write_text("{not json"),
    "deleted array": lambda d: shutil.rmtree(d / "params" / "n"),
}


@pytest.fixture(scope="module")
def two_steps(devices, tmp_path_factory):
    directory = tmp_path_factory.mktemp("two_steps")
    with Checkpointer(directory) as ckpt:
        for step in (1, 2):
            ckpt.save(step, place(values(step), shardings(devices)))
    return directory


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_checkpoint_raises_a_clear_error_and_the_previous_restores(devices, two_steps, tmp_path, damage):  # fmt: skip
    directory = tmp_path / "ckpt"
    shutil.copytree(two_steps, directory)
    DAMAGE[damage](directory / "2")
    layout = shardings(devices, axes=("data", "z", "x"), shape=(4, 2, 1))  # another layout
    with pytest.raises(CheckpointError, match=r"step 2 is damaged or incomplete: .* Remedy: restore an earlier step \(restore\(step=1\)"):  # fmt: skip
        checkpoint.restore(directory, params=layout)
    _assert_bitwise(checkpoint.restore(directory, 1, params=layout).params, values(1))


def test_restore_never_unpickles(devices, two_steps, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("restore tried to unpickle")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(np, "load", refuse)
    restored = checkpoint.restore(two_steps, params=shardings(devices))
    _assert_bitwise(restored.params, values(2))
    for file in (two_steps / "2").rglob("*"):  # metadata files are JSON
        if file.is_file() and file.name in ("_METADATA", "zarr.json", "metadata", "_CHECKPOINT_METADATA"):
            json.loads(file.read_text())


# --- leaves of every kind; input errors -----------------------------------------------


def test_dtypes_keys_host_values_and_elsewhere_leaves_round_trip(devices, tmp_path):
    layout = shardings(devices)
    tree = {
        "bf16": jax.device_put(jnp.arange(32, dtype=jnp.bfloat16).reshape(4, 8), layout["w"]),
        "key": jax.random.split(jax.random.key(1), 4),
        "host": np.arange(6, dtype=np.int16).reshape(2, 3),
        "scalar": 3.5,
        "empty": None,  # None on every process: saved empty, restored as None
    }
    with Checkpointer(tmp_path, asynchronous=False) as ckpt:
        ckpt.save(0, tree)
        target = {"bf16": layout["w"], "key": None, "host": np.zeros((2, 3), np.int16),
                  "scalar": jax.ShapeDtypeStruct((), jnp.float32, sharding=layout["n"]),
                  "empty": None}  # fmt: skip
        restored = ckpt.restore(params=target).params
        key_target = jax.sharding.SingleDeviceSharding(devices[0])
        keys = ckpt.restore(params=dict(target, key=key_target)).params["key"]
        same = ckpt.restore(params=dict(target, key=tree["key"])).params["key"]  # checked target
        with pytest.raises(ValueError, match="'params/empty' was saved empty"):
            ckpt.restore(params=dict(target, empty=layout["n"]))
    assert restored["key"] is None and restored["empty"] is None  # None targets: not read
    assert restored["bf16"].dtype == jnp.bfloat16 and restored["bf16"].sharding == layout["w"]
    np.testing.assert_array_equal(np.asarray(restored["bf16"]), np.asarray(tree["bf16"]))
    assert isinstance(restored["host"], np.ndarray)
    np.testing.assert_array_equal(restored["host"], tree["host"])
    assert float(restored["scalar"]) == 3.5
    for restored_keys in (keys, same):
        np.testing.assert_array_equal(jax.random.key_data(restored_keys), jax.random.key_data(tree["key"]))  # fmt: skip


def test_bad_inputs_are_refused_with_remedies(devices, tmp_path):
    layout = shardings(devices)
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(TypeError, match="extra must be JSON-serialisable"):
        ckpt.save(0, place(values(0), layout), extra={"x": object()})
    with pytest.raises(TypeError, match="'params/s' is a str, not an array"):
        ckpt.save(0, {"s": "text"})
    with pytest.raises(ValueError, match="non-negative int"):
        ckpt.save(-1, place(values(0), layout))
    with pytest.raises(TypeError, match=r"step must be a non-negative int, got '0' \(str\)"):
        ckpt.save("0", place(values(0), layout))
    with pytest.raises(CheckpointError, match="no checkpoints in"):
        ckpt.restore(params=layout)
    ckpt.save(0, place(values(0), layout))
    three = jax.sharding.Mesh(np.asarray(devices[:3]), ("a",))
    odd = dict(layout, b={"v": jax.sharding.NamedSharding(three, jax.sharding.PartitionSpec("a"))})
    with pytest.raises(ValueError, match=r"target sharding of 'params/b/v' cannot lay out its saved shape \[8\]"):  # fmt: skip
        ckpt.restore(params=odd)
    ckpt.close()
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.latest_step(tmp_path / "nowhere")


@pytest.mark.parametrize("keep", [0, -1, 1.5, True])
def test_max_to_keep_that_would_delete_every_step_is_refused(keep, tmp_path):
    with pytest.raises(ValueError, match=r"max_to_keep must be a positive number of steps or None"):
        Checkpointer(tmp_path, max_to_keep=keep)
    assert not any(tmp_path.iterdir())


def test_a_step_without_optimizer_state_says_so(devices, two_steps, tmp_path):
    """Asking a step saved without optimizer state (or whose opt_state folder is gone) for
    one named every leaf as "missing from the checkpoint" and told the user to restore with
    the model and optimizer it was saved with, which they were."""
    layout = shardings(devices)
    with pytest.raises(ValueError, match=r"step 2 holds no opt_state \(saved without it, or its opt_state folder "
                                         r"is missing\)\. Remedy: restore without an opt_state target and start "
                                         r"the optimizer afresh"):
        checkpoint.restore(two_steps, params=layout, optimizer=optax.adam(1e-3))
