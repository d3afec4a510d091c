"""Published HuggingFace Flax models, unmodified, in small configs (no download).

Each builder returns a :class:`Zoo` entry: the linen module exactly as
``transformers`` ships it, example inputs (batch 8, so ``data·z`` up to 8
splits it) and a scalar loss of the model's outputs. Sizes follow issue 15's
"small configs": vocabulary ≥ 256, hidden ≥ 64, 2 layers, 4 heads.

Used by ``benchmarks/redundancy.py`` and ``tests/test_redundancy.py``.

Example:
    >>> entry = build("hf_gpt2")                               # doctest: +SKIP
    >>> pm = axonn_jax.partition(entry.model, Grid(x=2), *entry.args)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

BATCH, SEQ, VOCAB, HIDDEN, HEADS, FFN = 8, 16, 256, 64, 4, 256

#: the families this module builds, in the order reports list them
FAMILIES = ("hf_gpt2", "hf_bert", "hf_llama", "hf_opt", "hf_t5", "hf_whisper", "hf_wav2vec2",
            "hf_vit")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Zoo:
    model: object
    args: tuple
    loss: Callable  # loss(outputs, *args) -> scalar
    #: keyword arguments of the call: with dropout, ``deterministic=False`` and ``rngs``
    kwargs: dict = dataclasses.field(default_factory=dict)


#: the dropout key of :func:`build` entries with dropout on
DROPOUT_KEY = jax.random.key(42)


def _dropout_config(name: str, rate: float) -> dict:
    """Each family's dropout probabilities, all set to ``rate`` (Wav2Vec2's layer drop off:
    it draws from Python's RNG while tracing, so no two traces are the same model)."""
    keys = {
        "hf_gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
        "hf_bert": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
        "hf_llama": ("attention_dropout",),
        "hf_opt": ("dropout", "attention_dropout"),
        "hf_t5": ("dropout_rate",),
        "hf_whisper": ("dropout", "attention_dropout", "activation_dropout"),
        "hf_wav2vec2": ("hidden_dropout", "activation_dropout", "attention_dropout",
                        "feat_proj_dropout", "final_dropout"),
        "hf_vit": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    }[name]  # fmt: skip
    extra = {"layerdrop": 0.0} if name == "hf_wav2vec2" else {}
    return {**{k: rate for k in keys}, **extra}


