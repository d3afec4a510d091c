"""Communication overlap (AxoNN SC'24): OAG, ORS and OAR as dependency windows.

XLA decides *when* each collective runs from the program's data flow; on GPU
it also splits collectives into asynchronous ``-start``/``-done`` pairs and
lets the latency-hiding scheduler put compute between them. What a framework
controls is the window each collective may occupy. The three options set
those windows with optimisation barriers and leave the values unchanged.
XLA:GPU keeps the barriers until after its scheduler has run, so they shape
the GPU schedule; XLA:CPU drops them before scheduling (its collectives are
synchronous), so on CPU they change nothing:

==========  ===================================  ===================================
option      on (default)                         off (AxoNN's unoverlapped baseline)
==========  ===================================  ===================================
``gather``  OAG: layer l+1's depth (z)           the gather is issued when layer l+1
            all-gather is issued as soon as      itself is reached: it blocks
            layer l's input exists, so it runs   (just in time).
            while layer l computes.
``reduce_   ORS: weight-gradient reductions      each reduction must finish before the
scatter``   (z reduce-scatter, data all-reduce)  backward pass goes past the layer
            are only needed by the optimizer,    that issued its gather (the mirror
            at the end of the backward pass.     window of the forward all-gather).
``all_      OAR: a layer's input-gradient        the input-gradient all-reduce
reduce``    all-reduce (over x or y) runs while  finishes before the weight-gradient
            the weight-gradient matmul           matmul starts.
            computes; that matmul is ordered
            after the input-gradient matmul.
==========  ===================================  ===================================

Example:
    >>> Overlap.parse("oag,oar")
    Overlap(gather=True, reduce_scatter=False, all_reduce=True)
    >>> Overlap.parse("none") == Overlap(False, False, False)
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.extend.mlir.dialects import stablehlo
from jax.interpreters import batching, mlir

from axonn_jax.partitioner.blocks import BUCKET_BLOCKS
from axonn_jax.runtime.varying import vary

_NAMES = {"oag": "gather", "ors": "reduce_scatter", "oar": "all_reduce"}
_PER_LAYER = "layer-gathers"
_BUCKET = "bucket="


@dataclasses.dataclass(frozen=True)
class Overlap:
    """Which of the three overlap windows to open (all on by default).

    ``gather_blocks``: a repeated block's depth-split weights (a transformer
    block's attention and MLP) are gathered in one all-gather, their gradients
    reduce-scattered in one call (``runtime/executor.py: gather_points``); off,
    one gather per layer, which holds one layer's weights at a time instead of
    a block's. Written ``layer-gathers`` in :meth:`parse` and ``str``.

    ``bucket_blocks``: with block gathers and ORS, this many consecutive blocks
    (per pipeline stage) reduce-scatter their weight gradients over z in one
    call, once the bucket's first block is through its backward
    (``runtime/grad_buckets.py``); 1: one call per block. The bucket's
    unreduced (z times larger) gradients are held until then. Written
    ``bucket=N`` in :meth:`parse` and ``str``.
    """

    gather: bool = True
    reduce_scatter: bool = True
    all_reduce: bool = True
    gather_blocks: bool = True
    bucket_blocks: int = BUCKET_BLOCKS

    def __post_init__(self) -> None:
        if not isinstance(self.bucket_blocks, int) or self.bucket_blocks < 1:
            raise ValueError(f"Overlap: bucket_blocks must be an int >= 1, got {self.bucket_blocks!r}")

    def buckets(self) -> int:
        """Blocks per weight-gradient reduce-scatter the executor issues (1: no buckets)."""
        return self.bucket_blocks if self.gather_blocks and self.reduce_scatter else 1

    @classmethod
    def parse(cls, text: str) -> Overlap:
        """``"all"``, ``"none"`` or a comma list of ``oag``, ``ors``, ``oar``; each may add
        ``layer-gathers`` (one weight gather per layer, not per block) and ``bucket=N``
        (N blocks per weight-gradient reduce-scatter)."""
        chosen = {t.strip() for t in text.strip().lower().split(",") if t.strip()}
        blocks = _PER_LAYER not in chosen
        chosen.discard(_PER_LAYER)
        bucket = BUCKET_BLOCKS
        for token in [t for t in chosen if t.startswith(_BUCKET)]:
            chosen.discard(token)
            try:
                bucket = int(token[len(_BUCKET):])
            except ValueError:
                raise ValueError(f"overlap option {token!r}: write bucket=N with N blocks per "
                                 "weight-gradient reduce-scatter (e.g. bucket=1)") from None
        if chosen == {"all"}:
            return cls(gather_blocks=blocks, bucket_blocks=bucket)
        if chosen == {"none"}:
            return cls(False, False, False, blocks, bucket)
        unknown = chosen - set(_NAMES)
        if unknown:
            raise ValueError(
                f"unknown overlap option(s) {sorted(unknown)} in {text!r}; use 'all', 'none' "
                "or a comma list of oag, ors, oar, layer-gathers, bucket=N (e.g. --overlap oag,ors)."
            )
        return cls(**{field: name in chosen for name, field in _NAMES.items()}, gather_blocks=blocks,
                   bucket_blocks=bucket)  # fmt: skip

    def __str__(self) -> str:
        on = [name for name, field in _NAMES.items() if getattr(self, field)]
        extra = [] if self.gather_blocks else [_PER_LAYER]
        extra += [] if self.bucket_blocks == BUCKET_BLOCKS else [f"{_BUCKET}{self.bucket_blocks}"]
        return ",".join((on or ["none"]) + extra)


# --- a barrier that keeps each operand's type -------------------------------
# ``lax.optimization_barrier`` makes every operand vary over the union of the
# operands' manual axes (inside ``shard_map``), which would change what autodiff
# reduces. This primitive lowers to the same HLO barrier but types each output
# exactly like its operand. It is only used inside custom VJPs (no AD rules).
barrier_p = Primitive("axonn_barrier")
barrier_p.multiple_results = True
barrier_p.def_abstract_eval(lambda *avals: avals)
barrier_p.def_impl(lambda *args: args)
mlir.register_lowering(
    barrier_p, lambda ctx, *args: list(stablehlo.OptimizationBarrierOp(args).results)
)
batching.primitive_batchers[barrier_p] = lambda args, dims: (barrier_p.bind(*args), dims)


def barrier(values: Sequence[jax.Array]) -> list:
    """``values`` unchanged, each available only once all of them are computed.

    Example:
        >>> [int(v) for v in barrier([jnp.int32(1), jnp.int32(2)])]
        [1, 2]
    """
    return list(barrier_p.bind(*values)) if values else []


def is_float(x) -> bool:
    """True for floating (differentiable) values."""
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def tie(shards: Sequence[jax.Array], *, after: Sequence[jax.Array],
        backward_with: Sequence[jax.Array] = ()) -> tuple[list, list]:  # fmt: skip
    """``shards`` usable only once ``after`` exist; ``backward_with`` gradients wait for theirs.

    Forward: one barrier over ``after``, ``shards`` and ``backward_with``, so
    whatever reads the returned shards (their gather) is scheduled after the
    ``after`` values are computed. Backward: the cotangents of the returned
    shards and ``backward_with`` values pass one barrier, so the rest of the
    backward pass (which reads the ``backward_with`` gradients) waits for the
    shards' gradients (their reduce-scatter). Values are unchanged. Returns
    ``(shards, backward_with)``.

    Example:
        >>> s, b = tie([jnp.zeros(3)], after=[jnp.ones(2)])
        >>> s[0].shape, b
        ((3,), [])
    """
    after = [a for a in after if is_float(a)]
    backward_with = list(backward_with)
    if not shards or not (after or backward_with):
        return list(shards), backward_with
    n, k = len(after), len(shards)

    @jax.custom_vjp
    def ordered(after, shards, backward_with):
        out = barrier([*after, *shards, *backward_with])
        return out[n : n + k], out[n + k :]

    def fwd(after, shards, backward_with):
        return ordered(after, shards, backward_with), None

    def bwd(_, cotangents):
        d_shards, d_with = cotangents
        if d_with:
            out = barrier([*d_shards, *d_with])
            d_shards, d_with = out[:k], out[k:]
        return [None] * n, d_shards, d_with

    ordered.defvjp(fwd, bwd)
    return ordered(after, list(shards), backward_with)


def contraction(
    bind: Callable[[jax.Array, jax.Array], jax.Array],
    lhs: jax.Array,
    rhs: jax.Array,
    *,
    lhs_missing: frozenset,
    rhs_missing: frozenset,
    overlap_all_reduce: bool,
) -> jax.Array:
    """``bind(lhs, rhs)`` after marking each operand varying over its ``*_missing`` axes.

    The backward pass is written out so the order of its pieces is explicit:
    the input-gradient matmul first, then its all-reduce over ``lhs_missing``
    (the transpose of the varying cast), then the weight-gradient matmul. With
    ``overlap_all_reduce`` the weight-gradient matmul waits only for the
    input-gradient *matmul*, so the all-reduce can run beside it (OAR);
    without, it waits for the all-reduce. Values are identical either way.
    An input gathered typed varying (the default program's batch all-gather)
    has no all-reduce here: its gather's transpose reduce-scatters the
    returned gradient after this backward, beside the weight-gradient matmul.
    """

    def product(a, b):
        return bind(vary(a, lhs_missing), vary(b, rhs_missing))

    perturbed = {}  # which operands need a gradient (known when fwd is traced)

    @jax.custom_vjp
    def run(a, b):
        return product(a, b)

    def fwd(a, b):
        perturbed.update(lhs=a.perturbed, rhs=b.perturbed)
        return run(a.value, b.value), (a.value, b.value)

    def bwd(residuals, ct):
        if isinstance(ct, jax.custom_derivatives.SymbolicZero):  # the product only fed stop_gradient
            return None, None
        a, b = residuals
        a_v, b_v = vary(a, lhs_missing), vary(b, rhs_missing)
        d_lhs = None
        if perturbed["lhs"]:
            # linear in each operand: transpose without recomputing the product
            (d_lhs,) = jax.linear_transpose(lambda u: bind(u, b_v), a_v)(ct)
            if overlap_all_reduce:
                ct, d_lhs = barrier([ct, d_lhs])
                d_lhs = _reduce(d_lhs, lhs_missing)
            else:
                d_lhs = _reduce(d_lhs, lhs_missing)
                ct, d_lhs = barrier([ct, d_lhs])
        d_rhs = None
        if perturbed["rhs"]:
            (d_rhs,) = jax.linear_transpose(lambda u: bind(a_v, u), b_v)(ct)
            d_rhs = _reduce(d_rhs, rhs_missing)
        return d_lhs, d_rhs

    run.defvjp(fwd, bwd, symbolic_zeros=True)
    return run(lhs, rhs)


def _reduce(x: jax.Array, axes: frozenset) -> jax.Array:
    return lax.psum(x, tuple(sorted(axes))) if axes else x
