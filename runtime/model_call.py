"""How training calls the model: keyword flags, RNG streams and model state.

A model with state (BatchNorm statistics, nnx RNG counters) is handled as a
variables dict ``{'params': ..., <collections>: ...}``: only ``params`` is
differentiated; the other collections are inputs of the call and come back
updated (linen ``mutable=[...]``). RNG streams are keys passed as
``rngs={'dropout': key}``; with several microbatches, microbatch ``m`` draws
from ``jax.random.fold_in(key, m)`` (so one microbatch is exactly the plain
``model.apply(..., rngs=...)``).

Example:
    >>> call = ModelCall(static_kwargs={"train": True}, stateful=False, mutable=())
    >>> call.kwargs(None, 0, 1)
    {'train': True}
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax.core.scope import in_filter

from axonn_jax.partitioner.provenance import user_frame
from axonn_jax.partitioner.trace import APPLY_KWARGS, TracedModel, check_rngs, is_static, unbox


@dataclasses.dataclass(frozen=True)
class ModelCall:
    """The fixed part of every training call of the model."""

    static_kwargs: Mapping[str, Any]  # the flags given to partition() (e.g. train=True)
    stateful: bool  # the variables are {'params': ..., <state collections>: ...}
    mutable: tuple[str, ...]  # linen collections returned updated (nnx: always all)
    rng_state: bool = False  # nnx RNG streams live in the state (one key per call)
    keywords: tuple[str, ...] = ()  # the array keyword inputs of the example call (e.g. inputs=)

    @classmethod
    def of(cls, traced: TracedModel) -> ModelCall:
        _, kwargs = traced.example_call()
        static = {k: v for k, v in kwargs.items() if k not in APPLY_KWARGS and is_static(v)}
        keywords = tuple(k for k in kwargs if k not in APPLY_KWARGS and not is_static(kwargs[k]))
        stateful = traced.has_state
        mutable = ()
        if stateful and traced.kind == "linen":
            mutable = tuple(sorted({p.split("/")[0] for p in traced.param_paths} - {"params"}))
        return cls(static, stateful, mutable, rng_state=bool(traced.rng_state), keywords=keywords)

    def check_microbatches(self, microbatches: int) -> None:
        """nnx RNG streams draw one key per call: microbatches would share their dropout masks."""
        if self.rng_state and microbatches > 1:
            raise ValueError(
                f"the nnx model draws random numbers from RNG streams in its state (nnx.Rngs, "
                f"e.g. nnx.Dropout), which advance once per call, so its {microbatches} "
                "microbatches would all use the same dropout masks. Remedy: microbatches=1, or "
                "a linen model with rngs={'dropout': key} (a key per microbatch is derived)."
            )

    def kwargs(self, rngs: Mapping[str, jax.Array] | None, microbatch, microbatches: int) -> dict:
        """Keyword arguments of the model call for one microbatch."""
        check_rngs(rngs)
        kw = dict(self.static_kwargs)
        if rngs:
            kw["rngs"] = microbatch_rngs(rngs, microbatch, microbatches)
        if self.mutable:
            kw["mutable"] = list(self.mutable)
        return kw

    def of_inputs(self, given, rngs: Mapping[str, jax.Array] | None, microbatch,
                  microbatches: int) -> tuple[tuple, dict]:  # fmt: skip
        """The model call ``(args, kwargs)`` of one microbatch from what ``inputs(batch)`` returned.

        Example:
            >>> call.of_inputs({"inputs": x}, None, 0, 1)  # doctest: +SKIP
            ((), {'train': True, 'inputs': x})
        """
        args, keywords = model_inputs(given)
        return args, call_kwargs(keywords, self.kwargs(rngs, microbatch, microbatches))

    def split(self, variables) -> tuple[Any, dict | None]:
        """``(params, state)``: the trainable tree and the other collections."""
        if not self.stateful:
            return variables, None
        return variables["params"], {k: v for k, v in variables.items() if k != "params"}

    def merge(self, params, state: dict | None):
        return params if state is None else {"params": params, **state}

    def outputs(self, result) -> tuple[Any, dict | None]:
        """``(model outputs, state updates)`` of one call."""
        return result if self.stateful else (result, None)


def model_inputs(given) -> tuple[tuple, dict]:
    """What ``inputs(batch)`` returned, as the model call's ``(args, kwargs)``.

    A tuple (or list) gives positional arguments, a dict keyword arguments
    (every parameter that is not positional-only can be passed by name, so a
    dict also covers calls that mix both), anything else one positional argument.

    Example:
        >>> model_inputs({"inputs": 1})
        ((), {'inputs': 1})
        >>> model_inputs((1, 2))
        ((1, 2), {})
    """
    if isinstance(given, Mapping):
        return (), dict(given)
    if isinstance(given, (tuple, list)):
        return tuple(given), {}
    return (given,), {}


def call_kwargs(inputs: Mapping, fixed: Mapping) -> dict:
    """The keyword inputs of a microbatch joined to the call's fixed keywords (flags, ``rngs``, ``mutable``).

    A name in both is refused: the batch would silently override a flag given
    to ``partition()`` (or the reverse).
    """
    clash = sorted(set(inputs) & set(fixed))
    if clash:
        raise ValueError(
            f"inputs(batch) returned keyword input(s) {clash} that the call already sets "
            f"({sorted(fixed)}: flags given to partition(), rngs, mutable). Remedy: rename the "
            "entries that inputs= returns, or drop the flag from partition()."
        )
    return {**fixed, **inputs}


def warn_unseen_intermediates(traced: TracedModel) -> None:
    """Warn that a training call does not return what the example call stored with ``sow``
    (or captured): the loss gets the model's outputs, as ``loss_fn(outputs, batch)`` says."""
    _, kwargs = traced.example_call()
    if traced.kind == "linen" and (kwargs.get("capture_intermediates")
                                   or in_filter(kwargs.get("mutable", False), "intermediates")):  # fmt: skip
        warnings.warn(
            "pm.value_and_grad and pm.train_step call the model without mutable=['intermediates']: "
            "the values it stores with sow (or captures) are neither given to the loss nor returned; "
            "the loss gets the model's outputs. Remedy: return what the loss needs from __call__ "
            "(e.g. `return logits, aux_loss`, then `loss_fn((logits, aux), batch)`), or call "
            "pm.apply(..., mutable=['intermediates']) in your own jitted step (one mesh).",
            stacklevel=user_frame()[1])  # fmt: skip