def token_loss(logits, labels):
    """Mean softmax cross-entropy of ``logits [..., V]`` against integer ``labels [...]``."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()


def logits_of(out):
    """The logits of a model output (a ``ModelOutput``, or a tuple when ``return_dict`` is off)."""
    return out.logits if hasattr(out, "logits") else out[0]


def _tokens(seed: int, shape=(BATCH, SEQ), vocab: int = VOCAB):
    return np.random.default_rng(seed).integers(0, vocab, size=shape).astype(np.int32)


def _mask(shape=(BATCH, SEQ)):
    mask = np.ones(shape, np.int32)
    mask[::2, -3:] = 0  # every other sequence ends in padding
    return mask


def _positions(shape=(BATCH, SEQ)):
    return np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape).copy()


def patch_t5_clip() -> None:
    """transformers 4.57's T5 calls ``jnp.clip(x, a_max=)``, which JAX 0.10 removed.

    Rebinds ``jnp`` inside the T5 module only (this process only) to a
    namespace whose ``clip`` accepts ``a_min``/``a_max``.
    """
    import types

    from transformers.models.t5 import modeling_flax_t5 as t5

    if getattr(t5.jnp, "_axonn_patched", False):
        return

    def clip(x, min=None, max=None, *, a_min=None, a_max=None):  # noqa: A002
        return jnp.clip(x, a_min if a_min is not None else min, a_max if a_max is not None else max)

    patched = types.SimpleNamespace(**{k: getattr(jnp, k) for k in dir(jnp) if not k.startswith("__")})
    patched.clip, patched._axonn_patched = clip, True
    t5.jnp = patched


def build(name: str, *, dropout: float = 0.0) -> Zoo:
    """The model, inputs and loss of family ``name`` (one of :data:`FAMILIES`).

    ``dropout > 0``: every dropout probability of the config set to it, and the
    entry called in train mode (``kwargs``: ``deterministic=False`` and
    ``rngs={"dropout": DROPOUT_KEY}``).
    """
    entry = _build(name, _dropout_config(name, dropout) if dropout else {})
    if dropout:
        entry = dataclasses.replace(entry, kwargs=dict(deterministic=False,
                                                       rngs={"dropout": DROPOUT_KEY}))  # fmt: skip
    return entry


def _build(name: str, drop: dict) -> Zoo:
    import transformers as hf

    tokens, mask, positions = _tokens(0), _mask(), _positions()
    lm = lambda out, ids, *_: token_loss(logits_of(out)[:, :-1], ids[:, 1:])  # noqa: E731
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                  num_attention_heads=HEADS, intermediate_size=FFN)  # fmt: skip
    if name == "hf_gpt2":
        from transformers.models.gpt2 import modeling_flax_gpt2 as m

        config = hf.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=2,
                               n_head=HEADS, **drop)  # fmt: skip
        return Zoo(m.FlaxGPT2LMHeadModule(config), (tokens, mask, positions), lm)
    if name == "hf_bert":
        from transformers.models.bert import modeling_flax_bert as m

        config = hf.BertConfig(max_position_embeddings=SEQ, **common, **drop)
        types = (np.arange(SEQ) >= SEQ // 2).astype(np.int32)[None].repeat(BATCH, 0)
        labels = _tokens(1)
        return Zoo(m.FlaxBertForMaskedLMModule(config), (tokens, mask, types, positions, None),
                   lambda out, *_: token_loss(logits_of(out), labels))  # fmt: skip
    if name == "hf_llama":
        from transformers.models.llama import modeling_flax_llama as m

        # its sin/cos table keeps only max_position_embeddings columns: ≥ 2·head_dim
        config = hf.LlamaConfig(num_key_value_heads=2, max_position_embeddings=HIDDEN, **common, **drop)
        return Zoo(m.FlaxLlamaForCausalLMModule(config), (tokens, mask, positions), lm)
    if name == "hf_opt":
        from transformers.models.opt import modeling_flax_opt as m

        config = hf.OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                              num_attention_heads=HEADS, ffn_dim=FFN, word_embed_proj_dim=HIDDEN,
                              max_position_embeddings=SEQ, **drop)  # fmt: skip
        return Zoo(m.FlaxOPTForCausalLMModule(config), (tokens, mask, positions), lm)
    if name == "hf_t5":
        from transformers.models.t5 import modeling_flax_t5 as m

        patch_t5_clip()
        config = hf.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN,
                             num_layers=2, num_heads=HEADS, relative_attention_num_buckets=8,
                             **drop)  # fmt: skip
        decoder = _tokens(2)
        return Zoo(m.FlaxT5ForConditionalGenerationModule(config), (tokens, mask, decoder, mask),
                   lambda out, *_: token_loss(logits_of(out)[:, :-1], decoder[:, 1:]))  # fmt: skip
    if name == "hf_whisper":
        from transformers.models.whisper import modeling_flax_whisper as m

        config = hf.WhisperConfig(vocab_size=VOCAB, num_mel_bins=16, d_model=HIDDEN,
                                  encoder_layers=2, decoder_layers=2, encoder_attention_heads=HEADS,
                                  decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
                                  decoder_ffn_dim=FFN, max_source_positions=SEQ,
                                  max_target_positions=SEQ, **drop)  # fmt: skip
        features = np.random.default_rng(3).standard_normal((BATCH, 16, 2 * SEQ)).astype(np.float32)
        return Zoo(m.FlaxWhisperForConditionalGenerationModule(config),
                   (features, tokens, mask, positions), lambda out, f, ids, *_: lm(out, ids))  # fmt: skip
    if name == "hf_wav2vec2":
        from transformers.models.wav2vec2 import modeling_flax_wav2vec2 as m

        config = hf.Wav2Vec2Config(conv_dim=(64, 64), conv_kernel=(10, 3),
                                   conv_stride=(5, 2), num_conv_pos_embeddings=16,
                                   num_conv_pos_embedding_groups=4, do_stable_layer_norm=True,
                                   feat_extract_norm="layer", **common, **drop)  # fmt: skip
        audio = np.random.default_rng(4).standard_normal((BATCH, 400)).astype(np.float32)
        frames = 39  # (400 - 10) // 5 + 1 = 79, then (79 - 3) // 2 + 1 = 39
        labels = _tokens(5, (BATCH, frames))
        return Zoo(m.FlaxWav2Vec2ForCTCModule(config), (audio,),
                   lambda out, *_: token_loss(logits_of(out), labels))  # fmt: skip
    if name == "hf_vit":
        from transformers.models.vit import modeling_flax_vit as m

        config = hf.ViTConfig(image_size=32, patch_size=8, num_channels=3, num_labels=10, **common,
                              **drop)  # fmt: skip
        images = np.random.default_rng(6).standard_normal((BATCH, 32, 32, 3)).astype(np.float32)
        labels = np.random.default_rng(7).integers(0, 10, size=BATCH).astype(np.int32)
        return Zoo(m.FlaxViTForImageClassificationModule(config), (images,),
                   lambda out, *_: token_loss(logits_of(out), labels))  # fmt: skip
    raise KeyError(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
