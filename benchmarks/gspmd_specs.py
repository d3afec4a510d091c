"""Hand-written GSPMD ``PartitionSpec``s for the reference GPT: Megatron-style TP and FSDP.

These are the specs a user of plain ``jax.jit`` would write by hand; the
comparison benchmark (``gspmd_compare.py``) gives them to XLA's automatic
sharding (GSPMD) and lets it place every other value.

* :func:`megatron_specs` — 1D tensor parallelism over one mesh axis, Megatron
  style: column-parallel ``query``/``key``/``value``/``fc_in`` (kernels and
  biases split on the first output dim, i.e. heads or ffn features),
  row-parallel ``out``/``fc_out`` (kernels split on the first input dim, biases
  replicated), token embedding split on the vocabulary (vocab-parallel, which
  also splits the tied output head); norms and the position embedding are
  replicated.
* :func:`fsdp_specs` — every parameter split over one mesh axis on its largest
  dim that the axis size divides (replicated when none does).

Parameters are identified by their path in the linen ``GPT`` params tree
(``block_0/attn/query/kernel`` …), shapes as documented in
:mod:`axonn_jax.models.layers`.

Example:
    >>> import numpy as np
    >>> params = {"block_0": {"mlp": {"fc_in": {"kernel": np.zeros((8, 32)), "bias": np.zeros(32)},
    ...                               "fc_out": {"kernel": np.zeros((32, 8)), "bias": np.zeros(8)}}}}
    >>> specs = megatron_specs(params, "tp", 4)
    >>> specs["block_0"]["mlp"]["fc_in"]["kernel"], specs["block_0"]["mlp"]["fc_out"]["kernel"]
    (P(None, 'tp'), P('tp', None))
    >>> fsdp_specs(params, "fsdp", 8)["block_0"]["mlp"]["fc_out"]["bias"]
    P('fsdp',)
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

#: Modules whose output features are split (column-parallel).
COLUMN_PARALLEL = ("query", "key", "value", "fc_in")
#: Modules whose input features are split (row-parallel).
ROW_PARALLEL = ("out", "fc_out")


def _path(key_path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in key_path)


def _split(ndim: int, dim: int, axis: str) -> P:
    return P(*[axis if d == dim else None for d in range(ndim)])


def _check(path: tuple[str, ...], shape: tuple[int, ...], dim: int, axis: str, size: int) -> None:
    if shape[dim] % size:
        raise ValueError(
            f"parameter '{'/'.join(path)}' of shape {shape}: dim {dim} ({shape[dim]}) is not "
            f"divisible by mesh axis '{axis}' of size {size}. Remedy: use a tensor-parallel "
            f"size that divides {shape[dim]}, or a model whose heads/ffn/vocab are multiples "
            f"of {size}."
        )


def megatron_spec(path: tuple[str, ...], shape: tuple[int, ...], axis: str, size: int) -> P:
    """Megatron-style 1D tensor-parallel spec of one GPT parameter (see module doc)."""
    module, leaf = (path[-2], path[-1]) if len(path) >= 2 else ("", path[-1])
    dim = None
    if module in COLUMN_PARALLEL:
        # kernel [in, out...] splits its first output dim; bias [out...] its first dim
        dim = 1 if leaf == "kernel" else 0
    elif module in ROW_PARALLEL and leaf == "kernel":
        dim = 0  # kernel [in..., out]: the first input dim (heads, or ffn features)
    elif module == "embed" and leaf == "embedding":
        dim = 0  # [vocab, hidden]: vocab-parallel embedding (and tied head)
    if dim is None:
        return P()
    _check(path, shape, dim, axis, size)
    return _split(len(shape), dim, axis)


def fsdp_spec(path: tuple[str, ...], shape: tuple[int, ...], axis: str, size: int) -> P:
    """FSDP spec of one parameter: split its largest dim divisible by ``size``."""
    del path
    dims = sorted(range(len(shape)), key=lambda d: (-shape[d], d))
    for dim in dims:
        if shape[dim] % size == 0:
            return _split(len(shape), dim, axis)
    return P()


def _specs(params: Any, rule, axis: str, size: int) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: rule(_path(kp), tuple(np.shape(x)), axis, size), params
    )


def megatron_specs(params: Any, axis: str, size: int) -> Any:
    """PartitionSpec pytree for 1D tensor parallelism of ``params`` over ``axis`` (``size`` devices)."""
    return _specs(params, megatron_spec, axis, size)


def fsdp_specs(params: Any, axis: str, size: int) -> Any:
    """PartitionSpec pytree that splits every parameter of ``params`` over ``axis``."""
    return _specs(params, fsdp_spec, axis, size)
