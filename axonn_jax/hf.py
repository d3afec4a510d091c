"""HuggingFace ``transformers`` Flax weights in and out of a partitioned model.

Three calls, all with local directories (nothing is downloaded):

* :func:`module`: the linen module a ``save_pretrained`` directory describes
  (its ``config.json``), to hand to :func:`axonn_jax.partition`;
* :func:`load`: that directory's weights placed in ``pm``'s layout on any
  grid (with a pipeline, each process keeps its stages' shards);
* :func:`save_pretrained`: trained weights back to a directory that
  ``FlaxXxx.from_pretrained`` reads: the float32 masters when the step keeps
  them (``precision="bf16"``, ``offload=True``), every pipeline stage;
  process 0 writes.

``transformers`` (4.x: v5 dropped Flax) is optional: ``pip install 'axonn_jax[hf]'``.

Example::

    from axonn_jax import hf

    model = hf.module("gpt2-small/")                  # FlaxGPT2LMHeadModule of its config
    pm = axonn_jax.partition(model, Grid(x=2, z=2), tokens, mask, positions)
    params = hf.load(pm, "gpt2-small/")               # sharded; no device holds the whole model
    ...                                               # train
    hf.save_pretrained(pm, "gpt2-tuned/", params, opt_state)
    FlaxGPT2LMHeadModel.from_pretrained("gpt2-tuned/")
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from axonn_jax.partitioned import Partitioned
from axonn_jax.partitioner.trace import path_string
from axonn_jax.runtime import collectives, launch

#: how many names an error lists before "…"
_SHOWN = 5


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "axonn_jax.hf needs HuggingFace transformers 4.x with Flax (v5 dropped Flax). "
            "Remedy: pip install 'axonn_jax[hf]' (or pip install 'transformers>=4.57,<5')."
        ) from None
    return transformers


def module(directory: str | os.PathLike, model_class: type | None = None, **kwargs):
    """The linen module of the model saved in ``directory`` (config only; no weights read).

    The class is ``model_class`` (e.g. ``FlaxGPT2LMHeadModel``) or the Flax
    class named by the config's ``architectures`` (what ``save_pretrained``
    writes). ``kwargs`` go to the class (e.g. ``dtype=jnp.bfloat16`` to compute
    in bf16).

    Example:
        >>> model = module("gpt2-small/")      # doctest: +SKIP
        >>> type(model).__name__              # doctest: +SKIP
        'FlaxGPT2LMHeadModule'
    """
    hf = _transformers()
    config = hf.AutoConfig.from_pretrained(directory, local_files_only=True)
    cls = model_class or _class_of_config(hf, config, directory)
    return cls(config, _do_init=False, **kwargs).module


def load(pm: Partitioned, directory: str | os.PathLike, model_class: type | None = None):
    """The weights saved in ``directory``, placed in ``pm``'s layout (``pm.shard``).

    Every process reads the files (``FlaxXxx.from_pretrained(..., _do_init=False)``:
    msgpack, safetensors and sharded checkpoints) into host memory and keeps
    only its shards (its stages' with a pipeline). Floating weights take the
    dtype the model was planned with. ``model_class`` defaults to the Flax
    class whose module ``pm`` partitions.

    Raises:
        ValueError: names or shapes in ``directory`` differ from the plan (listed).

    Example:
        >>> params = load(pm, "gpt2-small/")   # doctest: +SKIP
    """
    cls = model_class or model_class_of(pm.model)
    _, weights = cls.from_pretrained(directory, _do_init=False, local_files_only=True)
    weights = _as_planned(pm, weights, directory)
    return pm.shard(weights)


def save_pretrained(pm: Partitioned, directory: str | os.PathLike, params, opt_state=None, *,
                    model_class: type | None = None, **save_kwargs) -> None:  # fmt: skip
    """Write trained weights as ``FlaxXxx.save_pretrained`` does (config and weights).

    Collective: every process calls it. The weights are ``pm.gather(params,
    opt_state)``: the float32 master weights when ``opt_state`` (of
    ``pm.train_step(...)``) keeps them, every pipeline stage whichever process
    holds it; process 0 writes, and all return once the files are complete.
    Half-precision parameters without their masters are refused (writing them
    would lose precision silently). ``save_kwargs`` go to ``save_pretrained``
    (``safe_serialization=True``, ``max_shard_size=...``).

    Example:
        >>> save_pretrained(pm, "gpt2-tuned/", params, opt_state)   # doctest: +SKIP
        >>> FlaxGPT2LMHeadModel.from_pretrained("gpt2-tuned/")      # doctest: +SKIP
    """
    cls = model_class or model_class_of(pm.model)
    # the plan's own tree: the params dict (or a stateful model's variables), as from_pretrained holds it
    full = jax.tree.unflatten(pm.plan.param_tree, jax.tree.leaves(pm.gather(params, opt_state)))
    _check_full_precision(pm, full)
    if launch.process_info().is_main:
        model = cls(copy.deepcopy(pm.model.config), dtype=pm.model.dtype, _do_init=False)
        model.save_pretrained(directory, params=full, **save_kwargs)
    comm = collectives.world()
    if comm is not None:  # the files are complete on every process's return
        comm.barrier()


def model_class_of(linen_module) -> type:
    """The ``transformers`` Flax model class whose ``module_class`` is ``type(linen_module)``.

    Example:
        >>> model_class_of(FlaxGPT2LMHeadModule(config)).__name__   # doctest: +SKIP
        'FlaxGPT2LMHeadModel'
    """
    hf = _transformers()
    kind = type(linen_module)
    found = [cls for cls in vars(sys.modules[kind.__module__]).values()
             if isinstance(cls, type) and issubclass(cls, hf.FlaxPreTrainedModel)
             and getattr(cls, "module_class", None) is kind]  # fmt: skip
    if not found or not hasattr(linen_module, "config"):
        raise TypeError(
            f"{kind.__module__}.{kind.__name__} is not the module of a transformers Flax model. "
            "Remedy: partition the module of a transformers model (axonn_jax.hf.module(directory) "
            "or FlaxXxx(config).module), or pass model_class=FlaxXxx."
        )
    return found[0]


def _class_of_config(hf, config, directory) -> type:
    names = [f"Flax{name}" for name in (config.architectures or [])]
    for name in names:
        if hasattr(hf, name):
            return getattr(hf, name)
    raise ValueError(
        f"{directory}: config.json names architectures {config.architectures}, and transformers "
        f"has no Flax class {' or '.join(names) or '(none named)'}. Remedy: pass "
        "model_class=FlaxXxx (the Flax class of this model)."
    )


def _as_planned(pm: Partitioned, weights, directory) -> Any:
    """``weights`` checked against the plan (names, shapes) and cast to its floating dtypes."""
    plan = pm.plan
    found = {path_string(k): v for k, v in jax.tree_util.tree_flatten_with_path(weights)[0]}
    planned = {p.path: p for p in plan.params}
    missing = [p for p in planned if p not in found]
    unexpected = [p for p in found if p not in planned]
    shapes = [f"'{p}' {tuple(np.shape(found[p]))} in the files, {planned[p].shape} planned"
              for p in planned if p in found and tuple(np.shape(found[p])) != planned[p].shape]  # fmt: skip
    if missing or unexpected or shapes:
        raise ValueError(
            f"the weights in {os.fspath(directory)} do not fit the model partitioned for "
            f"{plan.grid} ({type(pm.model).__name__}): missing {_some(missing)}, unexpected "
            f"{_some(unexpected)}, other shapes {_some(shapes)}. Remedy: partition the module "
            f"of that directory's config: axonn_jax.partition(axonn_jax.hf.module(directory), ...)."
        )
    leaves = []
    for p in plan.params:
        value = np.asarray(found[p.path])
        if jnp.issubdtype(value.dtype, jnp.floating):
            value = value.astype(np.dtype(p.dtype))
        leaves.append(value)
    return jax.tree.unflatten(plan.param_tree, leaves)


def _check_full_precision(pm: Partitioned, full) -> None:
    for (path, value), p in zip(jax.tree_util.tree_flatten_with_path(full)[0], pm.plan.params):
        if np.dtype(value.dtype) != np.dtype(p.dtype):
            raise ValueError(
                f"parameter '{path_string(path)}' is {np.dtype(value.dtype)} on the device and the "
                f"model was planned in {np.dtype(p.dtype)} ({pm.plan.grid}); writing it would drop "
                "precision. Remedy: pass the step's opt_state, which holds the float32 masters: "
                "hf.save_pretrained(pm, directory, params, opt_state)."
            )


def _some(names: list[str]) -> str:
    if not names:
        return "none"
    return ", ".join(names[:_SHOWN]) + (f", … ({len(names)} in all)" if len(names) > _SHOWN else "")
