"""Trace a Flax model (linen or nnx) to a jaxpr over abstract shapes.

Nothing here allocates full-size arrays or touches devices: parameters are
``jax.ShapeDtypeStruct`` leaves obtained with ``jax.eval_shape``. The result
is a :class:`TracedModel`: a closed jaxpr whose first inputs are the
parameter leaves (in ``jax.tree`` order) followed by the flattened call
arguments, plus what is needed to rebuild pytrees.

Models with state (linen collections besides ``params`` such as BatchNorm's
``batch_stats``; nnx variables other than ``nnx.Param``) are traced over their
whole variables dict: ``{'params': ..., 'batch_stats': ...}`` for linen,
``{'params': ..., 'state': ...}`` for nnx (RNG keys as raw key data). Those
leaves are planned and placed like parameters but are not trainable; a call
that updates them (linen ``mutable=[...]``; nnx always) returns
``(outputs, updates)`` as ``model.apply(..., mutable=...)`` does. RNG streams
(``rngs={'dropout': key}``) are array inputs of the call.

Example:
    >>> import flax.linen as nn, jax.numpy as jnp
    >>> traced = trace_model(nn.Dense(4), jnp.zeros((2, 3)))
    >>> traced.param_paths
    ('bias', 'kernel')
    >>> bn = trace_model(nn.BatchNorm(use_running_average=False), jnp.zeros((4, 3)),
    ...                  mutable=["batch_stats"])
    >>> bn.param_paths, bn.trainable, bn.state_outputs
    (('batch_stats/mean', 'batch_stats/var', 'params/bias', 'params/scale'), (False, False, True, True), ((1, 0), (2, 1)))
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax.core import meta as flax_meta
from flax.core.scope import DenyList
from jax.extend import core as jex_core

from axonn_jax.partitioner.jaxprs import CONTROL_FLOW, call_body, subjaxprs, with_subjaxprs
from axonn_jax.partitioner.pointwise import keeps_whole
from axonn_jax.partitioner.rules import COLLECTIVE_AXES, OTHER_COLLECTIVES


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
    static_args: tuple = ()  # ((leaf position, value), ...): Python scalars baked in
    trainable: tuple[bool, ...] = ()  # per variable leaf: a parameter (True) or state (False)
    state_outputs: tuple[tuple[int, int], ...] = ()  # (output leaf, variable leaf it updates)
    rng_args: frozenset[int] = frozenset()  # positions in arg_avals of RNG keys (``rngs=``)
    rng_state: frozenset[int] = frozenset()  # variable leaves holding nnx RNG keys (raw key data)
    #: the model's own collective axis names (``BatchNorm(axis_name='batch')``), bound with
    #: size 1 while tracing: the model is traced over the whole batch (see bound_axis_names)
    axis_names: tuple = ()
    notes: tuple[str, ...] = ()  # what tracing found that the plan warns about

    @property
    def num_params(self) -> int:
        return len(self.param_avals)

    @property
    def has_state(self) -> bool:
        """True when the variables include non-trainable state (the tree is a variables dict)."""
        return not all(self.trainable)

    def example_call(self) -> tuple[tuple, dict]:
        """The traced call's ``(args, kwargs)``: ShapeDtypeStructs and the static values."""
        dynamic = iter(self.arg_avals)
        fixed = dict(self.static_args)
        count = self.arg_tree.num_leaves
        leaves = [fixed[i] if i in fixed else next(dynamic) for i in range(count)]
        return jax.tree.unflatten(self.arg_tree, leaves)


def abstract(x) -> jax.ShapeDtypeStruct:
    """The shape and dtype of an array argument (a ShapeDtypeStruct passes through), the
    dtype as JAX computes with it: a NumPy int64 batch is int32 without ``jax_enable_x64``,
    as ``jnp.asarray`` makes it (so both are one signature, one compiled program).

    Example:
        >>> abstract(np.zeros((2, 3), np.int64)).dtype  # doctest: +SKIP
        dtype('int32')
    """
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    x = jnp.asarray(x) if not hasattr(x, "shape") else x
    dtype = x.dtype if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) else jax.dtypes.canonicalize_dtype(x.dtype)
    return jax.ShapeDtypeStruct(x.shape, dtype)


