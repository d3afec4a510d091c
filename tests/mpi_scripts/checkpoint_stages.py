"""Under mpiexec -n 2 (4 devices each): pipeline-stage checkpoints, restored onto other grids.

Usage: mpiexec -n 2 python checkpoint_stages.py DIRECTORY EXPECTED.npz

Stage s of Grid(pipeline=2, x=2, z=2) lives on process s only, so each process
holds only its stage's parameters (the others are None) and writes only its own
shards. The checkpoint is then restored onto grids spanning both processes
(z=4·data=2 and data=8) and back onto the stage layout; every rank compares
bitwise with the parameters both processes can compute on the host. Optimizer
states are saved both as one tree (None where the other process holds the leaf)
and as ``{stage: state}`` with each process passing only its own stage. Rank 0
prints one "OK ..." line per check. The pipeline runtime's own layout (pm.init,
TrainStep.init with pipeline=2) and the loader are checked too. Rank 0 writes the
values of step 1 to EXPECTED.npz (``{"item/path": array}``) for the test to compare
with what plain orbax reads.
"""

import sys

import axonn_jax
from axonn_jax.runtime.mesh import stage_meshes
from axonn_jax import Grid

info = axonn_jax.init()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from checkpoint_cases import host_leaves  # noqa: E402

from axonn_jax.checkpoint import Checkpointer  # noqa: E402
from axonn_jax.corpus import batch_at  # noqa: E402
from axonn_jax.loader import Loader  # noqa: E402
from axonn_jax.models import GPT, GPTConfig  # noqa: E402

assert info.distributed and jax.process_count() == 2, "expected mpiexec -n 2"
rank, directory, expected_file = info.process_index, sys.argv[1], sys.argv[2]


def ok(what: str) -> None:
    if info.is_main:
        print(f"OK {what}", flush=True)


model = GPT(GPTConfig(vocab_size=64, num_layers=2, hidden=32, num_heads=2, max_seq_len=16))
tokens = jnp.zeros((8, 16), jnp.int32)
full = jax.tree.map(np.asarray, model.init(jax.random.key(0), tokens)["params"])
optimizer = optax.adamw(1e-3)
stage_layout = axonn_jax.partition(model, Grid(x=2, z=2), tokens).plan  # one stage's layout
meshes = stage_meshes(Grid(pipeline=2, x=2, z=2))
assert [{d.process_index for d in m.devices.flat} for m in meshes] == [{0}, {1}]


def stage_of(path: str) -> int:
    return 1 if path.startswith(("block_1", "norm_final")) else 0


def stage_shardings():
    """This process's stage: NamedShardings; the other stage: None."""
    return jax.tree.unflatten(stage_layout.param_tree, [
        NamedSharding(meshes[rank], p.spec) if stage_of(p.path) == rank else None
        for p in stage_layout.params
    ])  # fmt: skip


def place(values, shardings):
    return jax.tree.map(
        lambda v, s: None if s is None else jax.make_array_from_callback(v.shape, s, lambda i: v[i]),
        values, shardings, is_leaf=lambda x: x is None,
    )  # fmt: skip


def full_value(array) -> np.ndarray:
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


# --- save from the stage layout: each process holds and writes only its stage ----
local = place(full, stage_shardings())
held = [x is not None for x in jax.tree.leaves(local, is_leaf=lambda x: x is None)]
assert any(held) and not all(held), "each process must hold part of the model"
state = optimizer.init(local)
adam = state[0]._replace(
    count=jnp.array(7, jnp.int32),
    mu=jax.tree.map(lambda p: p * 0.5, local),
    nu=jax.tree.map(lambda p: p * p, local),
)
state = (adam,) + tuple(state[1:])
ckpt = Checkpointer(directory, max_to_keep=3)
ckpt.save(1, local, state, extra={"note": "stages"}, rng=jax.random.key(5))
ckpt.wait()
assert ckpt.all_steps() == [1], ckpt.all_steps()
if info.is_main:  # what step 1 holds, as full host values
    host_adam = adam._replace(count=np.int32(7), mu=jax.tree.map(lambda p: p * 0.5, full),
                              nu=jax.tree.map(lambda p: p * p, full))  # fmt: skip
    np.savez(expected_file, **host_leaves("params", full),
             **host_leaves("opt_state", (host_adam,) + tuple(state[1:])),
             **host_leaves("rng", {"key": jax.random.key(5)}))  # fmt: skip
