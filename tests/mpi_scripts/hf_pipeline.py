"""Under mpiexec -n 2 (4 devices each): HF GPT-2 weights in and out of Grid(pipeline=2, x=2, z=2).

Usage: mpiexec -n 2 python hf_pipeline.py DIRECTORY

Stage s lives on process s. ``hf.load`` leaves each process only its stage's
parameters; after a bf16 step, ``hf.save_pretrained`` gathers the fp32 masters
of both stages and rank 0 writes them; every rank then reads the directory
back with ``FlaxGPT2LMHeadModel.from_pretrained`` and compares. Prints "OK rank R".
"""

import sys
from pathlib import Path

import axonn_jax

info = axonn_jax.init()
import jax  # noqa: E402
import optax  # noqa: E402
from hf_cases import (assert_bf16_of_masters, assert_same, by_path, gpt2_batch, lm_loss,  # noqa: E402
                      save_gpt2, saved)

from axonn_jax import Grid, hf  # noqa: E402

assert info.distributed and jax.process_count() == 2, "expected mpiexec -n 2"
rank, directory = info.process_index, Path(sys.argv[1])
source = save_gpt2(directory / f"gpt2-rank{rank}")  # the same seed: the same weights on both ranks
batch = gpt2_batch()
pm = axonn_jax.partition(hf.module(source), Grid(pipeline=2, x=2, z=2), *batch)
assert pm.local_stages == [rank]

params = hf.load(pm, source)
held = set(by_path(jax.tree.map(lambda a: 0, params)))  # None leaves (the other stage) drop out
assert held == set(pm.plan.stages[rank].params), ("each process holds its stage's", sorted(held))
assert_same(by_path(pm.gather(params)), saved(source))

step = pm.train_step(lm_loss, optax.adamw(1e-2), precision="bf16")
params, opt_state = step.init(params)
params, opt_state, _ = step(params, opt_state, batch)
hf.save_pretrained(pm, directory / "tuned", params, opt_state)  # returns once rank 0 has written
written = saved(directory / "tuned")
assert set(written) >= set(pm.plan.stages[0].params) | set(pm.plan.stages[1].params)
assert_same(written, by_path(pm.gather(params, opt_state)))
assert_bf16_of_masters(written, by_path(pm.gather(params)), saved(source))
print(f"OK rank {rank} hf export {pm.grid}", flush=True)