def abstract_call(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A call's inputs as ``ShapeDtypeStruct`` (static values, :func:`is_static`, kept as they are)."""
    return jax.tree.map(lambda x: x if is_static(x) else abstract(x), (args, kwargs))


def is_static(x) -> bool:
    """Python scalars, strings and functions in the call (flags such as ``deterministic=True``;
    linen's ``method=Model.encode``, or ``method='encode'``, which ``model.apply`` takes), and
    linen's collection filters (``mutable=nn.DenyList('intermediates')``).

    They are baked into the traced program, like ``static_argnums`` of
    ``jax.jit``; arrays (NumPy or JAX, any rank) are the program's inputs.
    """
    return isinstance(x, (bool, int, float, complex, str, DenyList)) or inspect.isroutine(x)


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


def trace_model(model, *args, init_inputs: Sequence | None = None, **kwargs) -> TracedModel:
    """Trace ``model`` called on ``args``/``kwargs`` (arrays or ShapeDtypeStructs).

    ``init_inputs``: a linen model's variables are those ``model.init`` makes of these
    positional inputs instead of ``args`` (Flax's ``decode=True`` cache: initialised on
    the maximum length, called one token at a time).

    Collective axis names the model uses itself (data-parallel code written for
    ``pmap``: ``BatchNorm(axis_name='batch')``, ``lax.pmean(x, 'batch')``) are
    found while tracing and bound with size 1 (:func:`bound_axis_names`): the
    model is traced over the whole batch, so its statistics are those of the
    whole batch, which the partitioned program computes with its own reductions.
    """
    names: tuple = ()
    while True:
        try:
            with bound_axis_names(names):
                traced = _trace(model, args, kwargs, init_inputs)
            break
        except NameError as err:
            name = unbound_axis_name(err)
            if name is None or name in names:
                raise
            names += (name,)
    if not names:
        return traced
    return dataclasses.replace(traced, axis_names=names, apply=_binding(traced.apply, names),
                               init=_binding(traced.init, names))  # fmt: skip


def _trace(model, args, kwargs, init_inputs=None) -> TracedModel:
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax always has nnx since 0.8
        nnx = None
    import flax.linen as nn

    abstract_args = abstract_call(args, kwargs)
    if isinstance(model, nn.Module):
        init_args = None if init_inputs is None else abstract_call(tuple(init_inputs), {})[0]
        return _trace_linen(model, abstract_args, init_args)
    if nnx is not None and isinstance(model, nnx.Module):
        if init_inputs is not None:
            raise TypeError(
                "init_inputs= is for linen models (model.init's inputs); an nnx module holds its "
                "variables already. Remedy: size its cache on the module before partition(), e.g. "
                "model.init_cache(...) (nnx.MultiHeadAttention), and drop init_inputs.")
        return _trace_nnx(model, abstract_args)
    raise TypeError(
        f"axonn_jax.partition expects a flax.linen.Module or flax.nnx.Module, got "
        f"{type(model).__name__}. Remedy: wrap plain functions in a linen Module."
    )


_UNBOUND = re.compile(r"unbound axis name: (\S+?)\.?(?:\s|$)")


def unbound_axis_name(err: Exception) -> str | None:
    """The axis name of JAX's "unbound axis name" error, else None.

    Example:
        >>> unbound_axis_name(NameError("Found an unbound axis name: batch. To fix this, ..."))
        'batch'
    """
    found = _UNBOUND.search(str(err))
    return found.group(1) if found else None


@contextlib.contextmanager
def bound_axis_names(names):
    """Trace with the model's own collective axis ``names`` bound, each of size 1.

    A collective over them is then the identity of the one-device model: a
    ``pmean`` over ``'batch'`` of a mean taken over the whole batch. (JAX's
    ``make_jaxpr(axis_env=...)`` context, opened for every trace inside.)
    """
    if not names:
        yield
        return
    from jax._src import core as jax_core

    with jax_core.extend_axis_env_nd([(name, 1) for name in names]):
        yield


def _binding(fn: Callable, names) -> Callable:
    def bound(*args, **kwargs):
        with bound_axis_names(names):
            return fn(*args, **kwargs)

    return bound


#: keyword arguments of ``model.apply`` (not of the model's ``__call__``)
APPLY_KWARGS = ("rngs", "mutable", "capture_intermediates")

#: collections a linen call only writes (``sow``, ``capture_intermediates``): no model state,
#: a call starts without them (as nnx's ``nnx.Intermediate``), so ``model.init``'s are dropped
OUTPUT_COLLECTIONS = ("intermediates",)


def _split_apply_kwargs(kwargs: dict) -> tuple[dict, dict]:
    call = {k: v for k, v in kwargs.items() if k not in APPLY_KWARGS}
    check_rngs(kwargs.get("rngs"))
    return call, {k: kwargs[k] for k in APPLY_KWARGS if k in kwargs}


def unbox(tree):
    """``tree`` with linen's metadata boxes (``nn.with_partitioning``, ``nn.with_logical_partitioning``:
    ``nn.Partitioned``) replaced by their values, as ``model.apply`` reads them; the plan lays
    out every parameter itself.

    >>> unbox({"w": flax_meta.Partitioned(jnp.ones(2), names=("mlp",))})
    {'w': Array([1., 1.], dtype=float32)}
    """
    return flax_meta.unbox(tree)


def check_rngs(rngs) -> None:
    """Refuse ``rngs`` that are not a dict of named streams, naming the remedy.

    Flax also takes one bare key (as ``{'params': key}``, the other streams folded
    from it); here each stream is an input of its own, so it is named:

        >>> check_rngs(jax.random.key(0))  # doctest: +SKIP
        TypeError: rngs must be a dict of named RNG streams ... rngs={'dropout': key}
    """
    if rngs is not None and not isinstance(rngs, Mapping):
        raise TypeError(
            f"rngs must be a dict of named RNG streams, got "
            f"{'one key' if hasattr(rngs, 'dtype') else 'a ' + type(rngs).__name__} (Flax reads one "
            "bare key as {'params': key}). Remedy: name the streams the model draws, e.g. "
            "rngs={'dropout': key}, in the call given to partition() and in later calls."
        )


def _trace_linen(model, abstract_args, init_args: tuple | None = None) -> TracedModel:
    args, kwargs = abstract_args
    call_kwargs, apply_kwargs = _split_apply_kwargs(kwargs)
    streams = sorted(apply_kwargs.get("rngs") or {})
    init_args = args if init_args is None else init_args

    def init_variables(key):
        if isinstance(key, Mapping):  # linen's {'params': key, 'dropout': key, ...}
            keys = dict(key)
        else:  # as model.init(key): the params stream's key, the others derived from it
            keys = {"params": key, **dict(zip(streams, jax.random.split(key, len(streams))))}
        full = unbox(model.init(keys, *args_like(init_args), **args_like(call_kwargs)))
        return {k: v for k, v in full.items() if k not in OUTPUT_COLLECTIONS}

    with _linen_remedies():
        variables = jax.eval_shape(init_variables, jax.random.key(0))
    stateful = set(variables) != {"params"}

    def init(key):
        full = init_variables(key)
        return full if stateful else full["params"]

    def apply(tree, *call_args, **kw):
        kw, extra = _split_apply_kwargs(kw)
        return model.apply(tree if stateful else {"params": tree}, *call_args, **extra, **kw)

    params = variables if stateful else variables["params"]
    returns_updates = bool(apply_kwargs.get("mutable"))
    with _linen_remedies():
        return _finish("linen", params, abstract_args, apply, init, returns_updates=returns_updates)


@contextlib.contextmanager
def _linen_remedies():
    """Flax's errors about missing RNG streams and immutable state, with the remedy here."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - re-raised with the remedy, or as it was
        kind = type(err).__name__
        if kind == "InvalidRngError":
            raise ValueError(
                f"{err}. Remedy: pass the RNG streams the model draws in the call given to "
                "partition(), e.g. partition(model, grid, x, rngs={'dropout': key}) (a "
                "jax.random.key or its ShapeDtypeStruct), and the same rngs= to every call (pm.apply, "
                "a step from pm.value_and_grad or pm.train_step: step(params, batch, rngs=...))."
            ) from err
        if kind == "ModifyScopeVariableError":
            raise ValueError(
                f"{err}. Remedy: the call updates model state (train mode): pass "
                "mutable=['batch_stats'] (the collections it updates) to partition() and "
                "pm.apply, as with model.apply; pm.value_and_grad and pm.train_step do it for you."
            ) from err
        raise


def args_like(tree):
    """Zeros shaped like ShapeDtypeStructs (for init only; never full model params)."""
    return jax.tree.map(lambda a: a if is_static(a) else jnp.zeros(a.shape, a.dtype), tree)


def _trace_nnx(model, abstract_args) -> TracedModel:
    from flax import nnx

    # values stored with sow (nnx.Intermediate) are not state: a call starts without them
    graphdef, params, stored, rest = nnx.split(model, nnx.Param, nnx.Intermediate, ...)
    stateful = bool(jax.tree.leaves(nnx.to_pure_dict(rest)))
    sown: list[str] = []  # what the traced call stores with sow

    def current_values():
        """The module's values now (weights loaded after partition() included)."""
        _, now, _, now_rest = nnx.split(model, nnx.Param, nnx.Intermediate, ...)
        if not stateful:
            return nnx.to_pure_dict(now)
        return {"params": nnx.to_pure_dict(now),
                "state": jax.tree.map(_key_data, nnx.to_pure_dict(now_rest))}  # fmt: skip
    key_impls = {path_string(p): jax.random.key_impl(v)
                 for p, v in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(rest))[0]
                 if _is_key(v)}  # fmt: skip

    def apply(tree, *call_args, **call_kwargs):
        param_state, rest_state = nnx.clone(params), nnx.clone(rest)
        nnx.replace_by_pure_dict(param_state, tree["params"] if stateful else tree)
        if stateful:
            nnx.replace_by_pure_dict(rest_state, _wrap_keys(tree["state"], key_impls))
        module = nnx.merge(graphdef, param_state, nnx.clone(stored), rest_state)
        nnx.pop(module, nnx.Intermediate)
        out = module(*call_args, **call_kwargs)
        sown[:] = sorted({path_string(p).rsplit("/", 1)[0] for p, _ in
                          jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.pop(module, nnx.Intermediate)))[0]})
        if not stateful:
            return out
        _, _, new_rest = nnx.split(module, nnx.Param, ...)
        return out, {"state": jax.tree.map(_key_data, nnx.to_pure_dict(new_rest))}

    def init(key):
        del key  # an nnx module already carries its values: those it holds when init is called
        return current_values()

    abstract_params = jax.tree.map(abstract, current_values())
    traced = _finish("nnx", abstract_params, abstract_args, apply, init, returns_updates=stateful)
    keys = {f"state/{path}" for path in key_impls}
    notes = (f"the model stores {', '.join(sown)} with sow (nnx.Intermediate); pm.apply returns the "
             "model's outputs and state, not values kept on the module: return them from __call__ to "
             "get them",) if sown else ()  # fmt: skip
    return dataclasses.replace(traced, notes=notes, rng_state=frozenset(
        i for i, path in enumerate(traced.param_paths) if path in keys))


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _key_data(x):
    """A typed PRNG key as its raw ``uint32`` data (placed, gathered and saved like any array)."""
    return jax.random.key_data(x) if _is_key(x) else x