ok("save stages")

# --- restore onto grids that span both processes ----------------------------------
for text in ("z=4,data=2", "data=8"):
    pm = axonn_jax.partition(model, Grid.parse(text), tokens)
    restored = ckpt.restore(params=pm.param_shardings, optimizer=optimizer)
    for a, b in zip(jax.tree.leaves(pm.gather(restored.params)), jax.tree.leaves(full)):
        assert a.dtype == b.dtype and np.array_equal(a, b), f"rank {rank}: params differ on {text}"
    adam = restored.opt_state[0]
    assert int(full_value(adam.count)) == 7
    for mu, nu, p in zip(jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu), jax.tree.leaves(full)):
        assert np.array_equal(full_value(mu), p * 0.5) and np.array_equal(full_value(nu), p * p)
    assert restored.extra == {"note": "stages"}
    assert np.array_equal(jax.random.key_data(restored.rng), jax.random.key_data(jax.random.key(5)))
    ok(f"restore {text}")

# --- and back onto the stage layout (None = the other process's stage) ----------
back = ckpt.restore(params=stage_shardings(), optimizer=optimizer)
for got, want in zip(jax.tree.leaves(back.params, is_leaf=lambda x: x is None),
                     jax.tree.leaves(local, is_leaf=lambda x: x is None)):  # fmt: skip
    assert (got is None) == (want is None)
    if got is not None:
        assert got.sharding == want.sharding and np.array_equal(np.asarray(got), np.asarray(want))
ok("restore stages")

# --- optimizer state as {stage: state}, each process only its own stage's -------
per_stage = {rank: state}  # the layout TrainStep uses with a pipeline
ckpt.save(2, local, per_stage)
ckpt.wait()
again = ckpt.restore(2, params=stage_shardings(), opt_state={rank: state})
for got, want in zip(jax.tree.leaves(again.opt_state, is_leaf=lambda x: x is None),
                     jax.tree.leaves(per_stage, is_leaf=lambda x: x is None)):  # fmt: skip
    assert (got is None) == (want is None)
    if got is not None:
        assert got.sharding == want.sharding and np.array_equal(np.asarray(got), np.asarray(want))
assert list(again.opt_state) == [rank]
ok("per-stage optimizer states")

# --- the pipeline runtime's own layout: pm.init and TrainStep.init --------------
pipelined = axonn_jax.partition(model, Grid(pipeline=2, x=2, z=2), tokens)
params = pipelined.init(jax.random.key(1))
params, opt_state = pipelined.train_step(lambda out, batch: 0.0, optimizer).init(params)
ckpt.save(3, params, opt_state)
ckpt.wait()
back = ckpt.restore(3, params=pipelined.param_shardings, opt_state=opt_state)
for got, want in zip(jax.tree.leaves((back.params, back.opt_state), is_leaf=lambda x: x is None),
                     jax.tree.leaves((params, opt_state), is_leaf=lambda x: x is None)):  # fmt: skip
    assert (got is None) == (want is None)
    if got is not None:
        assert got.sharding == want.sharding and np.array_equal(np.asarray(got), np.asarray(want))
flat = axonn_jax.partition(model, Grid(z=4, data=2), tokens)
gathered = flat.gather(ckpt.restore(3, params=flat.param_shardings).params)
for got, want in zip(jax.tree.leaves(gathered), jax.tree.leaves(params, is_leaf=lambda x: x is None)):
    assert want is None or np.array_equal(got, np.asarray(want))  # each rank checks its stage
ok("pipeline layout")

# --- the loader: each process holds exactly its rows ---------------------------
corpus = np.random.default_rng(0).integers(0, 64, size=4_000).astype(np.uint8)
mesh = stage_meshes(Grid(z=4, data=2))[0]
batch = Loader(corpus, batch=16, seq=8, mesh=mesh, seed=3).at(2)
reference = batch_at(corpus, step=2, batch=16, seq=8, seed=3)
assert np.array_equal(full_value(batch), reference)
for shard in batch.addressable_shards:
    assert shard.device.process_index == rank
    assert np.array_equal(np.asarray(shard.data), reference[shard.index])
ok("loader")
ckpt.close()
