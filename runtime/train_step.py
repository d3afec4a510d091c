"""A complete training step: gradients (pipelined or not) and the optimizer update.

The optimizer is any optax ``GradientTransformation`` wrapped in a
:class:`~axonn_jax.runtime.master_optimizer.MasterOptimizer`: the device holds the parameters
in the chosen precision; float32 master weights and the optimizer state sit
next to them or, with ``offload=True``, in host memory, with layouts derived
from the parameters' layouts. fp16 adds dynamic loss scaling: a step whose
gradients overflowed anywhere (any shard, stage or process) is skipped
everywhere and the scale halves. Every program has fixed output shardings, so
a step compiles once.

The engine (:mod:`axonn_jax.runtime.engine`) picks the step's kind:
:class:`SingleMeshStep` runs the whole step as one jitted program;
:class:`PipelinedStep` takes the gradients from the dispatch queue and
updates each local stage with a program of its own. Both keep one
:class:`UpdateProgram` per local stage (one stage without a pipeline).

Example:
    >>> step = pm.train_step(loss_fn, optax.adamw(1e-3), microbatches=4,   # doctest: +SKIP
    ...                      precision="bf16", offload=True)
    >>> params, opt_state = step.init(params)                             # doctest: +SKIP
    >>> params, opt_state, loss = step(params, opt_state, batch)          # doctest: +SKIP
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import re
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from axonn_jax.runtime.consistency import check_consistent, step_fingerprint
from axonn_jax.runtime.loss_program import ScalarLoss
from axonn_jax.runtime.master_optimizer import (MasterOptimizer, MasterState, check_offloadable, check_optimizer,
                                               is_state_hole)
from axonn_jax.runtime.model_call import wrap_params
from axonn_jax.runtime.agreement import agree_on_call, call_description
from axonn_jax.runtime.placement import PlacedModel, check_not_donated
from axonn_jax.runtime.precision import LossScale, Precision, all_finite, as_planned
from axonn_jax.runtime.sharded import onto_mesh
from axonn_jax.runtime.stage_update import StageUpdate, describe, init_mixing

if TYPE_CHECKING:
    from axonn_jax.runtime.engine import Engine
    from axonn_jax.runtime.model_call import ModelCall


class OptState(NamedTuple):
    """What :class:`TrainStep` carries between steps besides the device parameters."""

    optimizer: Any  # MasterState, or {stage: MasterState} with a pipeline (Engine.pack_states)
    loss_scale: LossScale | None  # fp16 only


@dataclasses.dataclass(frozen=True)
class MasterSettings:
    """The device parameters' precision, and where the float32 masters and optimizer state live.

    See :class:`~axonn_jax.runtime.master_optimizer.MasterOptimizer` for ``offload``,
    ``update_on``, ``bucket_bytes`` and ``prefetch``.
    """

    precision: Precision
    offload: bool = False
    update_on: str = "host"
    bucket_bytes: int = 64 * 2**20
    prefetch: bool = False

    def wrap(self, optimizer: optax.GradientTransformation, param_shardings) -> MasterOptimizer:
        """``optimizer`` with these settings over parameters laid out as ``param_shardings``."""
        return MasterOptimizer(optimizer, param_shardings, precision=self.precision, offload=self.offload,
                               update_on=self.update_on, bucket_bytes=self.bucket_bytes,
                               prefetch=self.prefetch)  # fmt: skip


class UpdateProgram(NamedTuple):
    """One local stage's optimizer, its jitted program (the whole step on one mesh) and the
    shardings of the :class:`MasterState` it takes and returns."""

    optimizer: MasterOptimizer
    run: Callable
    state_shardings: MasterState


def _none(x) -> bool:
    return x is None


def _check_update_needs_nothing_else(optimizer: optax.GradientTransformation, trace: Callable) -> None:
    """Refuse an optimizer whose ``update`` needs more than ``(updates, state, params)``:
    ``optax.contrib.reduce_on_plateau`` needs ``value=`` (the loss), which a train step does
    not pass; it failed inside optax at ``step.init``. Refuse one that needs another params
    structure (``optax.lookahead``'s ``LookaheadParams``) too. ``trace()`` traces the update as the
    step calls it (:attr:`TrainStep.fingerprint`)."""
    try:
        trace()
    except AttributeError as err:  # e.g. optax.lookahead reads params.fast
        raise TypeError(
            f"optimizer {describe(optimizer)} cannot take the model's parameters as they are ({err}): "
            "pm.train_step hands optimizer.init and optimizer.update the model's params tree, and "
            "this optimizer wants another structure (optax.lookahead: LookaheadParams of fast and "
            "slow weights). Remedy: write the step with pm.value_and_grad (or pm.apply inside "
            "jax.value_and_grad) and build the structure the optimizer takes yourself (the "
            "README's jitted step), or use another optimizer."
        ) from err
    except TypeError as err:
        found = re.search(r"required keyword-only arguments?: (.*)", str(err))
        if found is None:
            raise
        names = re.findall(r"'(\w+)'", found.group(1))
        keywords, passed = ", ".join(f"{n}=" for n in names), ", ".join(f"{n}=..." for n in names)
        raise TypeError(
            f"optimizer {describe(optimizer)} needs {keywords} in optimizer.update ({err}), "
            "which pm.train_step does not pass (it calls update(grads, state, params)). Remedy: "
            "write the step with pm.value_and_grad and call optimizer.update(grads, state, params, "
            f"{passed}) yourself (the README's jitted step), or use another optimizer."
        ) from err


def _first_held(*trees):
    """Leaf by leaf, the first tree's leaf that is held: not a hole (``None``: another stage's
    parameter; ``optax.MaskedNode``: one the optimizer masks out, kept where no tree holds
    a value). Every stage's optimizer state, merged into the whole model's."""

    def first(*xs):
        return next((x for x in xs if not is_state_hole(x)), next((x for x in xs if x is not None), None))

    return jax.tree.map(first, *trees, is_leaf=is_state_hole)


class TrainStep(abc.ABC):
    """``(params, opt_state, batch) → (params, opt_state, loss)``; built by ``engine.train_step``.

    Args:
        engine: the model's engine (its kind decides the subclass).
        loss_fn: ``loss_fn(outputs, batch) → scalar``; with the option ``has_aux=True``,
            ``(loss, aux)``, and the step returns ``(loss, aux)`` where it returns the loss.
        optimizer: any optax ``GradientTransformation``.
        precision: "fp32" (default), "bf16" or "fp16" parameters and gradients on device.
        offload: master weights and optimizer state in host memory.
        update_on, bucket_bytes, prefetch: see :class:`~axonn_jax.runtime.master_optimizer.MasterOptimizer`.
        **options: those of :meth:`~axonn_jax.Partitioned.value_and_grad`.
    """

    def __init__(self, engine: Engine, loss_fn: Callable, optimizer: optax.GradientTransformation, *,
                 precision: str | Precision = "fp32", offload: bool = False, update_on: str = "host",
                 bucket_bytes: int = 64 * 2**20, prefetch: bool = False, **options):  # fmt: skip
        self.engine, self.loss_fn, self.optimizer = engine, loss_fn, optimizer
        self.placed: PlacedModel = engine.placed
        self.call: ModelCall = engine.call
        self.plan = engine.plan
        check_optimizer(optimizer)
        self.settings = MasterSettings(Precision.of(precision), offload, update_on, bucket_bytes, prefetch)
        self.options = options
        #: the loss as the step returns it: ``loss``, or ``(loss, aux)`` with ``has_aux``
        self.loss = ScalarLoss.of(loss_fn, options.get("has_aux", False))
        if offload:
            check_offloadable(optimizer)
        _check_update_needs_nothing_else(optimizer, lambda: self.fingerprint)  # traces the update once
        self.value_and_grad = engine.value_and_grad(loss_fn, **options)
        self._programs: dict[int, UpdateProgram] = {}  # local stage → its optimizer and program
        #: (a weak reference to one master of the opt_state last issued, the ids of its params)
        self._issued: tuple | None = None

    @property
    def loss_notes(self) -> dict:
        """Input signature → why the loss of that call runs after the model's gathered outputs
        (empty: the loss is planned with the model, or the last pipeline stage)."""
        return self.value_and_grad.loss_notes

    # --- what the kinds of step differ in ---------------------------------------------
    def _check_exact(self) -> None:
        """Raise, before :meth:`init` does any work, if this step cannot update exactly."""

    def _scale_sharding(self) -> jax.sharding.Sharding:
        """Where an fp16 step keeps its dynamic loss scale."""
        return NamedSharding(self.engine.mesh, P())

    @abc.abstractmethod
    def _compile(self, optimizer: MasterOptimizer, out_shardings: tuple) -> Callable:
        """The jitted program of one stage (``out_shardings``: of its parameters and state)."""

    #: the whole step is one program (:meth:`SingleMeshStep.lower`); a pipelined step runs
    #: one per stage and task
    one_program = False

    def __call__(self, params, opt_state: OptState, batch, rngs=None):
        """One step; ``rngs={'dropout': key}`` feeds the model's RNG streams (a new key per step).

        ``params`` as :meth:`init` returned them (linen's ``{'params': tree}`` too)."""
        tree, wrapped = self.engine.plan_tree(params)
        _check_step_inputs(tree, opt_state, batch)
        self._check_state(opt_state)
        self._check_issued(tree, opt_state)
        tree, opt_state, loss = self._step(tree, opt_state, batch, rngs)
        self._issue(tree, opt_state)
        return wrap_params(tree, wrapped), opt_state, loss

    def _check_state(self, opt_state) -> None:
        """Refuse an opt_state made for another step: another optimizer (its state has other
        parts) or other options (offloaded where this step keeps it on the device, or back)."""
        states = self.engine.unpack_states(opt_state.optimizer) or {}
        for s, state in states.items():
            want = self._program(s).state_shardings
            given = jax.tree.structure(state, is_leaf=_none)
            if given != jax.tree.structure(want, is_leaf=_none):
                raise ValueError(
                    "opt_state was made for another step: its optimizer state does not have the parts "
                    "this step's optimizer keeps (another optimizer, or other step options). "
                    "Remedy: params, opt_state = step.init(params) with this step, or restore a "
                    "checkpoint with step.from_checkpoint."
                )
            for (path, leaf), sharding in zip(jax.tree_util.tree_leaves_with_path(state),
                                              jax.tree.leaves(want)):  # fmt: skip
                if not isinstance(leaf, jax.Array):
                    continue
                kind, wanted = getattr(leaf.sharding, "memory_kind", None), sharding.memory_kind
                if wanted is not None and kind is not None and kind != wanted:
                    raise ValueError(
                        f"opt_state leaf '{jax.tree_util.keystr(path)}' is in {kind} memory, but this "
                        f"step keeps it in {wanted} memory (offload={self.settings.offload}): the "
                        "opt_state was made by a step with other offload options. Remedy: "
                        "step.init(params) with this step, or step.from_checkpoint(params, saved)."
                    )

    # --- params that belong to their masters ------------------------------------------
    def _master_leaf(self, opt_state):
        """One float32 master of ``opt_state`` (``None``: the step keeps no masters)."""
        states = self.engine.unpack_states(getattr(opt_state, "optimizer", None)) or {}
        for s in sorted(states):
            leaves = jax.tree.leaves(getattr(states[s], "master", None))
            if leaves:
                return leaves[0]
        return None

    def _issue(self, params, opt_state) -> None:
        """Remember that ``params`` are the device copies of ``opt_state``'s masters."""
        master = self._master_leaf(opt_state)
        if master is not None:
            self._issued = (weakref.ref(master), [id(x) for x in jax.tree.leaves(params)])

    def _check_issued(self, params, opt_state) -> None:
        """Refuse params other than those issued with ``opt_state``'s masters: the step updates
        the masters, so other values (weights loaded into params) would be silently dropped."""
        master, issued = self._master_leaf(opt_state), self._issued
        if master is None or issued is None or issued[0]() is not master:
            return  # no masters, or an opt_state this step did not issue: nothing to compare
        if [id(x) for x in jax.tree.leaves(params)] != issued[1]:
            raise ValueError(
                f"params are not the ones step.init / the last step returned with this opt_state. "
                f"With precision={self.settings.precision.name!r}"
                f"{' and offload' if self.settings.offload else ''} the step keeps float32 master "
                "weights in opt_state and updates those, so values put into params (loaded "
                "weights) would be lost after one step. Remedy: params, opt_state = "
                "step.init(new_params) to start from new weights (a fresh optimizer state), or "
                "step.from_checkpoint(new_params, saved) to keep a saved optimizer state."
            )

    @abc.abstractmethod
    def _step(self, params, opt_state: OptState, batch, rngs):
        """One step on ``params`` as the plan holds them (inputs checked)."""

    # --- pieces -----------------------------------------------------------------
    def _groups(self) -> dict[int, list[int]]:
        return trainable_groups(self.placed)

    def _stage_tree(self, leaves: list, stage: int):
        """Stage ``stage``'s trainable leaves as the params tree (``None`` elsewhere)."""
        return self.call.split(self.placed.subtree(leaves, self._groups()[stage]))[0]

    def _program(self, stage: int) -> UpdateProgram:
        if stage not in self._programs:
            shardings = jax.tree.leaves(self.placed.param_shardings, is_leaf=_none)
            optimizer = self.settings.wrap(self.optimizer, self._stage_tree(shardings, stage))
            try:  # fixed output layouts: the outputs of step k are exactly the inputs of step k+1
                out = (optimizer.param_shardings, optimizer.state_shardings(self._stage_tree(self._abstract, stage)))
            except (AttributeError, TypeError) as err:
                if len(self._groups()) == 1:
                    raise
                raise ValueError(
                    f"optimizer {describe(self.optimizer)} cannot initialise the state of pipeline "
                    f"stage {stage} of {self.placed.grid}: its init reads every leaf of the params tree "
                    f"({err}), and a stage's tree holds None where other stages' parameters are. "
                    "Remedy: an optimizer whose init maps over the parameters with jax.tree.map (None "
                    "is then skipped, as in optax's own), or pipeline=1."
                ) from err
            self._programs[stage] = UpdateProgram(optimizer, self._compile(optimizer, out), out[1])
        return self._programs[stage]

    # --- the public calls -----------------------------------------------------------
    def init(self, params) -> tuple[Any, OptState]:
        """``(device params, opt_state)`` from full-precision ``params`` (``pm.init``; a
        stateless linen model's ``{'params': tree}`` too, returned in that form).

        Collective under MPI: first checks that every rank runs the same
        optimizer (hyperparameters included) and step options.
        """
        params, wrapped = self.engine.plan_tree(params)
        self.placed.check_params(params, dtypes=False)  # another model's params: refused here, by name
        self._check_ranks_agree()
        self._check_exact()
        leaves = self.placed.param_leaves(params)
        out, states = list(leaves), {}
        for s, idx in self._groups().items():
            device, states[s] = self._program(s).optimizer.init(self._stage_tree(leaves, s))
            new = plan_leaves(self.placed, self.call, device)
            for i in idx:
                out[i] = new[i]
        scale = None
        if self.settings.precision.loss_scaling:
            scale = jax.device_put(self.settings.precision.loss_scale(), self._scale_sharding())
        device, opt_state = jax.tree.unflatten(self.plan.param_tree, out), OptState(self.engine.pack_states(states), scale)
        self._issue(device, opt_state)
        return wrap_params(device, wrapped), opt_state

    # --- checkpoints: one form for every grid, pipeline and offload mode ----------------
    def checkpoint_state(self, params, opt_state: OptState) -> tuple[Any, dict]:
        """``(params, opt_state)`` as checkpoints store them, the same on every grid and mode.

        ``params``: full-precision values (the float32 masters where the step
        keeps them, else the device parameters; model state as is). ``opt_state``:
        ``{"inner": the optimizer's state over the whole model}`` (pipeline
        stages merged), plus ``"loss_scale"`` with fp16. Leaves of other
        processes' stages are ``None``. Restore with :meth:`checkpoint_target`
        and :meth:`from_checkpoint` (``Checkpointer.save_train_state`` /
        ``restore_train_state`` do all three).
        """
        _check_step_inputs(params, opt_state)
        params, wrapped = self.engine.plan_tree(params)
        states = self.engine.unpack_states(opt_state.optimizer)
        saved = {"inner": _first_held(*(states[s].inner for s in sorted(states)))}
        if opt_state.loss_scale is not None:
            saved["loss_scale"] = opt_state.loss_scale
        return wrap_params(master_params(self.engine, params, opt_state), wrapped), saved

    def checkpoint_target(self, params, opt_state: OptState) -> tuple[Any, dict]:
        """Restore targets for :meth:`checkpoint_state`'s form, from a fresh :meth:`init`.

        Parameters come back in float32 on the device parameters' shardings;
        optimizer-state leaves on the shardings and memory kinds of ``opt_state``.
        """
        full, saved = self.checkpoint_state(params, opt_state)
        structs = jax.tree.map(
            lambda device, value: None if device is None else jax.ShapeDtypeStruct(
                value.shape, value.dtype, sharding=device.sharding),
            params, full, is_leaf=_none,
        )  # fmt: skip
        return structs, saved

    def from_checkpoint(self, params, saved: dict) -> tuple[Any, OptState]:
        """``(device params, opt_state)`` of this step from :meth:`checkpoint_state`'s form.

        Masters and device parameters are made from ``params`` as :meth:`init`
        makes them; the optimizer state is ``saved["inner"]`` split over this
        process's stages (scalars such as step counts copied to each stage).
        """
        device, opt_state = self.init(params)
        states = self.engine.unpack_states(opt_state.optimizer)
        for s, state in states.items():
            # a copy per stage: with virtual stages several stages share one mesh, and a saved
            # array already on it (a step count) must not become one buffer that each stage's
            # update donates
            inner = jax.tree.map(
                lambda like, value: like if is_state_hole(like)
                else jax.device_put(value, like.sharding, may_alias=False),
                state.inner, saved["inner"], is_leaf=is_state_hole,
            )  # fmt: skip
            states[s] = state._replace(inner=inner)
        scale = opt_state.loss_scale
        if scale is not None and "loss_scale" in saved:
            scale = jax.tree.map(lambda like, v: jax.device_put(v, like.sharding), scale, saved["loss_scale"])
        return device, OptState(self.engine.pack_states(states), scale)

    @functools.cached_property
    def fingerprint(self) -> dict[str, str]:
        """``{"optimizer": its update's digest and scalar constants (learning rate, betas, …),
        "step": the step options}``: what every rank must agree on, and what a checkpoint
        records of the step that saved it (:meth:`Checkpointer.restore_train_state` warns
        when the optimizer differs)."""
        settings = {f.name: getattr(self.settings, f.name) for f in dataclasses.fields(self.settings)}
        options = {k: _stable_repr(v) for k, v in {**self.options, **settings}.items()}
        return step_fingerprint(self.optimizer, self._abstract_params, options)

    @functools.cached_property
    def _abstract(self) -> list[jax.ShapeDtypeStruct]:
        """Every variable leaf of the plan, abstract (its planned shape and dtype)."""
        return [jax.ShapeDtypeStruct(p.shape, np.dtype(p.dtype)) for p in self.plan.params]

    @functools.cached_property
    def _abstract_params(self):
        """The params tree the optimizer sees (model state aside), abstract."""
        return self.call.split(jax.tree.unflatten(self.plan.param_tree, self._abstract))[0]

    def _check_ranks_agree(self) -> None:
        check_consistent(self.fingerprint, remedy=(
            " Remedy: build the optimizer and train-step options from the same arguments on "
            "every rank (learning rate, schedule, clipping, precision, microbatches)."))


class SingleMeshStep(TrainStep):
    """The whole step, gradients and update, as one jitted program on the engine's mesh."""

    def _compile(self, optimizer, out_shardings):
        params_out, state_out = out_shardings
        _, model_state = self.call.split(self.placed.param_shardings)
        replicated = NamedSharding(self.engine.mesh, P())
        scale = replicated if self.settings.precision.loss_scaling else None
        return jax.jit(self._whole_step(optimizer), donate_argnums=(0, 1),
                       out_shardings=(self.call.merge(params_out, model_state), OptState(state_out, scale),
                                      replicated))  # fmt: skip

    def _whole_step(self, optimizer: MasterOptimizer):
        plan, call, value_and_grad, returned = self.plan, self.call, self.value_and_grad, self.loss

        def step(variables, opt_state: OptState, batch, rngs):
            scale = opt_state.loss_scale  # an input of the planned loss: a new scale compiles nothing
            value, grads = value_and_grad(as_planned(variables, plan), batch, rngs,
                                          loss_scale=None if scale is None else scale.scale)  # fmt: skip
            params, model_state = call.split(variables)
            if call.stateful:
                value, updates = value
                model_state = {**model_state, **updates}
            loss, aux = returned.parts(value)
            finite = all_finite(grads) if scale is not None else None
            params, state = optimizer.update(grads, opt_state.optimizer, params, finite=finite,
                                             grad_scale=None if scale is None else scale.scale)  # fmt: skip
            if scale is not None:
                loss, scale = loss / scale.scale, scale.update(finite)
            return call.merge(params, model_state), OptState(state, scale), returned.value(loss, aux)

        return step

    def _step(self, params, opt_state: OptState, batch, rngs):
        if self.placed.multiprocess:  # one SPMD program: every process, the same batch shapes
            described = call_description(dict(batch=batch, rngs=rngs), microbatches=self.options.get("microbatches", 1))
            agree_on_call(self.placed.host, "train step", described, self.options.get("timeout", 60.0))
        batch = onto_mesh(batch, self.engine.mesh, self.plan.grid)  # a batch put on other devices
        return self._program(0).run(params, opt_state, batch, rngs)

    one_program = True

    def lower(self, params, opt_state: OptState, batch, rngs=None) -> jax.stages.Lowered:
        """The step's one program lowered ahead of time for these arguments (``.compile()``,
        then ``.memory_analysis()``: what :func:`axonn_jax.compiled_check.check_compiled` reads)."""
        _check_step_inputs(params, opt_state, batch)
        return self._program(0).run.lower(self.engine.plan_tree(params)[0], opt_state, batch, rngs)


class PipelinedStep(TrainStep):
    """Gradients from the dispatch queue, then one update program per local stage.

    Each stage's parameters live on that stage's mesh. The finiteness flag of
    bf16 steps is combined over stages and processes before any stage updates.
    An optimizer that combines stages (global-norm clipping) runs as the same
    whole-model update split into rounds over the stages
    (:mod:`~axonn_jax.runtime.stage_update`).
    """

    def _scale_sharding(self) -> jax.sharding.Sharding:
        return SingleDeviceSharding(jax.local_devices()[0])  # each process keeps its own, equal copy

    def trace(self, json_path=None, png_path=None, title: str = "pipeline timeline"):
        """The last step's tasks of every rank: a Chrome/Perfetto trace and a timeline plot
        (:meth:`~axonn_jax.runtime.pipeline.training.PipelinedValueAndGrad.trace`; a collective
        under MPI, the rows on rank 0)."""
        return self.value_and_grad.trace(json_path, png_path, title)

    def _compile(self, optimizer, out_shardings):
        def update(params, grads, state, finite, grad_scale):
            return optimizer.update(grads, state, params, finite=finite, grad_scale=grad_scale)

        return jax.jit(update, donate_argnums=(0, 2), out_shardings=out_shardings)

    @functools.cached_property
    def across_stages(self) -> StageUpdate | None:
        """The rounds of an update that mixes stages (``None``: per-stage updates are exact)."""
        optimizers = {s: self._program(s).optimizer for s in self._groups()}
        trainable = [i for i, p in enumerate(self.plan.params) if p.trainable]
        mixing = init_mixing(self.placed, self.optimizer, self._abstract_params, trainable)
        if mixing is not None:
            raise ValueError(
                f"optimizer {describe(self.optimizer)}: its init combines parameters of several "
                f"pipeline stages ({mixing}; e.g. optax.contrib.dog's first step, a norm of every "
                f"parameter), and each stage of {self.placed.grid} initialises its own state, so it "
                "would differ from the plain optimizer's. Remedy: an init that reads each parameter "
                "alone (optax.contrib.dog(..., init_step=('learning_rate', ...))), or pipeline=1."
            )
        update = StageUpdate.of(self.placed, optimizers, self._abstract_params, trainable)
        if update is not None and self.settings.offload:
            raise ValueError(
                f"optimizer {describe(self.optimizer)} combines parameters of several pipeline "
                f"stages (e.g. a global norm, or random numbers drawn for the whole model at once), "
                f"which offload=True cannot do exactly on {self.placed.grid}. Remedy: offload=False, "
                "a leaf-wise optimizer, or pipeline=1."
            )
        return update

    def _check_exact(self) -> None:
        self.across_stages  # noqa: B018 - analysed once; raises what cannot be exact

    def _step(self, params, opt_state: OptState, batch, rngs):
        placed, scale = self.placed, opt_state.loss_scale
        grad_scale = None if scale is None else np.asarray(scale.scale)  # a host value: any stage's mesh
        value, grads = self.value_and_grad(params, batch, rngs, loss_scale=grad_scale)
        if self.call.stateful:  # the new state takes the place of the old; it is not optimized
            value, new_state = value
            grads = self.call.merge(grads, new_state)
            params = self.call.merge(self.call.split(params)[0], new_state)
        p_leaves = placed.param_leaves(params)
        g_leaves = placed.param_leaves(grads)
        finite = None
        if self.settings.precision.half:  # skip the step everywhere if any stage, on any process, overflowed
            local = all(bool(np.asarray(all_finite(g))) for g in g_leaves if g is not None)
            finite = placed.host.all_true(local)
        groups = self._groups()
        stage_params = {s: self._stage_tree(p_leaves, s) for s in groups}
        stage_grads = {s: self._stage_tree(g_leaves, s) for s in groups}
        states = self.engine.unpack_states(opt_state.optimizer)
        if self.across_stages is not None:  # the whole-model update, in rounds over the stages
            new_params, new_states = self.across_stages(stage_params, stage_grads, states, finite, grad_scale)
        else:  # leaf-wise: each stage on its own is exact
            new_params, new_states = {}, {}
            for s in groups:
                new_params[s], new_states[s] = self._program(s).run(stage_params[s], stage_grads[s],
                                                                    states[s], finite, grad_scale)  # fmt: skip
        out = list(p_leaves)
        for s, idx in groups.items():
            new = plan_leaves(placed, self.call, new_params[s])
            for i in idx:
                out[i] = new[i]
        loss, aux = self.loss.parts(value)
        if scale is not None:  # the same flag on every process: every copy of the scale stays equal
            loss, scale = np.float32(loss / grad_scale), scale.update(finite)
        return (jax.tree.unflatten(self.plan.param_tree, out), OptState(self.engine.pack_states(new_states), scale),
                self.loss.value(loss, aux))  # fmt: skip


def plan_leaves(placed: PlacedModel, call: ModelCall, params_tree) -> list:
    """A params tree (``None`` holes kept) as leaves in the plan's order (state: ``None``)."""
    _, no_state = call.split(placed.subtree([None] * len(placed.plan.params), []))
    return jax.tree.leaves(call.merge(params_tree, no_state), is_leaf=_none)


def trainable_groups(placed: PlacedModel) -> dict[int, list[int]]:
    """Local stage → the trainable leaves it updates (model state is carried, not optimized)."""
    trainable = [p.trainable for p in placed.plan.params]
    return {s: [i for i in idx if trainable[i]] for s, idx in placed.homes.groups().items()}


def master_params(engine: Engine, params, opt_state, *, state_holes: bool = False):
    """``params`` with the float32 master weights of ``opt_state`` in place of the device values.

    ``opt_state`` is what :meth:`TrainStep.init` returned (an :class:`OptState`),
    its ``optimizer`` part (a :class:`MasterState`, or ``{stage: MasterState}``
    with a pipeline: this process's stages), or any other optimizer state,
    which holds no masters (``pm.init_optimizer``: the parameters are the
    masters). The result has the layout of ``params`` (leaves of other
    processes' stages ``None``; offloaded masters stay in host memory), ready
    for ``pm.gather``. Model state (BatchNorm statistics) comes from ``params``
    (``state_holes``: it may be ``None`` there).

    Example:
        >>> full = pm.gather(master_params(pm.engine, params, opt_state))  # doctest: +SKIP
    """
    state = opt_state.optimizer if isinstance(opt_state, OptState) else opt_state
    states = engine.unpack_states(state)
    if states is None:
        return params  # no separate masters: the parameters are the masters
    placed = engine.placed
    groups = trainable_groups(placed)
    if not all(isinstance(v, MasterState) for v in states.values()) or set(states) != set(groups):
        raise ValueError(
            f"opt_state holds the stages {sorted(states)} but this process keeps the parameters of "
            f"stages {sorted(groups)} of {placed.grid}. Remedy: pass the opt_state returned by "
            "this process's step.init / step(...) on the same grid."
        )
    out = placed.param_leaves(params, state_holes=state_holes)
    for s, idx in groups.items():
        if states[s].master is None:  # fp32 on the device: the parameters are the masters
            continue
        masters = plan_leaves(placed, engine.call, states[s].master)
        for i in idx:
            out[i] = masters[i]
    return jax.tree.unflatten(placed.plan.param_tree, out)


def _check_step_inputs(params, opt_state, batch=None) -> None:
    """Clear errors for a step traced by ``jax.jit``, an opt_state from elsewhere and for
    params an earlier step donated."""
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((params, opt_state, batch))):
        raise TypeError(
            "pm.train_step(...) returns a step that compiles itself (one jitted program per "
            "stage, donated inputs, fixed layouts; with a pipeline, a dispatch queue run from "
            "Python), so it cannot be traced by jax.jit, jax.grad or jax.vmap. Remedy: call it "
            "directly, step(params, opt_state, batch), without jax.jit; for a step of your own "
            "under jax.jit, use pm.apply (or pm.value_and_grad) and optax (README)."
        )
    if not isinstance(opt_state, OptState):
        raise TypeError(
            f"opt_state must be what step.init(params) returned (an OptState), got "
            f"{type(opt_state).__name__}. Remedy: params, opt_state = step.init(params), then "
            "pass both to every step (optimizer.init(params) is not enough: the step keeps "
            "master weights and the loss scale there)."
        )
    check_not_donated(params)
    check_not_donated(opt_state, "optimizer state leaf")


def _stable_repr(value) -> str:
    """``repr`` without memory addresses (functions and objects differ in those across ranks)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))