def _wrap_keys(tree, impls: dict):
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [jax.random.wrap_key_data(v, impl=impls[path_string(p)]) if path_string(p) in impls
              else v for p, v in flat]  # fmt: skip
    return jax.tree.unflatten(treedef, leaves)


def _finish(kind, params, abstract_args, apply, init, *, returns_updates: bool) -> TracedModel:
    leaves_with_path, param_tree = jax.tree_util.tree_flatten_with_path(params)
    paths = tuple(path_string(p) for p, _ in leaves_with_path)
    stateful = isinstance(params, dict) and "params" in params and len(params) > 1
    trainable = tuple(not stateful or p.startswith("params/") for p in paths)
    param_avals = tuple(abstract(v) for _, v in leaves_with_path)
    all_arg_leaves, arg_tree = jax.tree.flatten(abstract_args)
    static = tuple((i, x) for i, x in enumerate(all_arg_leaves) if is_static(x))
    arg_leaves = [x for x in all_arg_leaves if not is_static(x)]
    rng_args = frozenset(j for j, key in enumerate(_rng_leaf_flags(abstract_args)) if key)
    out_store = {}

    def flat_fn(*leaves):
        p = jax.tree.unflatten(param_tree, leaves[: len(param_avals)])
        dynamic = iter(leaves[len(param_avals) :])
        fixed = dict(static)
        full = [fixed[i] if i in fixed else next(dynamic) for i in range(len(all_arg_leaves))]
        call_args, call_kwargs = jax.tree.unflatten(arg_tree, full)
        out = apply(p, *call_args, **call_kwargs)
        with_path, out_store["tree"] = jax.tree_util.tree_flatten_with_path(out)
        out_store["paths"] = [path_string(q) for q, _ in with_path]
        return [v for _, v in with_path]

    closed = jax.make_jaxpr(flat_fn)(*param_avals, *arg_leaves)
    state_outputs = ()
    if returns_updates:  # (outputs, updates): updates mirror the variables' paths
        index = {path: i for i, path in enumerate(paths)}
        state_outputs = tuple((k, index[q[2:]]) for k, q in enumerate(out_store["paths"])
                              if q.startswith("1/") and q[2:] in index)  # fmt: skip
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
        trainable=trainable,
        state_outputs=state_outputs,
        rng_args=rng_args,
    )


