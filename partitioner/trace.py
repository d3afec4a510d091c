"""Trace a Flax model (linen or nnx) to a jaxpr over abstract shapes.

Nothing here allocates full-size arrays or touches devices: parameters are
``jax.ShapeDtypeStruct`` leaves obtained with ``jax.eval_shape``. The result
is a :class:`TracedModel`: a closed jaxpr whose first inputs are the
parameter leaves (in ``jax.tree`` order) followed by the flattened call
arguments, plus what is needed to rebuild pytrees.

Example:
    >>> import flax.linen as nn, jax.numpy as jnp
    >>> traced = trace_model(nn.Dense(4), jnp.zeros((2, 3)))
    >>> traced.param_paths
    ('bias', 'kernel')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from axonn_jax.partitioner.pointwise import body, keeps_whole


@dataclasses.dataclass(frozen=True)
class TracedModel:
    """A model as a jaxpr: ``jaxpr(*param_leaves, *arg_leaves) -> out_leaves``."""

    kind: str  # "linen" or "nnx"
    jaxpr: Any  # jax.extend.core.ClosedJaxpr
    param_tree: Any  # treedef of the params pytree
    param_paths: tuple[str, ...]
    param_avals: tuple[jax.ShapeDtypeStruct, ...]
    arg_tree: Any  # treedef of (args, kwargs)
    arg_avals: tuple[jax.ShapeDtypeStruct, ...]  # the array arguments (program inputs)
    out_tree: Any
    apply: Callable  # apply(params, *args, **kwargs): the unpartitioned model
    init: Callable  # init(key) -> full params (used only for the reference path)
    extra_state: Any = None  # nnx non-Param state (constants for the jaxpr)
    static_args: tuple = ()  # ((leaf position, value), ...): Python scalars baked in

    @property
    def num_params(self) -> int:
        return len(self.param_avals)

    def example_call(self) -> tuple[tuple, dict]:
        """The traced call's ``(args, kwargs)``: ShapeDtypeStructs and the static values."""
        dynamic = iter(self.arg_avals)
        fixed = dict(self.static_args)
        count = self.arg_tree.num_leaves
        leaves = [fixed[i] if i in fixed else next(dynamic) for i in range(count)]
        return jax.tree.unflatten(self.arg_tree, leaves)


def abstract(x) -> jax.ShapeDtypeStruct:
    """The shape and dtype of an array argument (a ShapeDtypeStruct passes through)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    x = jnp.asarray(x) if not hasattr(x, "shape") else x
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def is_static(x) -> bool:
    """Python scalars and strings in the call (flags such as ``deterministic=True``).

    They are baked into the traced program, like ``static_argnums`` of
    ``jax.jit``; arrays (NumPy or JAX, any rank) are the program's inputs.
    """
    return isinstance(x, (bool, int, float, complex, str))


def call_leaves(args, kwargs) -> tuple[list, tuple]:
    """The array leaves of a call and its static values ``((position, value), ...)``."""
    leaves = jax.tree.leaves((args, kwargs))
    static = tuple((i, x) for i, x in enumerate(leaves) if is_static(x))
    return [x for x in leaves if not is_static(x)], static


def path_string(path) -> str:
    """``('params', 'mlp', 'kernel')`` keys → ``"mlp/kernel"``."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def trace_model(model, *args, **kwargs) -> TracedModel:
    """Trace ``model`` called on ``args``/``kwargs`` (arrays or ShapeDtypeStructs)."""
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax always has nnx since 0.8
        nnx = None
    import flax.linen as nn

    abstract_args = jax.tree.map(lambda x: x if is_static(x) else abstract(x), (args, kwargs))
    if isinstance(model, nn.Module):
        return _trace_linen(model, abstract_args)
    if nnx is not None and isinstance(model, nnx.Module):
        return _trace_nnx(model, abstract_args)
    raise TypeError(
        f"axonn_jax.partition expects a flax.linen.Module or flax.nnx.Module, got "
        f"{type(model).__name__}. Remedy: wrap plain functions in a linen Module."
    )


def _trace_linen(model, abstract_args) -> TracedModel:
    args, kwargs = abstract_args

    def init(key):
        variables = model.init(key, *args_like(args), **args_like(kwargs))
        _check_collections(variables)
        return variables["params"]

    def apply(params, *call_args, **call_kwargs):
        return model.apply({"params": params}, *call_args, **call_kwargs)

    params = jax.eval_shape(init, jax.random.key(0))
    return _finish("linen", params, abstract_args, apply, init)


