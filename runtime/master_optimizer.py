"""Master weights and optimizer state on the device or in host memory.

:class:`MasterOptimizer` wraps any ``optax.GradientTransformation``. The device
keeps the parameters in the precision's dtype (bf16/fp16/fp32) and receives
gradients in that dtype; float32 master weights and the optimizer's state live

* on the device (``offload=False``): one code path for plain and mixed precision;
  with fp32 there is no separate master (the device parameters are the masters),
  so this is exactly ``optimizer.update`` + ``optax.apply_updates``;
* in host memory (``offload=True``, memory kind ``pinned_host``), with the same
  shardings as the parameters (derived by tree-mapping the parameter shardings
  over the state, :func:`optax.tree_map_params`). The update then runs

  - ``update_on="host"``: on the host (``compute_on('device_host')``); the
    device only sends half-precision gradients and receives half-precision
    parameters. Works for every transformation (global-norm clipping included);
  - ``update_on="device"``: streamed through the device bucket by bucket
    (``bucket_bytes`` of float32 master weights per bucket): load a bucket's
    master and state, update, write them back, then the next bucket. Each load
    waits for the previous bucket's write-back, so the device holds one bucket
    at a time; ``prefetch=True`` loads the next bucket while the previous one
    is written back instead (the two transfers overlap; at most two buckets on
    the device: a load waits for the write-back of the bucket two before it).
    Buckets go in reverse parameter order (roughly the order in which gradients
    become ready), so XLA can overlap them with the gradient reduction.
    Requires a transformation that treats parameters independently (adam,
    adamw, sgd, …): coupled ones are detected and refused.

Skipped steps: ``update(..., finite=flag)`` with a false flag returns the
parameters, master weights and optimizer state unchanged (the step counter
included), as dynamic loss scaling requires.

Example::

    pm = axonn_jax.partition(model, grid, tokens)
    opt = MasterOptimizer(optax.adamw(1e-3), pm.param_shardings,
                          precision="bf16", offload=True)
    params, state = opt.init(pm.init(jax.random.key(0)))   # bf16 device, fp32 host

    @partial(jax.jit, donate_argnums=(0, 1))
    def step(params, state, batch):
        loss, grads = jax.value_and_grad(
            lambda p: loss_fn(pm.apply(as_planned(p, pm.plan), batch)))(params)
        params, state = opt.update(grads, state, params)
        return params, state, loss
"""

from __future__ import annotations

import inspect
import warnings

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend.core import Literal
from jax.experimental.compute_on import compute_on
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from axonn_jax.partitioner.jaxprs import dependencies
from axonn_jax.runtime.precision import Precision, cast_floating

#: Memory kind of offloaded arrays.
HOST = "pinned_host"
#: Where the update of offloaded state runs.
UPDATE_ON: tuple[str, ...] = ("device", "host")


def optimizer_state_shardings(optimizer: optax.GradientTransformation, params, param_shardings,
                              replicated: NamedSharding):  # fmt: skip
    """Shardings of ``optimizer``'s state: parameter-like leaves follow their parameter.

    Everything else (step counters, …) takes ``replicated``, and so does state kept per
    parameter in another shape (Adafactor's factored row and column statistics, SM3's
    per-dimension accumulators). Which leaves mirror which parameter is
    :func:`state_labels`' answer.
    ``params`` may be arrays or ShapeDtypeStructs; ``None`` leaves (other stages) stay
    ``None``, and so do the masked-out parameters of ``optax.masked`` /
    ``optax.multi_transform`` (``MaskedNode``).

    Example:
        >>> optimizer_state_shardings(optax.adam(1e-3), params, pm.param_shardings,   # doctest: +SKIP
        ...                           NamedSharding(pm.mesh, P()))
    """
    abstract = jax.eval_shape(optimizer.init, params)
    labels = iter(state_labels(optimizer, abstract, params))  # one per state leaf that is no hole
    shapes = [np.shape(p) for p in jax.tree.leaves(params)]
    shardings = jax.tree.structure(params).flatten_up_to(param_shardings)

    def follow(leaf):
        if is_state_hole(leaf):  # another stage's parameter, or a masked-out one
            return leaf
        i = next(labels)
        return shardings[i] if i >= 0 and np.shape(leaf) == shapes[i] else replicated

    return jax.tree.map(follow, abstract, is_leaf=is_state_hole)