def retrace(traced: TracedModel, args: tuple, kwargs: dict) -> TracedModel:
    """``traced``'s model called on other inputs, with the variables it was traced with.

    The model is not initialised again, nor read again: the call runs as traced at
    ``partition()``, with the variables' shapes of then (a linen cache sized for the
    example's maximum length serves a prefill and one-token decode steps, as
    ``model.apply`` does) and, for nnx, its graph of then (``model.eval()`` after
    ``partition()`` changes neither that model's programs nor those of new shapes).

    Example:
        >>> retrace(trace_model(model, x), (x[:4],), {}).arg_avals  # doctest: +SKIP
        (ShapeDtypeStruct(shape=(4, 16), dtype=float32),)
    """
    if traced.kind == "linen":
        returns_updates = bool(_split_apply_kwargs(kwargs)[1].get("mutable"))
    else:  # an nnx call returns its state's updates where it has state
        returns_updates = traced.has_state
    params = jax.tree.unflatten(traced.param_tree, list(traced.param_avals))
    abstract_args = abstract_call(args, kwargs)
    with bound_axis_names(traced.axis_names), _linen_remedies():
        again = _finish(traced.kind, params, abstract_args, traced.apply, traced.init,
                        returns_updates=returns_updates)  # fmt: skip
    return dataclasses.replace(again, rng_state=traced.rng_state, axis_names=traced.axis_names,
                               notes=traced.notes)  # fmt: skip


