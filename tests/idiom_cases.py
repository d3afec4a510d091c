"""Models written the way their communities write them, for the rules of issue 26.

- :class:`GemmaBlock` (nnx): Gemma's attention with named einsum kernels — a
  ``kv_einsum`` stacking k and v ``(2, kv_heads, hidden, head_dim)`` or a fused
  ``qkv_einsum`` ``(3, heads, hidden, head_dim)`` — RoPE, grouped-query
  attention, and the gated feed-forward whose ``(2, hidden, ffn)`` kernel is
  indexed ``[0]``/``[1]``.
- :class:`GraphNet`: message passing as ``jraph.GraphNetwork`` computes it
  (one big graph: nodes, edges, senders, receivers, globals, sizes);
  :class:`RepeatOntoNodes`: its globals repeated onto the nodes and added to them.
- :class:`ResNetBN`: Flax's ImageNet-example ResNet style, BatchNorm over
  ``axis_name='batch'`` (data-parallel code written for ``pmap``).
- :class:`AddInto`, :class:`PickTokens`: scatter-add into an activation,
  scatter (set), ``take_along_axis`` and ``vmap``-ed lookups.
- :func:`gpt_with_dropout`: the repo's GPT with dropout 0.1.
- :class:`KeywordOnly` (linen) and :class:`KeywordOnlyNNX`: a stack of
  residual blocks called ``model(inputs=x)`` (``def __call__(self, *, inputs)``).

:func:`idioms` lists them for ``benchmarks/redundancy.py --idioms``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

K_MASK = -2.3819763e38  # Gemma's mask value for attention logits


class Einsum(nnx.Module):
    """An einsum with a named kernel: ``jnp.einsum(spec, x, w)``."""

    def __init__(self, spec: str, shape: tuple[int, ...], *, rngs: nnx.Rngs):
        self.spec = spec
        self.w = nnx.Param(nnx.initializers.normal(0.2)(rngs.params(), shape))

    def __call__(self, x):
        return jnp.einsum(self.spec, x, self.w[...])


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.zeros((dim,)))

    def __call__(self, x):
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(var + 1e-6) * (1 + self.scale[...])


def rope(x, positions, max_wavelength: int = 10_000):
    """Rotary embedding of ``x [B, T, N, H]`` at ``positions [B, T]`` (halves rotated)."""
    head_dim = x.shape[-1]
    fraction = 2 * jnp.arange(0, head_dim // 2) / head_dim
    angle = positions[..., None] / (max_wavelength**fraction)[None, None, :]
    sin, cos = jnp.sin(angle)[..., None, :], jnp.cos(angle)[..., None, :]
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class GemmaAttention(nnx.Module):
    def __init__(self, features: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 fused_qkv: bool = False, rngs: nnx.Rngs):  # fmt: skip
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.fused_qkv = fused_qkv
        if fused_qkv:
            self.qkv_einsum = Einsum("BTD,SNDH->SBTNH", (3, num_heads, features, head_dim), rngs=rngs)
        else:
            self.q_einsum = Einsum("BTD,NDH->BTNH", (num_heads, features, head_dim), rngs=rngs)
            self.kv_einsum = Einsum("BSD,CKDH->CBSKH", (2, num_kv_heads, features, head_dim),
                                    rngs=rngs)  # fmt: skip
        self.attn_vec_einsum = Einsum("BTNH,NHD->BTD", (num_heads, head_dim, features), rngs=rngs)

    def __call__(self, x, positions, mask):
        if self.fused_qkv:
            query, key, value = self.qkv_einsum(x)
        else:
            query = self.q_einsum(x)
            key, value = self.kv_einsum(x)
        query = rope(query, positions) * self.head_dim**-0.5
        key = rope(key, positions)
        b, t, n, h = query.shape
        if self.num_kv_heads != self.num_heads:  # grouped-query attention
            grouped = query.reshape((b, t, self.num_kv_heads, n // self.num_kv_heads, h))
            logits = jnp.einsum("BTKGH,BSKH->BTKGS", grouped, key).reshape((b, t, n, -1))
        else:
            logits = jnp.einsum("BTNH,BSNH->BTNS", query, key)
        logits = jnp.where(mask[:, :, None, :], logits, K_MASK)
        probs = jax.nn.softmax(logits, axis=-1).astype(key.dtype)
        if self.num_kv_heads != self.num_heads:
            grouped = probs.reshape((b, t, self.num_kv_heads, n // self.num_kv_heads, -1))
            encoded = jnp.einsum("BTKGS,BSKH->BTKGH", grouped, value).reshape((b, t, n, h))
        else:
            encoded = jnp.einsum("BTNS,BSNH->BTNH", probs, value)
        return self.attn_vec_einsum(encoded)


class GemmaFeedForward(nnx.Module):
    """Gated GELU; both input projections in one ``(2, features, hidden)`` kernel."""

    def __init__(self, features: int, hidden: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.2)
        self.gating_einsum = nnx.Param(init(rngs.params(), (2, features, hidden)))
        self.linear = nnx.Param(init(rngs.params(), (hidden, features)))

    def __call__(self, x):
        gate = nnx.gelu(jnp.dot(x, self.gating_einsum[0]))
        return jnp.dot(gate * jnp.dot(x, self.gating_einsum[1]), self.linear[...])


class GemmaBlock(nnx.Module):
    """Pre-norm block: attention and gated feed-forward, each with a residual."""

    def __init__(self, *, features: int = 32, num_heads: int = 8, num_kv_heads: int = 4,
                 head_dim: int = 8, hidden: int = 64, fused_qkv: bool = False,
                 rngs: nnx.Rngs):  # fmt: skip
        self.pre_attention_norm = RMSNorm(features, rngs=rngs)
        self.attn = GemmaAttention(features, num_heads, num_kv_heads, head_dim,
                                   fused_qkv=fused_qkv, rngs=rngs)  # fmt: skip
        self.pre_ffw_norm = RMSNorm(features, rngs=rngs)
        self.mlp = GemmaFeedForward(features, hidden, rngs=rngs)

    def __call__(self, x, positions, mask):
        x = x + self.attn(self.pre_attention_norm(x), positions, mask)
        return x + self.mlp(self.pre_ffw_norm(x))


def gemma_inputs(batch: int = 8, seq: int = 16, features: int = 32):
    """``(x, positions, causal mask)`` of a Gemma block."""
    x = np.random.default_rng(0).standard_normal((batch, seq, features)).astype(np.float32)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy()
    mask = np.broadcast_to(np.tril(np.ones((seq, seq), bool)), (batch, seq, seq)).copy()
    return x, positions, mask


# --- a graph net, jraph-style -------------------------------------------------------


class GraphMLP(nn.Module):
    features: tuple[int, ...]

    @nn.compact
    def __call__(self, x):
        for i, width in enumerate(self.features):
            x = nn.Dense(width)(x)
            x = nn.relu(x) if i < len(self.features) - 1 else x
        return x


class GraphNetwork(nn.Module):
    """One full message-passing step as ``jraph.GraphNetwork`` computes it.

    A batch of graphs is one big graph: ``nodes [N, F]``, ``edges [E, F]``,
    ``senders``/``receivers [E]`` (node ids), ``globals_ [G, F]`` and the
    sizes ``n_node``/``n_edge [G]``. Edges see their end nodes and graph;
    nodes sum their incoming and outgoing edges (``segment_sum``); each graph
    sums its nodes and edges.
    """

    width: int = 32

    @nn.compact
    def __call__(self, nodes, edges, senders, receivers, globals_, n_node, n_edge):
        sum_n_node, sum_n_edge, n_graph = nodes.shape[0], edges.shape[0], n_node.shape[0]
        edge_globals = jnp.repeat(globals_, n_edge, axis=0, total_repeat_length=sum_n_edge)
        edges = GraphMLP((2 * self.width, self.width), name="edge_fn")(
            jnp.concatenate([edges, nodes[senders], nodes[receivers], edge_globals], axis=-1))
        sent = jax.ops.segment_sum(edges, senders, num_segments=sum_n_node)
        received = jax.ops.segment_sum(edges, receivers, num_segments=sum_n_node)
        node_globals = jnp.repeat(globals_, n_node, axis=0, total_repeat_length=sum_n_node)
        nodes = GraphMLP((2 * self.width, self.width), name="node_fn")(
            jnp.concatenate([nodes, sent, received, node_globals], axis=-1))
        graph = jnp.arange(n_graph)
        node_graph = jnp.repeat(graph, n_node, axis=0, total_repeat_length=sum_n_node)
        edge_graph = jnp.repeat(graph, n_edge, axis=0, total_repeat_length=sum_n_edge)
        pooled = [jax.ops.segment_sum(nodes, node_graph, num_segments=n_graph),
                  jax.ops.segment_sum(edges, edge_graph, num_segments=n_graph)]  # fmt: skip
        globals_ = GraphMLP((2 * self.width, self.width), name="global_fn")(
            jnp.concatenate([*pooled, globals_], axis=-1))
        return nodes, edges, globals_


class GraphNet(nn.Module):
    """Encoder, two message-passing steps, a per-graph readout ``[G, targets]``."""

    width: int = 32
    targets: int = 4

    @nn.compact
    def __call__(self, nodes, edges, senders, receivers, globals_, n_node, n_edge):
        nodes = nn.Dense(self.width)(nodes)
        edges = nn.Dense(self.width)(edges)
        globals_ = nn.Dense(self.width)(globals_)
        for step in range(2):
            nodes, edges, globals_ = GraphNetwork(self.width, name=f"step_{step}")(
                nodes, edges, senders, receivers, globals_, n_node, n_edge)
        return nn.Dense(self.targets)(globals_)


class RepeatOntoNodes(nn.Module):
    """Each graph's features repeated onto its nodes (``jnp.repeat(globals_, n_node)``, as
    :class:`GraphNetwork` does) and added to the nodes' own."""

    @nn.compact
    def __call__(self, nodes, globals_, n_node):
        per_node = jnp.repeat(nn.Dense(16)(globals_), n_node, axis=0, total_repeat_length=nodes.shape[0])
        return nn.Dense(4)(nn.Dense(16)(nodes) + per_node)