def _check_streamable(optimizer, state) -> None:
    """Refuse state with masked-out parameters for the streamed update: its bucket-by-bucket
    view of the trees leaves other buckets' parameters out, which ``optax.masked`` and
    ``optax.multi_transform`` cannot tell from their own masked-out ones."""
    if any(isinstance(x, optax.MaskedNode) for x in jax.tree.leaves(state, is_leaf=is_state_hole)):
        raise ValueError(
            f"update_on='device' streams the update in buckets of parameters, but the state of "
            f"{type(optimizer).__name__} masks parameters out (optax.masked / optax.multi_transform), "
            "which a bucket's partial view of the parameters cannot keep apart. Remedy: "
            "update_on='host' (pm.train_step(..., offload=True, update_on='host'))."
        )


def is_state_hole(x) -> bool:
    """Subtrees mapped as one leaf over a state: holes (``None``) and masked-out parameters."""
    return x is None or isinstance(x, optax.MaskedNode)


def state_labels(optimizer: optax.GradientTransformation, state, params) -> list[int]:
    """For each leaf of ``optimizer``'s ``state``: the index of the parameter it mirrors, or -1.

    -1 marks state shared by all parameters (a step count). The one labelling
    of state leaves by parameter (streamed updates, the coupling check and the
    pipeline's stage update all use it); ``state`` and ``params`` may be abstract.
    ``optax.tree_map_params`` finds the state's parameter-like parts by running
    ``init`` on a placeholder of the parameters; where that fails (SM3's per-parameter
    lists, a ``multi_transform`` label function that reads the parameters:
    ``{k: ... for k in params}``, Flax's ``traverse_util.path_aware_map``), the state is
    labelled by key path (:func:`_labels_by_path`).

    Example:
        >>> params = {"b": jnp.zeros(2), "w": jnp.zeros((2, 2))}
        >>> state_labels(optax.adam(1e-3), optax.adam(1e-3).init(params), params)
        [-1, 0, 1, 0, 1]
    """
    index = jax.tree.unflatten(jax.tree.structure(params), list(range(len(jax.tree.leaves(params)))))
    try:
        labels = optax.tree_map_params(optimizer, lambda leaf, i: leaf if isinstance(leaf, optax.MaskedNode) else i,
                                       state, index, transform_non_params=lambda _: -1, is_leaf=is_state_hole)  # fmt: skip
    except Exception:  # noqa: BLE001 - optax's placeholder init failed: by key path
        return _labels_by_path(state, params)
    return list(jax.tree.leaves(labels))


def _labels_by_path(state, params) -> list[int]:
    """:func:`state_labels` of state kept at each parameter's place in another structure than
    the parameter (SM3: a list of per-dimension accumulators): a state leaf is labelled with
    the parameter whose key path it holds (e.g. ``…mu['dense']['kernel'][1]`` →
    ``dense/kernel``), -1 when it holds none.

    Example:
        >>> _labels_by_path({"mu": {"w": [jnp.zeros(2), jnp.zeros(3)]}, "count": 0}, {"w": jnp.zeros((2, 3))})
        [-1, 0, 0]
    """
    keys = [tuple(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]

    def label(path) -> int:
        for i, key in enumerate(keys):
            if any(path[k:k + len(key)] == key for k in range(len(path) - len(key) + 1)):
                return i
        return -1

    return [label(tuple(path)) for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


def check_optimizer(optimizer) -> None:
    """Refuse what is not an optax ``GradientTransformation``, naming the remedy.

    The usual slip is the factory itself, ``optax.adam`` for ``optax.adam(1e-3)``:

        >>> check_optimizer(optax.adam)  # doctest: +SKIP
        TypeError: optimizer is the function optax.adam, not a GradientTransformation ... optax.adam(1e-3)
    """
    if callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None)):
        return  # a GradientTransformation, or alike (optax.MultiSteps)
    if callable(optimizer):
        name = getattr(optimizer, "__name__", type(optimizer).__name__)
        module = (getattr(optimizer, "__module__", "") or "").split(".")[0]
        called = f"{module}.{name}" if module else name
        raise TypeError(
            f"optimizer is the function {called}, not a GradientTransformation: the factory was "
            f"passed without calling it. Remedy: call it with its hyperparameters, e.g. "
            f"{called}(1e-3) (the learning rate), as in pm.train_step(loss_fn, {called}(1e-3))."
        )
    raise TypeError(
        f"optimizer must be an optax GradientTransformation (e.g. optax.adamw(1e-3)), got "
        f"{type(optimizer).__name__}. Remedy: build it with optax (optax.chain(...) combines several)."
    )