def trace_composite(traced: TracedModel, fn: Callable, args: tuple, kwargs: dict, *,
                    returns_updates: bool) -> TracedModel:
    """Trace ``fn(variables, *args, **kwargs)``, a function of ``traced``'s variables (the model
    inside it, e.g. a loss of its outputs), as a model of the same parameters.

    ``args``/``kwargs`` are arrays or ShapeDtypeStructs (Python scalars baked in);
    the model's own collective axis names stay bound while tracing and calling.
    """
    params = jax.tree.unflatten(traced.param_tree, list(traced.param_avals))
    abstract_args = abstract_call(args, kwargs)
    with bound_axis_names(traced.axis_names):
        composite = _finish(traced.kind, params, abstract_args, fn, traced.init,
                            returns_updates=returns_updates)  # fmt: skip
    return dataclasses.replace(composite, rng_state=traced.rng_state, axis_names=traced.axis_names,
                               apply=_binding(fn, traced.axis_names))  # fmt: skip


def _rng_leaf_flags(abstract_args) -> list[bool]:
    """Per array leaf of the call: is it an RNG key (typed, or under ``rngs=``)?"""
    flags = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_args)[0]:
        if is_static(leaf):
            continue
        under_rngs = len(path) > 1 and path[0] == jax.tree_util.SequenceKey(1) and \
            getattr(path[1], "key", None) == "rngs"  # fmt: skip
        flags.append(under_rngs or _is_key(leaf))
    return flags