def unwrap_params(tree, param_tree) -> tuple[Any, bool]:
    """``tree`` as a plan holds it, and whether it came as the linen variables dict ``{'params': tree}``.

    A model with state is planned over its whole variables dict; a model
    without state over its params, which linen users also pass wrapped. Empty
    collections beside ``params`` are dropped, as ``model.apply`` ignores them, and
    linen's metadata boxes (``nn.Partitioned``) unboxed.

    Example:
        >>> unwrap_params({"params": {"w": 1}, "batch_stats": {}}, jax.tree.structure({"w": 0}))
        ({'w': 1}, True)
    """
    tree = unbox(tree)  # linen's metadata boxes (nn.with_partitioning): the values, as planned
    if not (isinstance(tree, Mapping) and "params" in tree):
        return tree, False
    kept = {k: v for k, v in tree.items() if k == "params" or jax.tree.leaves(v)}
    if set(kept) == {"params"} and jax.tree.structure(kept["params"]) == param_tree:
        return kept["params"], True
    if len(kept) < len(tree) and jax.tree.structure(kept) == param_tree:
        return kept, False
    return tree, False


def state_collections(param_tree) -> list[str]:
    """The collections besides ``params`` of a model planned with state (``[]`` without state).

    Example:
        >>> state_collections(jax.tree.structure({"params": {"w": 0}, "batch_stats": {"m": 0}}))
        ['batch_stats']
    """
    full = jax.tree.unflatten(param_tree, [0] * param_tree.num_leaves)
    if not (isinstance(full, Mapping) and "params" in full and len(full) > 1):
        return []
    return sorted(k for k in full if k != "params")


def is_params_of_state(tree, param_tree) -> bool:
    """Whether ``tree`` is the ``params`` collection alone of a model planned with state.

    Such a model is planned (and runs) over its whole variables dict
    ``{'params': ..., 'batch_stats': ...}``; optimizers see ``params`` only.
    ``None`` leaves (other processes' pipeline stages) count as leaves.

    Example:
        >>> plan_tree = jax.tree.structure({"params": {"w": 0}, "batch_stats": {"m": 0}})
        >>> is_params_of_state({"w": 1.0}, plan_tree)
        True
    """
    if not state_collections(param_tree):
        return False
    params = jax.tree.unflatten(param_tree, [0] * param_tree.num_leaves)["params"]
    return jax.tree.structure(tree, is_leaf=lambda x: x is None) == jax.tree.structure(params)


def wrap_params(tree, wrapped: bool):
    """``tree`` in the form :func:`unwrap_params` found it in."""
    return {"params": tree} if wrapped else tree


def check_differentiable(params: Sequence) -> None:
    """Refuse trainable parameters that ``jax.grad`` cannot differentiate (integer, bool).

    ``params`` are the plan's ``ParamPlan`` entries. Plain Flax + optax fail on such a
    leaf too (``grad requires real-valued inputs``), and quietly freezing it could hide
    a parameter loaded with the wrong dtype, so the step refuses it by name:

        >>> check_differentiable(pm.plan.params)  # doctest: +SKIP
        TypeError: parameter 'count' is int32[] but gradients need floating-point parameters ...
    """
    bad = [p for p in params if p.trainable and not jnp.issubdtype(p.dtype, jnp.inexact)]
    if not bad:
        return
    named = ", ".join(f"{p.path!r} {p.dtype}{list(p.shape)}" for p in bad[:5])
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    raise TypeError(
        f"parameter {named}{more} is not floating-point, but gradients (jax.grad, and so "
        "pm.value_and_grad / pm.train_step) need floating-point trainable parameters. Remedy: "
        "keep integer values out of the 'params' collection so that they are carried as model "
        "state and not trained - in linen self.variable('state', name, init) instead of "
        "self.param, in nnx an nnx.Variable instead of nnx.Param - or make the parameter a "
        "float (e.g. .astype(jnp.float32)) if it should be trained."
    )


def microbatch_rngs(rngs: Mapping[str, jax.Array], microbatch, microbatches: int) -> Mapping:
    """The RNG keys of one microbatch: ``rngs`` itself for one, ``fold_in(key, mb)`` for several.

    Example:
        >>> keys = microbatch_rngs({"dropout": jax.random.key(0)}, 1, 2)  # fold_in(key, 1)
    """
    if microbatches == 1:
        return rngs
    return {name: jax.random.fold_in(key, microbatch) for name, key in rngs.items()}


def mean_updates(updates: list[dict]) -> dict:
    """State updates of several microbatches: floats averaged, others from the last one.

    For BatchNorm's running mean this equals the update of the whole batch;
    the variance averages the microbatches' variances (each microbatch is
    normalised with its own statistics, as in plain gradient accumulation).
    """
    if len(updates) == 1:
        return updates[0]

    def combine(*xs):
        if jnp.issubdtype(xs[0].dtype, jnp.floating):
            return sum(xs[1:], xs[0]) / len(xs)
        return xs[-1]

    return jax.tree.map(combine, *updates)