#: optax wrappers that choose between updating and keeping their state with ``lax.cond``
#: (their state type → their name)
CONDITIONAL_STATES = {
    optax.MultiStepsState: "optax.MultiSteps",
    optax.ApplyIfFiniteState: "optax.apply_if_finite",
    optax.ConditionallyTransformState: "optax.transforms.conditionally_transform",
    optax.ConditionallyMaskState: "optax.transforms.conditionally_mask",
}


def check_offloadable(optimizer: optax.GradientTransformation) -> None:
    """Refuse, before anything compiles, an optimizer whose state cannot live in host memory.

    ``optax.MultiSteps``, ``optax.apply_if_finite`` and ``optax.transforms.conditionally_*``
    (alone or inside a chain) choose between updating and keeping their state with
    ``lax.cond``; with the state in host memory the two branches return arrays in
    different memory spaces and XLA cannot compile the update, on the host or streamed
    through the device. For MultiSteps, the train step's own ``microbatches=k``
    accumulates the mean gradient of k slices of the batch and updates once: the update
    of ``MultiSteps(optimizer, k)`` fed those k slices one call at a time.

        >>> check_offloadable(optax.MultiSteps(optax.adam(1e-3), 4))  # doctest: +SKIP
        ValueError: offload=True cannot keep the state of optax.MultiSteps ... Remedy: ...
    """
    try:  # the state says which wrappers it holds (abstract, nothing allocated)
        state = jax.eval_shape(optimizer.init, {"p": jax.ShapeDtypeStruct((1,), jnp.float32)})
    except Exception:  # noqa: BLE001 - an init that needs the real params: nothing to say
        return
    is_conditional = lambda x: type(x) in CONDITIONAL_STATES  # noqa: E731
    found = [CONDITIONAL_STATES[type(x)] for x in jax.tree.leaves(state, is_leaf=is_conditional) if is_conditional(x)]
    if not found:
        return
    why = (f"offload=True cannot keep the state of {found[0]} in host memory: its lax.cond between "
           "updating and keeping the state returns arrays in different memory spaces, which XLA "
           "cannot compile (update_on='host' or 'device' alike). Remedy: ")  # fmt: skip
    if found[0] == "optax.MultiSteps":
        raise ValueError(
            why + "accumulate gradients in the step itself - pm.train_step(loss_fn, inner_optimizer, "
            "offload=True, microbatches=k) on batches k times larger gives the update of "
            "MultiSteps(inner_optimizer, every_k_schedule=k) fed the k slices - or keep "
            "MultiSteps with offload=False."
        )
    skip = ("precision='fp16' skips a step with a non-finite gradient by itself (on every stage and "
            "process), or " if found[0] == "optax.apply_if_finite" else "")  # fmt: skip
    raise ValueError(why + skip + f"keep {found[0]} with offload=False.")


class MasterState(NamedTuple):
    """State of :class:`MasterOptimizer` (a pytree).

    ``master`` is the float32 master copy of the parameters, or ``None`` when
    the device parameters are the masters (fp32 without offload); ``inner`` is
    the wrapped transformation's state.
    """

    master: Any
    inner: Any


