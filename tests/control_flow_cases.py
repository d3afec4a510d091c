"""Models written with JAX control flow, the way their communities write them.

Each is a plain Flax model nobody here special-cased: a decoder-only
transformer as a scan over stacked layers (linen ``nn.scan``, and nnx
``nnx.scan`` over an ``nnx.vmap``-made stack), an LSTM and a GRU language
model (``nn.RNN``), a weight-tied refinement loop (``lax.fori_loop``), an
input-normalising ``lax.while_loop``, and branch choices (``nn.cond``,
``nn.switch``). ``build(name)`` returns a :class:`partition_cases.Case`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax

BATCH, SEQ, VOCAB, HIDDEN, HEADS, LAYERS = 8, 16, 64, 32, 4, 4


def _tokens(seed: int = 0, shape=(BATCH, SEQ)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=shape).astype(np.int32)


def next_token_loss(logits, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


# --- linen: nn.scan over stacked transformer blocks -------------------------------------
class Block(nn.Module):
    """Pre-norm decoder block; ``(carry, _) -> (carry, None)`` so that nn.scan can stack it."""

    hidden: int = HIDDEN
    heads: int = HEADS

    @nn.compact
    def __call__(self, x, _):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * self.hidden)(h)
        x = x + nn.Dense(self.hidden)(nn.gelu(h))
        return x, None


class ScanGPT(nn.Module):
    """Embedding, ``layers`` blocks as one ``nn.scan`` (params stacked on axis 0), tied head.

    ``unrolled=True``: the same blocks in a Python loop (its redundancy is the bar).
    """

    layers: int = LAYERS
    remat: bool = False
    unrolled: bool = False

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, HIDDEN)
        pos = self.param("pos", nn.initializers.normal(0.02), (SEQ, HIDDEN))
        x = embed(tokens) + pos[: tokens.shape[1]]
        if self.unrolled:
            for i in range(self.layers):
                x, _ = Block(name=f"block_{i}")(x, None)
        else:
            block = nn.remat(Block) if self.remat else Block
            stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=self.layers)  # fmt: skip
            x, _ = stack(name="blocks")(x, None)
        return embed.attend(nn.LayerNorm()(x))


class DenseStep(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return jnp.tanh(nn.Dense(HIDDEN)(h)), None


class ScanDense(nn.Module):
    """One Dense per scanned layer: consecutive layers alternate normal/transposed, so the
    carry's layout has no fixed point and settles on the common part of the two."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(HIDDEN)(x)
        h, _ = nn.scan(DenseStep, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=3)()(h, None)  # fmt: skip
        return nn.Dense(8)(h)


# --- nnx: nnx.scan over a stack made by nnx.vmap ----------------------------------------
class BlockNNX(nnx.Module):
    def __init__(self, hidden: int, heads: int, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(hidden, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=hidden, decode=False,
                                           rngs=rngs)  # fmt: skip
        self.norm2 = nnx.LayerNorm(hidden, rngs=rngs)
        self.up = nnx.Linear(hidden, 4 * hidden, rngs=rngs)
        self.down = nnx.Linear(4 * hidden, hidden, rngs=rngs)

    def __call__(self, x):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class ScanGPTNNX(nnx.Module):
    """The nnx docs' scan-over-layers: ``nnx.split_rngs`` + ``nnx.vmap`` create, ``nnx.scan`` run."""

    def __init__(self, layers: int = LAYERS, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, HIDDEN, rngs=rngs)
        self.pos = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (SEQ, HIDDEN)))

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_block(rngs: nnx.Rngs):
            return BlockNNX(HIDDEN, HEADS, rngs=rngs)

        self.blocks = create_block(rngs)
        self.norm = nnx.LayerNorm(HIDDEN, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block: BlockNNX):
            return block(x)

        x = forward(x, self.blocks)
        return self.embed.attend(self.norm(x))


# --- recurrent networks ------------------------------------------------------------------
class RecurrentLM(nn.Module):
    """Embedding → ``nn.RNN(cell)`` → Dense over the vocabulary (a character-level LM)."""

    cell: str = "lstm"  # "lstm" (OptimizedLSTMCell), "lstm_plain" (LSTMCell) or "gru"

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, HIDDEN)(tokens)
        cell = {"lstm": nn.OptimizedLSTMCell, "lstm_plain": nn.LSTMCell,
                "gru": nn.GRUCell}[self.cell](HIDDEN)  # fmt: skip
        x = nn.RNN(cell)(x)
        return nn.Dense(VOCAB)(x)


# --- loops and branches ------------------------------------------------------------------
class Refiner(nn.Module):
    """A weight-tied refinement loop: ``steps`` residual updates with one Dense (fori_loop)."""

    steps: int = 3

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(HIDDEN, name="inp")(x)
        step = nn.Dense(HIDDEN, name="step")
        params = step.variables if not self.is_initializing() else None
        if params is None:
            step(h)  # create the shared weights
            params = step.variables
        kernel, bias = params["params"]["kernel"], params["params"]["bias"]

        def body(_, h):
            return h + jnp.tanh(h @ kernel + bias)

        h = lax.fori_loop(0, self.steps, body, h)
        return nn.Dense(8, name="out")(nn.LayerNorm()(h))