def args_like(tree):
    """Zeros shaped like ShapeDtypeStructs (for init only; never full model params)."""
    return jax.tree.map(lambda a: a if is_static(a) else jnp.zeros(a.shape, a.dtype), tree)


def _check_collections(variables) -> None:
    extra = sorted(set(variables) - {"params"})
    if extra:
        raise ValueError(
            f"the model creates variable collections {extra} besides 'params'; "
            "axonn_jax partitions stateless models (params only). Remedy: make them "
            "constants or pass them as call arguments."
        )


def _trace_nnx(model, abstract_args) -> TracedModel:
    from flax import nnx

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    values = nnx.to_pure_dict(params)

    def apply(new_values, *call_args, **call_kwargs):
        state = nnx.clone(params) if hasattr(nnx, "clone") else params
        nnx.replace_by_pure_dict(state, new_values)
        return nnx.merge(graphdef, state, rest)(*call_args, **call_kwargs)

    def init(key):
        del key  # an nnx module already carries its initial values
        return values

    abstract_params = jax.tree.map(abstract, values)
    return _finish("nnx", abstract_params, abstract_args, apply, init, extra_state=rest)


def _finish(kind, params, abstract_args, apply, init, extra_state=None) -> TracedModel:
    leaves_with_path, param_tree = jax.tree_util.tree_flatten_with_path(params)
    paths = tuple(path_string(p) for p, _ in leaves_with_path)
    param_avals = tuple(abstract(v) for _, v in leaves_with_path)
    all_arg_leaves, arg_tree = jax.tree.flatten(abstract_args)
    static = tuple((i, x) for i, x in enumerate(all_arg_leaves) if is_static(x))
    arg_leaves = [x for x in all_arg_leaves if not is_static(x)]
    out_store = {}

    def flat_fn(*leaves):
        p = jax.tree.unflatten(param_tree, leaves[: len(param_avals)])
        dynamic = iter(leaves[len(param_avals) :])
        fixed = dict(static)
        full = [fixed[i] if i in fixed else next(dynamic) for i in range(len(all_arg_leaves))]
        call_args, call_kwargs = jax.tree.unflatten(arg_tree, full)
        out = apply(p, *call_args, **call_kwargs)
        out_leaves, out_store["tree"] = jax.tree.flatten(out)
        return out_leaves

    closed = jax.make_jaxpr(flat_fn)(*param_avals, *arg_leaves)
    return TracedModel(
        kind=kind,
        jaxpr=closed,
        param_tree=param_tree,
        param_paths=paths,
        param_avals=param_avals,
        arg_tree=arg_tree,
        arg_avals=tuple(arg_leaves),
        static_args=static,
        out_tree=out_store["tree"],
        apply=apply,
        init=init,
        extra_state=extra_state,
    )


def inline_calls(closed) -> Any:
    """Flatten nested ``jit``/``pjit``/``custom_jvp``/``custom_vjp``/``remat`` calls.

    Returns a new ClosedJaxpr whose equations are primitives only (control flow
    such as ``scan``/``while``/``cond`` is kept as one opaque equation), except
    pointwise custom-JVP calls such as ``jax.nn.relu``, kept whole so that
    their derivative rule survives (:mod:`~axonn_jax.partitioner.pointwise`).
    """
    inlined = jax.make_jaxpr(lambda *a: _eval_inlined(closed.jaxpr, closed.consts, a))(
        *[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    )
    return inlined


_CALLS = {"jit", "pjit", "closed_call", "core_call", "remat", "checkpoint", "custom_lin"}


def inlined_body(eqn) -> tuple | None:
    """``(jaxpr, consts)`` of a call that :func:`inline_calls` flattens, else None."""
    name = eqn.primitive.name
    if not (name in _CALLS or name.startswith("custom_")) or keeps_whole(eqn):
        return None
    return body(eqn)


def _eval_inlined(jaxpr, consts, args):
    env = {}

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for var, val in zip(jaxpr.constvars, consts):
        env[var] = val
    for var, val in zip(jaxpr.invars, args):
        env[var] = val
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        inner = inlined_body(eqn)
        if inner is not None:
            inner_jaxpr, inner_consts = inner
            outs = _eval_inlined(inner_jaxpr, inner_consts, invals[-len(inner_jaxpr.invars) :])
        else:  # a primitive, or a call kept whole (partitioner.pointwise)
            outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for var, val in zip(eqn.outvars, outs):
            env[var] = val
    return [read(v) for v in jaxpr.outvars]
