"""Models × grids for the partitioner's equivalence tests.

Each case runs the plain single-device computation (``model.apply`` / the nnx
module, optax AdamW) and the same through ``axonn_jax.partition`` inside a
user-style ``jax.jit`` train step, and returns both trajectories.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import flax.linen as nn
from flax import nnx

import axonn_jax
from axonn_jax.partitioner.trace import path_string
from axonn_jax.models import (
    CNN,
    GPT,
    GPTNNX,
    MLP,
    EncDecConfig,
    EncoderDecoder,
    GPTConfig,
    MLPNNX,
    next_token_loss,
)

GRIDS = [
    dict(x=2, y=2, z=2),
    dict(x=4, z=2),
    dict(y=2, z=2, data=2),
    dict(z=8),
    dict(data=8),
]
BATCH, SEQ, VOCAB = 8, 16, 64
LR, STEPS = 1e-2, 5


def _tokens(seed, shape=(BATCH, SEQ)):
    return np.random.default_rng(seed).integers(0, VOCAB, size=shape).astype(np.int32)


def _gpt_config(**kw):
    base = dict(vocab_size=VOCAB, num_layers=2, hidden=32, num_heads=4, max_seq_len=SEQ)
    return GPTConfig(**{**base, **kw})


def _mse(out, target):
    return jnp.mean((out - target) ** 2)


def _ce(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class BatchMixing(nn.Module):
    """Dense → an op that mixes the rows of the batch → Dense.

    Each row's output depends on other rows, so a batch split over data and z that is
    put back together in another order (the executor's relayout of a replicated value)
    changes the result.
    """

    mix: str  # "cumsum", "sort" or "normalise" over the batch dim

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16, name="up")(x)
        if self.mix == "cumsum":
            mixed = jnp.cumsum(h, axis=0) / h.shape[0]
        elif self.mix == "sort":
            mixed = jnp.sort(h, axis=0)
        else:
            mixed = (h - h.mean(axis=0)) / jnp.sqrt(h.var(axis=0) + 1e-5)
        # the mixed rows (whole batch) meet the row-split h: split again, block by block
        return nn.Dense(8, name="down")(nn.tanh(mixed) * h)


@dataclasses.dataclass
class Case:
    model: object
    args: tuple
    loss: object  # loss(outputs, *args) -> scalar


def _padding_mask(shape=(BATCH, SEQ)):
    """1 = real token, 0 = padding: every other sequence ends in 3 pad positions."""
    mask = np.ones(shape, np.int32)
    mask[::2, -3:] = 0
    return mask


def _positions(shape=(BATCH, SEQ)):
    return np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape).copy()


def third_party(name: str, *, layers: int = 2) -> Case:
    """Published models taken unmodified from HuggingFace ``transformers`` (Flax, <5).

    Tiny configs built in code (no download); each module is called positionally
    with the arrays its ``__call__`` takes (``None`` for optional inputs left out).
    """
    import transformers as hf
    from transformers.models.bert import modeling_flax_bert as bert
    from transformers.models.gpt2 import modeling_flax_gpt2 as gpt2
    from transformers.models.llama import modeling_flax_llama as llama

    tokens, mask, positions = _tokens(4), _padding_mask(), _positions()
    if name == "hf_gpt2":
        config = hf.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=layers,
                               n_head=4)  # fmt: skip
        model = gpt2.FlaxGPT2LMHeadModule(config)
        # (input_ids, attention_mask, position_ids); tied input/output embeddings
        return Case(model, (tokens, mask, positions),
                    lambda out, t, m, p: next_token_loss(out.logits, t))  # fmt: skip
    if name == "hf_bert":
        config = hf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers,
                               num_attention_heads=4, intermediate_size=64,
                               max_position_embeddings=SEQ)  # fmt: skip
        model = bert.FlaxBertForMaskedLMModule(config)
        types = (np.arange(SEQ) >= SEQ // 2).astype(np.int32)[None].repeat(BATCH, 0)
        labels = _tokens(5)
        # (input_ids, attention_mask, token_type_ids, position_ids, head_mask)
        return Case(model, (tokens, mask, types, positions, None),
                    lambda out, *_: _ce(out.logits, labels))  # fmt: skip
    if name == "hf_llama":
        config = hf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers,
                                num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=64, max_position_embeddings=SEQ)  # fmt: skip
        model = llama.FlaxLlamaForCausalLMModule(config)
        # (input_ids, attention_mask, position_ids); grouped-query attention, RoPE, SwiGLU
        return Case(model, (tokens, mask, positions),
                    lambda out, t, m, p: next_token_loss(out.logits, t))  # fmt: skip
    raise KeyError(name)


def build(name: str) -> Case:
    rng = np.random.default_rng(1)
    if name == "gpt_linen":
        return Case(GPT(_gpt_config()), (_tokens(0),), lambda out, t: next_token_loss(out, t))
    if name == "gpt_linen_rms_untied":
        model = GPT(_gpt_config(norm="rmsnorm", tie_embeddings=False, use_bias=False))
        return Case(model, (_tokens(0),), lambda out, t: next_token_loss(out, t))
    if name == "gpt_nnx":
        model = GPTNNX(_gpt_config(), rngs=nnx.Rngs(0))
        return Case(model, (_tokens(0),), lambda out, t: next_token_loss(out, t))
    if name == "mlp":
        x = rng.standard_normal((BATCH * 2, 32)).astype(np.float32)
        target = rng.standard_normal((BATCH * 2, 16)).astype(np.float32)
        return Case(MLP(features=(64, 64, 16)), (x,), lambda out, _: _mse(out, target))
    if name == "mlp_nnx":
        x = rng.standard_normal((BATCH * 2, 32)).astype(np.float32)
        target = rng.standard_normal((BATCH * 2, 16)).astype(np.float32)
        model = MLPNNX(32, (64, 64, 16), rngs=nnx.Rngs(0))
        return Case(model, (x,), lambda out, _: _mse(out, target))
    if name == "cnn":
        images = rng.standard_normal((BATCH, 8, 8, 3)).astype(np.float32)
        labels = rng.integers(0, 10, size=BATCH)
        return Case(CNN(channels=(8, 16), num_classes=10), (images,), lambda out, _: _ce(out, labels))
    if name == "encdec":
        config = EncDecConfig(vocab_size=VOCAB, num_encoder_layers=1, num_decoder_layers=1,
                              hidden=32, num_heads=4, max_seq_len=SEQ)  # fmt: skip
        src, tgt = _tokens(2), _tokens(3)
        return Case(EncoderDecoder(config), (src, tgt), lambda out, s, t: next_token_loss(out, t))
    if name in BATCH_MIXING:
        x = rng.standard_normal((BATCH, 12)).astype(np.float32)
        target = rng.standard_normal((BATCH, 8)).astype(np.float32)
        return Case(BatchMixing(name.removeprefix("batch_")), (x,), lambda out, _: _mse(out, target))
    if name in THIRD_PARTY:
        return third_party(name)
    import control_flow_cases  # scan, while and cond models (tests/test_control_flow.py)

    return control_flow_cases.build(name)


#: models whose rows depend on other rows of the batch (run on the grids that split it twice)
BATCH_MIXING = ["batch_cumsum", "batch_sort", "batch_normalise"]
#: every grid of 8 devices whose batch is split over both data and z
DATA_Z_GRIDS = [dict(x=2, z=2, data=2), dict(z=4, data=2), dict(z=2, data=4), dict(y=2, z=2, data=2)]


#: published models nobody here wrote, used exactly as their package ships them
THIRD_PARTY = ["hf_gpt2", "hf_bert", "hf_llama"]
MODELS = ["gpt_linen", "gpt_linen_rms_untied", "gpt_nnx", "mlp", "mlp_nnx", "cnn", "encdec",
          *THIRD_PARTY]  # fmt: skip


def reference_apply(case: Case):
    """(params, apply) of the plain model: linen apply, or nnx merge-and-call."""
    model = case.model
    if isinstance(model, nnx.Module):
        graphdef, state, rest = nnx.split(model, nnx.Param, ...)
        values = nnx.to_pure_dict(state)

        def apply(p, *args):
            fresh = nnx.clone(state)
            nnx.replace_by_pure_dict(fresh, p)
            return nnx.merge(graphdef, fresh, rest)(*args)

        return jax.tree.map(np.asarray, values), apply
    params = model.init(jax.random.key(0), *case.args)["params"]
    return jax.tree.map(np.asarray, params), lambda p, *a: model.apply({"params": p}, *a)


def optimizer_state(optimizer, params, pm=None):
    """``optimizer.init(params)``, or with ``pm`` as ``pm.init_optimizer`` lays it out: then a
    jitted step compiles once (from a plain ``optimizer.init`` it compiles again at step 2)."""
    return optimizer.init(params) if pm is None else pm.init_optimizer(optimizer, params)


def adamw_trajectory(loss_fn, params, steps: int = STEPS, lr: float = LR, pm=None):
    """``steps`` jitted AdamW steps of ``loss_fn``: (losses, step-1 grads, final params).

    Shared with ``pipeline_cases`` (one definition of the plain optax training).
    ``pm``: the state starts as :func:`optimizer_state` lays it out.
    """
    optimizer = optax.adamw(lr)

    @jax.jit
    def step(p, s):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss, grads

    p, state, losses, first_grads = params, optimizer_state(optimizer, params, pm), [], None
    for _ in range(steps):
        p, state, loss, grads = step(p, state)
        losses.append(float(loss))
        first_grads = grads if first_grads is None else first_grads
    return losses, first_grads, p


def _train(case: Case, apply_fn, start_params, pm=None):
    return adamw_trajectory(lambda p: case.loss(apply_fn(p, *case.args), *case.args), start_params, pm=pm)


@functools.cache
def reference_trajectory(name: str):
    """The plain model's (initial params, (losses, step-1 grads, final params)), once per process."""
    case = build(name)
    params, apply = reference_apply(case)
    losses, grads, final = _train(case, apply, params)
    return params, (losses, jax.tree.map(np.asarray, grads), jax.tree.map(np.asarray, final))


def trajectories(name: str, grid: dict, *, train_step: bool = False, **partition_options):
    """Run both ways; returns dict(ref=..., part=...) with losses, grads, final params.

    The partitioned run is a user-style jitted step around ``pm.apply``, or with
    ``train_step`` ``pm.value_and_grad`` (step-1 gradients) and ``pm.train_step``
    (AdamW), which plan the loss with the model (``"notes"``: why not, if not).
    """
    case = build(name)
    params, ref = reference_trajectory(name)
    pm = axonn_jax.partition(case.model, axonn_jax.Grid(**grid), *case.args, **partition_options)
    if not train_step:
        losses, grads, final = _train(case, pm.apply, pm.shard(params), pm)
        return {"pm": pm, "init": params, "ref": ref,
                "part": (losses, pm.gather(grads), pm.gather(final))}  # fmt: skip
    loss_fn, batch = (lambda out, b: case.loss(out, *b)), tuple(case.args)
    value_and_grad = pm.value_and_grad(loss_fn)
    _, grads = jax.jit(value_and_grad)(pm.shard(params), batch)
    step = pm.train_step(loss_fn, optax.adamw(LR))
    p, state = step.init(pm.shard(params))
    losses = []
    for _ in range(STEPS):
        p, state, loss = step(p, state, batch)
        losses.append(float(loss))
    return {"pm": pm, "init": params, "ref": ref, "notes": value_and_grad.loss_notes,
            "part": (losses, pm.gather(grads), pm.gather(p, state))}  # fmt: skip


def _leaves(tree):
    return {path_string(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def assert_matches_reference(result: dict, label: str) -> None:
    """The bounds of ``test_partition.py`` (its docstring): losses, step-1 grads, final params."""
    ref_losses, ref_grads, ref_params = result["ref"]
    losses, grads, params = result["part"]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=f"{label} losses")
    ref_g, got_g = _leaves(ref_grads), _leaves(grads)
    scale = max(np.max(np.abs(g)) for g in ref_g.values())
    for path, ref in ref_g.items():
        err = np.max(np.abs(got_g[path] - ref))
        bound = 1e-5 * np.max(np.abs(ref)) + 1e-6 * scale
        assert err <= bound, f"{label} grad {path}: {err:.3e} > {bound:.3e}"
    failures = adamw_param_failures(_leaves(params), ref_params, ref_grads, result["init"])
    assert not failures, f"{label}: {failures[0]} (after {STEPS} steps)"


def adamw_param_failures(got: dict, ref_final, ref_first_grads, init) -> list[str]:
    """Parameters after ``STEPS`` AdamW steps against the plain run's, for the leaves in ``got``.

    Where the true gradient is 0 (``|g| ≤ 1e-6·max|g|``, elementwise: e.g. the key bias
    of attention, which softmax ignores) both runs see rounding noise that Adam turns
    into steps of up to ``lr``: ``max|Δ| ≤ 2·steps·lr`` there. Elsewhere
    ``‖Δ‖₂ ≤ 1e-3·‖p_ref − p₀‖₂``.
    """
    first, start, final = _leaves(ref_first_grads), _leaves(init), _leaves(ref_final)
    top = max(np.max(np.abs(g)) for g in first.values())
    failures = []
    for path, value in got.items():
        value, ref, noise = np.asarray(value), final[path], np.abs(first[path]) <= 1e-6 * top
        if noise.any():
            err = np.max(np.abs(value - ref)[noise])
            if err > 2 * STEPS * LR:
                failures.append(f"param {path} where its gradient is 0: {err:.3e} > {2 * STEPS * LR:.3e}")
        if not noise.all():
            err = np.linalg.norm((value - ref)[~noise])
            bound = 1e-3 * np.linalg.norm((ref - start[path])[~noise])
            if err > bound:
                failures.append(f"param {path}: {err:.3e} > {bound:.3e}")
    return failures