class WhileNormalised(nn.Module):
    """Rescales each input row by halving until its largest entry is below 1 (a while loop
    over the data only: reverse-mode autodiff never enters it), then an MLP."""

    @nn.compact
    def __call__(self, x):
        def cond(state):
            y, n = state
            return (jnp.max(jnp.abs(y)) >= 1.0) & (n < 20)

        def body(state):
            y, n = state
            return y * 0.5, n + 1

        x, _ = lax.while_loop(cond, body, (x, jnp.int32(0)))
        h = nn.gelu(nn.Dense(64)(x))
        return nn.Dense(8)(h)


class DecodeWhile(nn.Module):
    """A parameter-carrying while loop (forward only: reverse mode cannot enter a while):
    repeat a Dense update until the running norm exceeds a threshold, at most 4 times."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(HIDDEN, name="inp")(x)
        step = nn.Dense(HIDDEN, name="step")
        step(h)
        kernel, bias = step.variables["params"]["kernel"], step.variables["params"]["bias"]

        def cond(state):
            h, n = state
            return (jnp.mean(h * h) < 4.0) & (n < 4)

        def body(state):
            h, n = state
            return h + jnp.tanh(h @ kernel + bias), n + 1

        h, _ = lax.while_loop(cond, body, (h, jnp.int32(0)))
        return nn.Dense(8, name="out")(h)


class BranchModel(nn.Module):
    """``nn.cond`` on a data-dependent predicate, then ``nn.switch`` on an input index (an
    expert chosen per batch), with the submodules declared in ``setup``."""

    def setup(self):
        self.inp = nn.Dense(HIDDEN)
        self.wide_in = nn.Dense(2 * HIDDEN)
        self.wide_out = nn.Dense(HIDDEN)
        self.narrow = nn.Dense(HIDDEN)
        self.expert_a = nn.Dense(HIDDEN)
        self.expert_b = nn.Dense(HIDDEN)
        self.out = nn.Dense(8)

    def __call__(self, x, index):
        h = self.inp(x)

        def wide(module, h):
            return module.wide_out(nn.relu(module.wide_in(h)))

        def narrow(module, h):
            return module.narrow(h)

        branches = [lambda m, h: jnp.tanh(h), lambda m, h: m.expert_a(h), lambda m, h: m.expert_b(h)]
        if self.is_initializing():  # every branch creates its variables (nn.cond's contract)
            for fn in (wide, narrow, *branches):
                fn(self, h)
        h = nn.cond(jnp.mean(h) > 0, wide, narrow, self, h)
        h = nn.switch(index, branches, self, h)
        return self.out(h)


def _mse(out, target):
    return jnp.mean((out - target) ** 2)


#: scan-over-layers transformers (they also pipeline: the scan is cut into iteration ranges)
SCANNED = ["scan_gpt", "scan_gpt_remat", "scan_gpt_nnx"]
RECURRENT = ["lstm", "lstm_plain", "gru"]
LOOPS = ["fori_refiner", "while_normalised", "cond_switch", "scan_dense"]
MODELS = SCANNED + RECURRENT + LOOPS


def build(name: str, batch: int = BATCH):
    """The :class:`partition_cases.Case` of a control-flow model (fixed data, fixed loss);
    ``batch``: rows of the token batch of the language models (scanned and recurrent)."""
    from partition_cases import Case

    rng = np.random.default_rng(7)
    tokens = _tokens(shape=(batch, SEQ))
    lm = lambda out, t: next_token_loss(out, t)  # noqa: E731
    if name == "scan_gpt":
        return Case(ScanGPT(), (tokens,), lm)
    if name == "scan_gpt_remat":
        return Case(ScanGPT(remat=True), (tokens,), lm)
    if name == "loop_gpt":
        return Case(ScanGPT(unrolled=True), (tokens,), lm)
    if name == "scan_gpt_nnx":
        return Case(ScanGPTNNX(rngs=nnx.Rngs(0)), (tokens,), lm)
    if name in RECURRENT:
        return Case(RecurrentLM(name), (tokens,), lm)
    x = rng.standard_normal((2 * BATCH, 24)).astype(np.float32)
    target = rng.standard_normal((2 * BATCH, 8)).astype(np.float32)
    loss = lambda out, *_: _mse(out, target)  # noqa: E731
    if name == "fori_refiner":
        return Case(Refiner(), (x,), loss)
    if name == "while_normalised":
        return Case(WhileNormalised(), (4.0 * x,), loss)
    if name == "cond_switch":
        return Case(BranchModel(), (x, np.int32(2)), loss)
    if name == "scan_dense":
        return Case(ScanDense(), (x,), loss)
    if name == "while_decode":
        return Case(DecodeWhile(), (x,), loss)
    raise KeyError(name)