class MasterOptimizer:
    """An optax transformation with float32 masters, optionally host-offloaded.

    Args:
        optimizer: any ``optax.GradientTransformation``.
        param_shardings: ``NamedSharding`` pytree of the parameters
            (``pm.param_shardings``; one stage's shardings for a pipeline stage).
        precision: "fp32", "bf16", "fp16" or a :class:`~axonn_jax.runtime.precision.Precision`.
        offload: keep master weights and optimizer state in host memory.
        update_on: with ``offload``, run the update on the "host" or stream it
            through the "device" in buckets.
        bucket_bytes: float32 master bytes per device in one bucket (streaming).
        prefetch: when streaming, load bucket k+1 while bucket k is written back
            (faster where the link moves both ways at once; the device then holds
            at most two buckets). By default each load waits for the previous
            write-back and the device holds one bucket.
    """

    def __init__(
        self,
        optimizer: optax.GradientTransformation,
        param_shardings,
        *,
        precision: str | Precision = "fp32",
        offload: bool = False,
        update_on: str = "host",
        bucket_bytes: int = 64 * 2**20,
        prefetch: bool = False,
    ):
        if not hasattr(optimizer, "init") or not hasattr(optimizer, "update"):
            raise TypeError(
                f"optimizer must be an optax.GradientTransformation, got {type(optimizer).__name__}. "
                "Remedy: pass e.g. optax.adamw(1e-3)."
            )
        shardings = jax.tree.leaves(param_shardings)
        if not shardings or not all(isinstance(s, NamedSharding) for s in shardings):
            raise TypeError(
                "param_shardings must be a non-empty pytree of NamedSharding (pm.param_shardings)"
            )
        if update_on not in UPDATE_ON:
            raise ValueError(f"update_on must be one of {UPDATE_ON}, got {update_on!r}")
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        if offload:
            check_offloadable(optimizer)
        self.optimizer = optimizer
        self.precision = Precision.of(precision)
        self.offload = bool(offload)
        self.update_on = update_on
        self.bucket_bytes = bucket_bytes
        self.prefetch = bool(prefetch)
        self.param_shardings = param_shardings
        self._mesh = shardings[0].mesh
        self._separable: dict = {}

    def __repr__(self) -> str:
        where = f"host memory, update on the {self.update_on}" if self.offload else "device"
        return f"MasterOptimizer({self.precision.name}, masters and state in {where})"

    # --- layouts ------------------------------------------------------------
    @property
    def keeps_master(self) -> bool:
        """Whether a float32 master copy exists apart from the device parameters."""
        return self.precision.half or self.offload

    @property
    def master_shardings(self):
        """Shardings of the master weights (parameter layouts, host memory if offloaded)."""
        return _with_kind(self.param_shardings, HOST if self.offload else None)

    def state_shardings(self, params) -> MasterState:
        """Shardings of :class:`MasterState` for ``params`` (arrays or shape structs).

        Every parameter-shaped part of the optimizer state takes its parameter's
        sharding; the rest (step counters, …) is replicated.
        """
        kind = HOST if self.offload else None
        abstract = _abstract(params, self.precision.master_dtype)
        inner = optimizer_state_shardings(self.optimizer, abstract,
                                          _with_kind(self.param_shardings, kind),
                                          _with_kind(NamedSharding(self._mesh, P()), kind))  # fmt: skip
        return MasterState(self.master_shardings if self.keeps_master else None, inner)

    # --- init / update ------------------------------------------------------
    def init(self, params) -> tuple[Any, MasterState]:
        """Device parameters (precision dtype) and the state, from full-precision ``params``.

        ``params`` are in the parameter layout (``pm.init`` / ``pm.shard``).
        """
        self._check_structure(params, "params")
        shardings = self.state_shardings(params)
        if self.offload and self.update_on == "device":
            _check_streamable(self.optimizer, shardings.inner)
        to_master = lambda p: cast_floating(p, self.precision.master_dtype)  # noqa: E731
        master = None
        if self.keeps_master:
            master = jax.jit(to_master, out_shardings=shardings.master)(params)
        inner = jax.jit(lambda p: self.optimizer.init(to_master(p)), out_shardings=shardings.inner)(params)
        device = jax.jit(self.precision.to_device, out_shardings=self.param_shardings)(params)
        return device, MasterState(master, inner)

    def update(self, grads, state: MasterState, params, *, finite=None, grad_scale=None):
        """New device parameters and state after one step.

        Args:
            grads: gradients in the parameter layout (any float dtype).
            state: the :class:`MasterState`.
            params: the current device parameters.
            finite: optional boolean scalar; when false the step is skipped.
                Must be the global decision (see :mod:`axonn_jax.runtime.precision`).
            grad_scale: optional loss scale to divide the gradients by (done in
                float32 where the update runs).

        Returns:
            ``(params, state)``.
        """
        self._check_structure(grads, "grads")
        if not self.offload:
            return self.step_on_device(params, grads, state, finite, grad_scale)
        if self.update_on == "host":
            return self._update_on_host(grads, state, finite, grad_scale)
        return self._update_streamed(grads, state, finite, grad_scale)

    # --- the arithmetic (wherever it runs) ------------------------------------
    def step_on_device(self, params, grads, state: MasterState, finite=None, grad_scale=None):
        """The update without offload, on any parameter tree (no structure check).

        :mod:`~axonn_jax.runtime.stage_update` traces it on the whole model.
        """
        master = state.master if self.keeps_master else params
        new_master, inner = self._step(grads, state.inner, master, finite, grad_scale)
        device = self.precision.to_device(new_master)
        return device, MasterState(new_master if self.keeps_master else None, inner)

    def _step(self, grads, inner, master, finite, grad_scale):
        grads = cast_floating(grads, self.precision.master_dtype)
        if grad_scale is not None:
            inverse = 1.0 / jnp.asarray(grad_scale, self.precision.master_dtype)
            grads = jax.tree.map(lambda g: g * inverse, grads)
        updates, new_inner = self.optimizer.update(grads, inner, master)
        new_master = optax.apply_updates(master, updates)
        if finite is not None:
            keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            new_master = jax.tree.map(keep, new_master, master)
            new_inner = jax.tree.map(keep, new_inner, inner)
        return new_master, new_inner

    def _update_on_host(self, grads, state, finite, grad_scale):
        shardings = self.state_shardings(state.master)
        host_scalar = NamedSharding(self._mesh, P(), memory_kind=HOST)
        scalars = [None if v is None else jax.device_put(jnp.asarray(v), host_scalar)
                   for v in (finite, grad_scale)]  # fmt: skip
        on_device, grads = grads, jax.device_put(grads, _with_kind(self.param_shardings, HOST))  # half precision moves

        @_on_host
        @jax.jit
        def on_host(grads, inner, master, finite, grad_scale):
            new_master, new_inner = self._step(grads, inner, master, finite, grad_scale)
            return new_master, new_inner, self.precision.to_device(new_master)

        try:
            master, inner, device = on_host(grads, state.inner, state.master, *scalars)
        except ValueError as err:  # raised while tracing, before anything runs
            if "memory_space of all inputs" not in str(err):
                raise
            return self._update_on_device_for_host_state(on_device, state, shardings, finite, grad_scale)
        master = jax.device_put(master, shardings.master)
        inner = jax.device_put(inner, shardings.inner)
        return jax.device_put(device, self.param_shardings), MasterState(master, inner)

    def _update_on_device_for_host_state(self, grads, state, shardings, finite, grad_scale):
        """The update on the device, the offloaded state brought in and written back.

        For optimizers whose update makes new constants (``clip_by_global_norm``
        squares ``leaf.imag``, a zeros array): JAX places such a constant in device
        memory inside a ``compute_on('device_host')`` computation and refuses to
        combine it with host arrays. The state lives in host memory between steps
        as with every offloaded optimizer; during the update it is on the device
        (the peak memory of ``offload=False`` for that moment).
        """
        _warn_device_update(self.optimizer)
        master = jax.device_put(state.master, _with_kind(shardings.master, "device"))
        inner = jax.device_put(state.inner, _with_kind(shardings.inner, "device"))
        new_master, new_inner = self._step(grads, inner, master, finite, grad_scale)
        device = self.precision.to_device(new_master)
        return (jax.device_put(device, self.param_shardings),
                MasterState(jax.device_put(new_master, shardings.master), jax.device_put(new_inner, shardings.inner)))

    def _update_streamed(self, grads, state, finite, grad_scale):
        self._check_separable(state.master)
        shardings = self.state_shardings(state.master)
        param_tree = jax.tree.structure(state.master)
        grad_leaves = jax.tree.leaves(grads)
        master_leaves = jax.tree.leaves(state.master)
        inner_leaves, inner_tree = jax.tree.flatten(state.inner)
        inner_host = jax.tree.leaves(shardings.inner)
        inner_device = jax.tree.leaves(_with_kind(shardings.inner, "device"))
        device_shardings = jax.tree.leaves(self.param_shardings)
        host_shardings = jax.tree.leaves(shardings.master)
        abstract = _abstract(state.master, self.precision.master_dtype)
        labels = state_labels(self.optimizer, jax.eval_shape(self.optimizer.init, abstract), abstract)

        new_master: list = [None] * len(master_leaves)
        new_device: list = [None] * len(master_leaves)
        new_inner: list = [None] * len(inner_leaves)
        previous = written_back = None
        for bucket in self.buckets(state.master):
            members = set(bucket)
            slots = [k for k, label in enumerate(labels) if label in members or label < 0]
            loads = ([master_leaves[i] for i in bucket], [inner_leaves[k] for k in slots])
            if previous is not None:
                loads, _ = lax.optimization_barrier((loads, previous))
            masters = {i: jax.device_put(x, device_shardings[i]) for x, i in zip(loads[0], bucket)}
            states = {k: jax.device_put(x, inner_device[k]) for x, k in zip(loads[1], slots)}
            # the bucket's view of the trees: leaves of other buckets are None (empty subtrees)
            m_tree = jax.tree.unflatten(param_tree, [masters.get(i) for i in range(len(master_leaves))])
            g_tree = jax.tree.unflatten(param_tree, [grad_leaves[i] if i in members else None
                                                     for i in range(len(master_leaves))])  # fmt: skip
            s_tree = jax.tree.unflatten(inner_tree, [states.get(k) for k in range(len(inner_leaves))])
            m_out, s_out = self._step(g_tree, s_tree, m_tree, finite, grad_scale)
            try:  # back to the leaves of the whole trees (a pipeline stage's: None where not its own)
                m_out, s_out = param_tree.flatten_up_to(m_out), inner_tree.flatten_up_to(s_out)
            except (ValueError, TypeError) as err:
                raise ValueError(
                    f"{type(self.optimizer).__name__} changed the structure of its state for a "
                    "bucket of parameters. Remedy: update_on='host'."
                ) from err
            for i in bucket:
                new_master[i] = jax.device_put(m_out[i], host_shardings[i])
                new_device[i] = self.precision.to_device(m_out[i])
            written = [k for k in slots if new_inner[k] is None]  # shared leaves (counters): equal in every bucket
            for k in written:
                new_inner[k] = jax.device_put(s_out[k], inner_host[k])
            done = ([new_master[i] for i in bucket], [new_device[i] for i in bucket], [new_inner[k] for k in written])
            # the next load waits for this write-back; with prefetch, for this compute and the one before's write-back
            previous = ([m_out[i] for i in bucket], written_back) if self.prefetch else done
            written_back = done
        master = jax.tree.unflatten(param_tree, new_master)
        device = jax.tree.unflatten(param_tree, new_device)
        return device, MasterState(master, jax.tree.unflatten(inner_tree, new_inner))

    # --- buckets ------------------------------------------------------------
    def buckets(self, params) -> list[list[int]]:
        """Parameter leaf indices per streaming bucket, in update order.

        Leaves go in reverse order, grouped greedily so that each bucket holds at
        most ``bucket_bytes`` of float32 masters per device (a larger leaf gets a
        bucket of its own).
        """
        out: list[list[int]] = []
        size = 0
        shardings = jax.tree.leaves(self.param_shardings)
        leaves = jax.tree.leaves(params)
        for i in reversed(range(len(shardings))):
            shape = tuple(np.shape(leaves[i]))
            local = math.prod(shardings[i].shard_shape(shape)) * self.precision.master_dtype.itemsize
            if out and size + local <= self.bucket_bytes:
                out[-1].append(i)
                size += local
            else:
                out.append([i])
                size = local
        return out

    def _check_separable(self, params) -> None:
        """Refuse streaming for transformations that couple parameters."""
        abstract = _abstract(params, self.precision.master_dtype)
        key = jax.tree.structure(abstract), tuple((a.shape, a.dtype) for a in jax.tree.leaves(abstract))
        if key not in self._separable:
            self._separable[key] = coupling(self.optimizer, abstract)
        problem = self._separable[key]
        if problem:
            raise ValueError(
                f"update_on='device' streams the update in buckets, but this optimizer couples "
                f"parameters ({problem}), e.g. through clip_by_global_norm; bucket-wise updates "
                "would differ from the whole-model update. Remedy: MasterOptimizer(..., "
                "update_on='host') (any transformation) or offload=False."
            )

    def _check_structure(self, tree, what: str) -> None:
        expected = jax.tree.structure(self.param_shardings)
        if jax.tree.structure(tree) != expected:
            raise ValueError(
                f"{what} pytree does not match the parameter shardings given to MasterOptimizer "
                f"({expected.num_leaves} leaves expected, got {jax.tree.structure(tree).num_leaves}). "
                "Remedy: pass the pytree of pm.init / the gradients of the device parameters."
            )