def repeat_onto_nodes_batch() -> tuple:
    """Nodes ``[64, 8]``, globals ``[8, 8]`` and the sizes of 8 graphs of unequal sizes."""
    nodes, _, _, _, globals_, n_node, _ = graph_batch()
    return nodes, globals_, n_node


def graph_batch(graphs: int = 8, nodes: int = 64, edges: int = 128, features: int = 8):
    """A batch of ``graphs`` random graphs of unequal sizes, as one graph (jraph's layout)."""
    rng = np.random.default_rng(5)
    n_node = np.full(graphs, nodes // graphs)
    n_node[: graphs // 2] += 2
    n_node[graphs // 2 :] -= 2
    n_edge = np.full(graphs, edges // graphs)
    n_edge[::2] += 4
    n_edge[1::2] -= 4
    first = np.concatenate([[0], np.cumsum(n_node)[:-1]])
    senders = np.concatenate([f + rng.integers(0, n, e) for f, n, e in zip(first, n_node, n_edge)])
    receivers = np.concatenate([f + rng.integers(0, n, e) for f, n, e in zip(first, n_node, n_edge)])
    return (rng.standard_normal((nodes, features)).astype(np.float32),
            rng.standard_normal((edges, features)).astype(np.float32),
            senders.astype(np.int32), receivers.astype(np.int32),
            rng.standard_normal((graphs, features)).astype(np.float32),
            n_node.astype(np.int32), n_edge.astype(np.int32))  # fmt: skip


# --- ResNet-style BatchNorm with axis_name, as data-parallel (pmap) code writes it -----------


class ResNetBlock(nn.Module):
    filters: int
    norm: Any
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = self.norm()(nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x))
        y = self.norm(scale_init=nn.initializers.zeros)(
            nn.Conv(self.filters, (3, 3), use_bias=False)(nn.relu(y)))
        if residual.shape != y.shape:
            residual = self.norm(name="norm_proj")(
                nn.Conv(self.filters, (1, 1), self.strides, use_bias=False, name="conv_proj")(residual))
        return nn.relu(residual + y)


class ResNetBN(nn.Module):
    """A small ResNet whose BatchNorms average over ``axis_name='batch'`` (Flax's ImageNet example)."""

    num_classes: int = 10
    axis_name: str | None = "batch"

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                                 epsilon=1e-5, axis_name=self.axis_name)  # fmt: skip
        x = nn.relu(norm(name="bn_init")(nn.Conv(16, (3, 3), use_bias=False, name="conv_init")(x)))
        for i, (filters, strides) in enumerate([(16, (1, 1)), (32, (2, 2))]):
            x = ResNetBlock(filters, norm, strides, name=f"block_{i}")(x)
        return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


# --- a GAN discriminator with spectral normalisation (flax's nn.SpectralNorm) ---------------


class SpectralDiscriminator(nn.Module):
    """Spectrally normalised convolutions and head, as GAN discriminators write them: the
    power iteration multiplies each kernel under ``stop_gradient`` (its ``u`` and ``sigma``
    are ``batch_stats``, updated with ``update_stats=True``)."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        for features in (16, 32):
            x = nn.SpectralNorm(nn.Conv(features, (3, 3), strides=2))(x, update_stats=train)
            x = nn.leaky_relu(x, 0.2)
        return nn.SpectralNorm(nn.Dense(1))(x.reshape(x.shape[0], -1), update_stats=train)


# --- index updates and batched lookups ----------------------------------------------------

RNG = np.random.default_rng(11)
ROWS = RNG.standard_normal((64, 16)).astype(np.float32)  # nodes
UPDATES = RNG.standard_normal((128, 16)).astype(np.float32)  # edges
INDEX = RNG.integers(0, 64, 128).astype(np.int32)  # each edge's node
TOKENS = RNG.standard_normal((8, 12, 16)).astype(np.float32)
PICK = RNG.integers(0, 12, (8, 3)).astype(np.int32)  # per sequence: 3 positions


class AddInto(nn.Module):
    """``rows.at[index].add(updates)`` into an activation (not zeros), and a ``.set``."""

    @nn.compact
    def __call__(self, rows, updates, index):
        h = nn.Dense(32)(rows)
        added = h.at[index].add(nn.Dense(32)(updates))  # the operand counts once
        first = jnp.zeros((64,), jnp.int32).at[index[:4]].set(1)  # writes, whole indices
        return nn.Dense(8)(nn.tanh(added) * (1 + first[:, None]))


class PickTokens(nn.Module):
    """Per-sequence lookups: ``take_along_axis`` and a ``vmap``-ed index (batching dims)."""

    @nn.compact
    def __call__(self, tokens, pick):
        h = nn.Dense(32)(tokens)
        along = jnp.take_along_axis(h, pick[..., None], axis=1)  # [B, 3, 32]
        mapped = jax.vmap(lambda seq, i: seq[i])(h, pick)  # [B, 3, 32]
        return nn.Dense(8)(nn.gelu(along + mapped))


# --- a keyword-only input: model(inputs=x) ------------------------------------------------


class ResidualBlock(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(self.width)(nn.gelu(nn.Dense(2 * self.width)(nn.LayerNorm()(x))))


class KeywordOnly(nn.Module):
    """Four residual blocks over ``inputs [B, T, F]``, taken by keyword only."""

    width: int = 32
    blocks: int = 4

    @nn.compact
    def __call__(self, *, inputs):
        x = nn.Dense(self.width)(inputs)
        for i in range(self.blocks):
            x = ResidualBlock(self.width, name=f"block_{i}")(x)
        return nn.Dense(4)(x)


class ResidualBlockNNX(nnx.Module):
    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 2 * width, rngs=rngs)
        self.down = nnx.Linear(2 * width, width, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.up(self.norm(x))))


class KeywordOnlyNNX(nnx.Module):
    """:class:`KeywordOnly` in nnx."""

    def __init__(self, features: int = 8, width: int = 32, blocks: int = 4, *, rngs: nnx.Rngs):
        self.embed = nnx.Linear(features, width, rngs=rngs)
        self.blocks = nnx.List([ResidualBlockNNX(width, rngs=rngs) for _ in range(blocks)])
        self.head = nnx.Linear(width, 4, rngs=rngs)

    def __call__(self, *, inputs):
        x = self.embed(inputs)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def keyword_batch(rows: int = 16, seq: int = 4, features: int = 8) -> dict:
    """``{"inputs": [rows, seq, features], "targets": [rows, seq, 4]}``."""
    rng = np.random.default_rng(3)
    return {"inputs": rng.standard_normal((rows, seq, features)).astype(np.float32),
            "targets": rng.standard_normal((rows, seq, 4)).astype(np.float32)}  # fmt: skip


IMAGES = np.random.default_rng(0).standard_normal((8, 8, 8, 3)).astype(np.float32)


def gpt_with_dropout():
    """The repo's GPT with dropout 0.1 and its tokens."""
    from partition_cases import _gpt_config, _tokens

    from axonn_jax.models import GPT

    return GPT(_gpt_config(dropout=0.1)), _tokens(0)


def idioms() -> dict:
    """``{name: (model, args, kwargs)}`` of this module (``benchmarks/redundancy.py --idioms``)."""
    gpt, tokens = gpt_with_dropout()
    return {
        "gemma_kv_einsum": (GemmaBlock(rngs=nnx.Rngs(0)), gemma_inputs(), {}),
        "gemma_qkv_einsum": (GemmaBlock(num_kv_heads=8, fused_qkv=True, rngs=nnx.Rngs(0)),
                             gemma_inputs(), {}),
        "graph_net": (GraphNet(), graph_batch(), {}),
        "resnet_bn_axis_name": (ResNetBN(num_classes=8), (IMAGES,), {"mutable": ["batch_stats"]}),
        "scatter_add": (AddInto(), (ROWS, UPDATES, INDEX), {}),
        "batched_gather": (PickTokens(), (TOKENS, PICK), {}),
        "gpt_dropout": (gpt, (tokens,), {"deterministic": False, "rngs": {"dropout": jax.random.key(42)}}),
    }