def inline_calls(closed) -> Any:
    """Flatten nested ``jit``/``pjit``/``custom_jvp``/``custom_vjp``/``remat`` calls.

    Returns a new ClosedJaxpr whose equations are primitives only, except
    pointwise custom-JVP calls such as ``jax.nn.relu``, kept whole so that
    their derivative rule survives (:mod:`~axonn_jax.partitioner.pointwise`).
    Control flow (``scan``/``while``/``cond``) stays one equation whose bodies
    are inlined the same way. Concatenations are then taken apart where what
    reads them works piece by piece (:func:`~axonn_jax.partitioner.concats.take_apart`).
    """
    from axonn_jax.partitioner.concats import take_apart

    with bound_axis_names(collective_axis_names(closed.jaxpr)):
        inlined = jax.make_jaxpr(lambda *a: _eval_inlined(closed.jaxpr, closed.consts, a))(
            *[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
        )
        return take_apart(inlined)


def collective_axis_names(jaxpr) -> tuple:
    """The axis names the collectives of ``jaxpr`` (nested calls included) reduce over."""
    names: list = []
    for eqn in jaxpr.eqns:
        key = {**COLLECTIVE_AXES, **OTHER_COLLECTIVES}.get(eqn.primitive.name)
        if key is not None:
            axes = eqn.params[key]
            names.extend(a for a in (axes if isinstance(axes, tuple) else (axes,)) if a not in names)
        for inner in subjaxprs(eqn):
            names.extend(a for a in collective_axis_names(inner) if a not in names)
    return tuple(names)

def inlined_body(eqn) -> tuple | None:
    """``(jaxpr, consts)`` of a call that :func:`inline_calls` flattens, else None."""
    return None if keeps_whole(eqn) else call_body(eqn)


def _eval_inlined(jaxpr, consts, args, outer=None):
    """Evaluate ``jaxpr`` with nested calls flattened; ``outer``: the source of the call."""
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
        source = _user_source(eqn, outer)
        if inner is not None:
            inner_jaxpr, inner_consts = inner
            outs = _eval_inlined(inner_jaxpr, inner_consts, invals[-len(inner_jaxpr.invars) :],
                                 source)  # fmt: skip
        else:  # a primitive, or a call kept whole (partitioner.pointwise)
            params = eqn.params
            if eqn.primitive.name in CONTROL_FLOW:  # one equation, its bodies inlined
                params = with_subjaxprs(eqn, inline_calls)
            with source_context(source):  # warnings then name the model's line, not this one
                outs = _rewritten(eqn, invals)
                if outs is None:
                    outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for var, val in zip(eqn.outvars, outs):
            env[var] = val
    return [read(v) for v in jaxpr.outvars]


#: a model's own layout requests (``jax.lax.with_sharding_constraint``, Flax's logical
#: constraints under a mesh): dropped, the plan lays out every value (their meshes and
#: specs name axes that are not the grid's)
_LAYOUT_HINTS = frozenset(["sharding_constraint"])

#: the reduction a collective is over array dims
_ARRAY_REDUCTIONS = {"psum": jnp.sum, "pmax": jnp.max, "pmin": jnp.min}


def _rewritten(eqn, invals: list):
    """What the plan runs in place of ``eqn`` (its results as ``bind`` returns them), or
    ``None`` to run it as it is: a model's own layout request dropped, a collective over
    array dims as the reduction it is (:func:`_over_array_dims`)."""
    if eqn.primitive.name in _LAYOUT_HINTS:
        return invals[0]
    return _over_array_dims(eqn, invals)


def _over_array_dims(eqn, invals: list):
    """A ``psum``/``pmax``/``pmin`` that reduces array dims too, as a reduction over them
    (then the collective over its named axes, if any), its results as ``bind`` returns
    them; ``None`` for any other equation.

    ``jax.vmap(..., axis_name='ens')`` (and ``nn.vmap``) turn a collective over the mapped
    name into one over the mapped dim (``psum(x, 'ens')`` → ``psum[axes=(0,)]``): a real
    sum of the members, which the rules plan as one (the model's named collectives are the
    identity of the one-device model, :func:`bound_axis_names`).

    >>> f = jax.vmap(lambda r: jax.lax.psum(r, "ens"), axis_name="ens")
    >>> jax.make_jaxpr(lambda x: _eval_inlined(jax.make_jaxpr(f)(x).jaxpr, (), [x]))(jnp.ones((4, 3))).eqns[0].primitive
    reduce_sum
    """
    reduce = _ARRAY_REDUCTIONS.get(eqn.primitive.name)
    axes = eqn.params.get("axes", ()) if reduce is not None else ()
    dims = tuple(a for a in axes if isinstance(a, int))
    if not dims:
        return None
    reduced = [reduce(x, axis=dims) for x in invals]
    named = tuple(a for a in axes if not isinstance(a, int))
    if named:
        reduced = eqn.primitive.bind(*reduced, **eqn.primitive.get_bind_params({**eqn.params, "axes": named}))
        reduced = reduced if eqn.primitive.multiple_results else [reduced]
    return reduced if eqn.primitive.multiple_results else reduced[0]


def _user_source(eqn, outer):
    """``eqn``'s source info if it names a user frame, else that of the call it sits in."""
    try:
        from jax._src import source_info_util

        info = eqn.source_info
        if outer is None or source_info_util.user_frame(info.traceback) is not None:
            return info
        return outer
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - other JAX versions
        return None


def user_line(info) -> str | None:
    """``file:line`` of the user frame in ``info``'s traceback (None when unknown)."""
    try:
        from jax._src import source_info_util

        frame = source_info_util.user_frame(info.traceback) if info is not None else None
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - other JAX versions
        return None
    return None if frame is None else f"{frame.file_name.rsplit('/', 1)[-1]}:{frame.start_line}"


def source_context(info):
    """Trace under ``info``'s traceback and name stack (JAX-internal API; best effort)."""
    try:
        from jax._src import source_info_util

        return source_info_util.user_context(info.traceback, name_stack=info.name_stack)
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - other JAX versions
        return contextlib.nullcontext()