def coupling(optimizer: optax.GradientTransformation, params) -> str:
    """Why ``optimizer`` does not update each parameter independently ('' if it does).

    Traces ``optimizer.update`` on abstract ``params`` and follows the data flow
    from every gradient, parameter and state leaf: the update (and new state) of
    parameter *i* may depend only on leaves of parameter *i* and on shared state
    that itself depends on no parameter (e.g. the step count).
    """
    abstract = _abstract(params, None)
    leaves = jax.tree.leaves(abstract)
    state = jax.eval_shape(optimizer.init, abstract)
    labels = state_labels(optimizer, state, abstract)
    closed = jax.make_jaxpr(optimizer.update)(abstract, state, abstract)
    own = list(range(len(leaves)))
    in_labels = own + labels + own
    out_labels = own + labels
    if len(closed.jaxpr.invars) != len(in_labels) or len(closed.jaxpr.outvars) != len(out_labels):
        return "its state could not be matched to the parameters"
    found = dependencies(closed.jaxpr, [frozenset() if lab < 0 else frozenset({lab}) for lab in in_labels],
                         branches=True)  # fmt: skip
    depends = [frozenset() if isinstance(v, Literal) else found.get(v, frozenset()) for v in closed.jaxpr.outvars]
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    for label, deps in zip(out_labels, depends):
        foreign = deps - {label}
        if foreign:
            what = f"the update of {paths[label]}" if label >= 0 else "a shared state entry"
            return f"{what} depends on {paths[min(foreign)]}"
    return ""


