"""HuggingFace weights in and out (``axonn_jax.hf``): save_pretrained → pm → train → save_pretrained.

Nothing is downloaded: each test saves a randomly initialised small model with
``save_pretrained`` first. The round trips are checked against ``transformers``
itself (``FlaxXxx.from_pretrained`` of the exported directory) and against the
saved weights, bitwise where no arithmetic happens (loading, exporting).
"""

import re
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

transformers = pytest.importorskip("transformers")

from forward_cases import ATOL, RTOL  # noqa: E402
from hf_cases import (SEQ, VOCAB, assert_bf16_of_masters, assert_same, by_path, gpt2_batch,  # noqa: E402
                      lm_loss, save_gpt2, saved)

import axonn_jax  # noqa: E402
from axonn_jax import Grid, hf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import hf_zoo  # noqa: E402


def _readme_steps(pm, params, batch, steps: int):
    """The README's own jitted AdamW step (pm.apply inside jax.value_and_grad), ``steps`` times."""
    optimizer = optax.adamw(1e-2)
    opt_state = pm.init_optimizer(optimizer, params)

    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: lm_loss(pm.apply(p, *batch), batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    for _ in range(steps):
        params, opt_state, _ = train_step(params, opt_state, batch)
    return params, opt_state


def test_gpt2_round_trip(tmp_path, devices):
    """save_pretrained → pm on x=2,z=2 (data=2: 8 devices) → 3 README steps → export → from_pretrained."""
    source = save_gpt2(tmp_path / "gpt2")
    model = hf.module(source)
    assert type(model).__name__ == "FlaxGPT2LMHeadModule"
    batch = gpt2_batch()
    pm = axonn_jax.partition(model, Grid(x=2, z=2, data=2), *batch)
    params = hf.load(pm, source)
    assert_same(by_path(pm.gather(params)), saved(source))  # loading moves values, changes none
    params, opt_state = _readme_steps(pm, params, batch, steps=3)

    hf.save_pretrained(pm, tmp_path / "tuned", params, opt_state)
    assert_same(saved(tmp_path / "tuned"), by_path(pm.gather(params)))
    reloaded = transformers.FlaxGPT2LMHeadModel.from_pretrained(tmp_path / "tuned")
    want = np.asarray(pm.apply(params, *batch).logits)
    got = np.asarray(reloaded(*batch).logits)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    before = np.asarray(transformers.FlaxGPT2LMHeadModel.from_pretrained(source)(*batch).logits)
    assert np.abs(before - want).max() > 1e-2  # the 3 steps changed the model: the check can fail


def test_bf16_export_writes_the_fp32_masters(tmp_path, devices):
    """precision='bf16' keeps bf16 on the device; the export holds the fp32 masters of opt_state.

    Here offloaded to host memory; the pipeline test below has them on the device.
    """
    source = save_gpt2(tmp_path / "gpt2")
    batch = gpt2_batch()
    pm = axonn_jax.partition(hf.module(source), Grid(x=2, y=2, z=2), *batch)
    step = pm.train_step(lm_loss, optax.adamw(1e-2), precision="bf16", offload=True)
    params, opt_state = step.init(hf.load(pm, source))
    for _ in range(2):
        params, opt_state, _ = step(params, opt_state, batch)

    with pytest.raises(ValueError, match=r"parameter '.*' is bfloat16 on the device.*opt_state"):
        hf.save_pretrained(pm, tmp_path / "lossy", params)
    hf.save_pretrained(pm, tmp_path / "tuned", params, opt_state)
    written = saved(tmp_path / "tuned")
    masters = by_path(opt_state.optimizer.master)
    assert_same(written, masters)
    assert_bf16_of_masters(written, by_path(pm.gather(params)), saved(source))


@pytest.mark.parametrize("virtual", [1, 2])
def test_pipeline_export_has_every_stage(tmp_path, devices, virtual):
    """pipeline=2 in one process: masters live as {stage: ...}; the export holds every stage's
    (virtual=2: four stages, two per rank)."""
    source = save_gpt2(tmp_path / "gpt2")
    batch = gpt2_batch()
    pm = axonn_jax.partition(hf.module(source), Grid(pipeline=2, virtual=virtual, x=2, z=2), *batch)
    params = hf.load(pm, source)
    assert_same(by_path(pm.gather(params)), saved(source))
    step = pm.train_step(lm_loss, optax.adamw(1e-2), precision="bf16")
    params, opt_state = step.init(params)
    params, opt_state, _ = step(params, opt_state, batch)
    stages = list(range(2 * virtual))
    assert sorted(opt_state.optimizer) == stages
    with pytest.raises(ValueError, match=r"holds the stages \[0\].*stages " + re.escape(str(stages))):
        pm.gather(params, {0: opt_state.optimizer[0]})

    hf.save_pretrained(pm, tmp_path / "tuned", params, opt_state)
    written = saved(tmp_path / "tuned")
    first, last = (set(stage.params) for stage in (pm.plan.stages[0], pm.plan.stages[-1]))
    assert first - last and last - first and set(written) >= first | last
    assert_same(written, by_path(pm.gather(params, opt_state)))
    assert_bf16_of_masters(written, by_path(pm.gather(params)), saved(source))


@pytest.mark.mpi
def test_pipeline_across_two_processes(tmp_path):
    """mpiexec -n 2, one stage per process: each loads its stage's shards; rank 0 writes both stages."""
    from mpi_util import run_mpi

    result = run_mpi(2, "hf_pipeline.py", str(tmp_path), devices_per_process=4, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("OK rank") == 2, result.stdout


# other families from benchmarks/hf_zoo.py, each on a grid of its own: a decoder with RMSNorm,
# rotary embeddings and grouped-query attention, and an encoder-decoder with relative attention
# (any family of hf_zoo.FAMILIES fits here: BERT on x=2,y=2,z=2 and ViT on y=2,z=2,data=2 pass too)
FAMILIES = [("hf_llama", "z=4,data=2"), ("hf_t5", "x=2,y=2,data=2")]


@pytest.mark.slow
@pytest.mark.parametrize("name,grid", FAMILIES)
def test_family_round_trip(tmp_path, devices, name, grid):
    """save_pretrained → load on the grid → change in the layout → export → from_pretrained: same outputs."""
    entry = hf_zoo.build(name)
    cls = hf.model_class_of(entry.model)
    cls(entry.model.config, seed=0).save_pretrained(tmp_path / "saved")
    pm = axonn_jax.partition(hf.module(tmp_path / "saved"), Grid.parse(grid), *entry.args)
    params = hf.load(pm, tmp_path / "saved")
    assert_same(by_path(pm.gather(params)), saved(tmp_path / "saved", cls))
    # a different value in every leaf, computed shard by shard in the layout
    params = jax.jit(lambda p: jax.tree.map(lambda w: w * 1.5 + 0.01, p))(params)

    hf.save_pretrained(pm, tmp_path / "changed", params)
    reloaded = cls.from_pretrained(tmp_path / "changed")
    assert_same(by_path(reloaded.params), by_path(pm.gather(params)))
    want = hf_zoo.logits_of(pm.apply(params, *entry.args))
    got = hf_zoo.logits_of(reloaded.module.apply({"params": reloaded.params}, *entry.args))
    # the same weights (bitwise, above); the outputs within the forward bounds of every model
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=RTOL, atol=ATOL)


def test_bad_inputs_are_named(tmp_path, devices, monkeypatch):
    """Another config's weights, a module that is not from transformers, a config without a class."""
    source = save_gpt2(tmp_path / "gpt2")
    batch = gpt2_batch()
    bigger = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=3, n_head=4)
    pm = axonn_jax.partition(transformers.FlaxGPT2LMHeadModel(bigger, _do_init=False).module,
                             Grid(z=8), *batch)  # fmt: skip
    with pytest.raises(ValueError, match=r"Grid\(.*z=8.*missing transformer/h/2/attn/c_attn/bias"):
        hf.load(pm, source)
    wider = transformers.GPT2Config(vocab_size=2 * VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4)
    pm = axonn_jax.partition(transformers.FlaxGPT2LMHeadModel(wider, _do_init=False).module,
                             Grid(z=8), *batch)  # fmt: skip
    with pytest.raises(ValueError, match=r"'transformer/wte/embedding' \(64, 32\) in the files, "
                                         r"\(128, 32\) planned"):  # fmt: skip
        hf.load(pm, source)

    from axonn_jax.models import GPT, GPTConfig

    ours = GPT(GPTConfig(vocab_size=VOCAB, num_layers=1, hidden=32, num_heads=2, max_seq_len=SEQ))
    with pytest.raises(TypeError, match="not the module of a transformers Flax model.*model_class"):
        hf.model_class_of(ours)

    config = transformers.GPT2Config.from_pretrained(source)
    config.architectures = ["NoSuchModel"]
    config.save_pretrained(source)
    with pytest.raises(ValueError, match="no Flax class FlaxNoSuchModel.*model_class="):
        hf.module(source)
    assert type(hf.module(source, transformers.FlaxGPT2LMHeadModel)).__name__ == "FlaxGPT2LMHeadModule"

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'axonn_jax\[hf\]'"):
        hf.module(source)