def _abstract(tree, dtype):
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), dtype if dtype is not None else x.dtype), tree
    )


def _on_host(fn: Callable) -> Callable:
    """``fn`` computed on the host, its outputs in host memory.

    jax < 0.11 spells it ``compute_on("device_host")`` (a decorator); jax 0.11
    takes the function and the outputs' memory spaces.
    """
    if "out_memory_spaces" in inspect.signature(compute_on).parameters:
        return compute_on(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    return compute_on("device_host")(fn)


def _with_kind(shardings, kind: str | None):
    """``shardings`` in memory kind ``kind`` (``None``: the default device memory)."""
    def move(s):
        return s.with_memory_kind(kind) if kind is not None else s.with_memory_kind("device")
    return jax.tree.map(move, shardings)


_WARNED_DEVICE_UPDATE: set = set()


def _warn_device_update(optimizer) -> None:
    """Say once per optimizer that its offloaded update runs on the device."""
    if id(optimizer) in _WARNED_DEVICE_UPDATE:
        return
    _WARNED_DEVICE_UPDATE.add(id(optimizer))
    warnings.warn(
        "offload=True: this optimizer's update creates constants that XLA cannot keep in a "
        "host computation (e.g. optax.clip_by_global_norm), so it runs on the device: the fp32 "
        "masters and optimizer state stay in host memory between steps but are brought to the "
        "device for the update (the peak memory of offload=False at that moment). Remedy, if "
        "that peak does not fit: clip in the loss scale or use a leaf-wise optimizer.",
        stacklevel=3,
    )
