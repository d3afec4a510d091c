"""What every engine does and the interface the two engines share (:class:`Engine`)."""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from axonn_jax.partitioner.plan import Plan
from axonn_jax.partitioner.program import PlanOptions, Program, call_signature
from axonn_jax.partitioner.trace import abstract_call
from axonn_jax.runtime.loss_program import BATCH_KEYWORD, ScalarLoss, loss_program
from axonn_jax.runtime.microbatches import default_inputs
from axonn_jax.runtime.model_call import ModelCall, check_differentiable, is_params_of_state, unwrap_params
from axonn_jax.runtime.overlap import Overlap
from axonn_jax.runtime.placement import PlacedModel
from axonn_jax.runtime.programs import ProgramCache
from axonn_jax.runtime.remat import resolve_remat

if TYPE_CHECKING:
    from axonn_jax.runtime.stage_report import PipelineReport
    from axonn_jax.runtime.step_report import StepReport
    from axonn_jax.runtime.train_step import TrainStep


class Engine(abc.ABC):
    """A planned model and how it runs on this process's devices.

    Built (without devices) by :func:`~axonn_jax.runtime.engine.build_engine`;
    :attr:`placed` puts the plan on the meshes at the first device use. The
    subclasses (:class:`~axonn_jax.runtime.engine.SingleMesh`,
    :class:`~axonn_jax.runtime.engine.Pipelined`) say how the model runs:
    :meth:`apply`, :meth:`forward`, :meth:`value_and_grad`, :meth:`train_step`
    and the optimizer-state forms (:meth:`pack_states`, :meth:`unpack_states`).
    """

    def __init__(self, model, plan: Plan, program: Program, options: PlanOptions, *,
                 overlap: Overlap = Overlap()):  # fmt: skip
        self.model, self.plan, self.grid = model, plan, plan.grid
        self.program, self.options, self.overlap = program, options, overlap
        #: the Programs of this model by input signature
        self.programs = ProgramCache(model, plan, program, options)
        #: how training calls the model (flags, RNG streams, state)
        self.call = ModelCall.of(program.traced)
        self._placed: PlacedModel | None = None
        self._reports: dict = {}  # (call signature, optimizer slots) → report

    # --- programs -------------------------------------------------------------
    def program_for(self, args: tuple, kwargs: dict) -> Program:
        """The :class:`Program` for a call with these inputs (traced once per signature)."""
        return self.programs.for_call(args, kwargs)

    def fingerprint(self) -> dict:
        """What every rank of a job must agree on (see :mod:`axonn_jax.runtime.consistency`)."""
        from axonn_jax.runtime.consistency import fingerprint

        return fingerprint(self.model, self.plan, self.program, dataclasses.asdict(self.options))

    # --- devices --------------------------------------------------------------
    @property
    def placed(self) -> PlacedModel:
        """The plan on this process's stage meshes (built on first use, after every rank agreed)."""
        if self._placed is None:
            from axonn_jax.runtime.consistency import check_consistent
            from axonn_jax.runtime.mesh import stage_meshes

            check_consistent(self.fingerprint())  # all ranks: same grid, model, inputs
            self._placed = PlacedModel(self.plan, stage_meshes(self.grid))
        return self._placed

    @property
    @abc.abstractmethod
    def mesh(self) -> jax.sharding.Mesh:
        """The one mesh of the model (only a :class:`SingleMesh` has one)."""

    def plan_tree(self, tree) -> tuple[Any, bool]:
        """``tree`` as the plan holds it, and whether it came as ``{'params': tree}``."""
        return unwrap_params(tree, self.plan.param_tree)

    # --- parameters -----------------------------------------------------------
    def init(self, key: jax.Array):
        """Parameters initialised directly in their layout (nnx modules: their own values, placed)."""
        traced = self.program.traced
        if traced.kind == "nnx":
            return self.placed.shard(traced.init(key))
        return self.placed.init(traced.init, key)

    def gather(self, params, opt_state=None):
        """Full parameters as host arrays, on every process; the float32 masters of
        ``opt_state`` (a train step's) in place of the device values where it keeps them.

        ``params`` may be the ``params`` alone of a model with state (returned alone)."""
        alone = self.is_params_alone(params)
        if alone:  # the state's leaves left out (None)
            params = self.call.merge(params, self._state_holes())
        if opt_state is not None:
            from axonn_jax.runtime.train_step import master_params

            params = master_params(self, params, opt_state, state_holes=alone)
        full = self.placed.gather(params, state_holes=alone)
        return self.call.split(full)[0] if alone else full

    def is_params_alone(self, tree) -> bool:
        """Whether ``tree`` is the ``params`` collection alone of a model with state."""
        return self.call.stateful and is_params_of_state(tree, self.plan.param_tree)

    def trainable(self, tree):
        """The ``params`` an optimizer sees: of a model with state, ``tree['params']``
        (``tree`` the variables dict, or its ``params`` already); else ``tree`` itself."""
        if not self.call.stateful or self.is_params_alone(tree):
            return tree
        self.placed.check_params(tree, dtypes=False)
        return self.call.split(tree)[0]

    def _state_holes(self):
        """The model-state collections with ``None`` leaves."""
        holes = jax.tree.unflatten(self.plan.param_tree, [None] * len(self.plan.params))
        return self.call.split(holes)[1]

    @abc.abstractmethod
    def init_optimizer(self, optimizer, params, *, wrap: Callable = lambda tree: tree):
        """``optimizer.init(params)`` laid out as a jitted step returns it.

        ``wrap(tree)``: a plan-shaped tree in the form ``params`` came in (the
        face accepts the linen variables dict ``{'params': ...}`` too). Of a
        model with state the optimizer sees ``params`` only (:meth:`trainable`).
        """

    # --- execution ------------------------------------------------------------
    @abc.abstractmethod
    def apply(self, params, args: tuple, kwargs: dict):
        """The model's outputs, as ``model.apply`` returns them (``params`` may be ``{'params': tree}``)."""

    @abc.abstractmethod
    def forward(self, params, args: tuple, kwargs: dict, *, microbatches: int = 1, timeout: float = 60.0):
        """The model's outputs; with a pipeline, a forward-only pass over ``microbatches``."""

    def value_and_grad(self, loss_fn: Callable, *, inputs: Callable | None = None, microbatches: int = 1,
                       schedule: str = "message", limit: int | None = None, timeout: float = 60.0,
                       remat: str | Callable | None = None, delay: Callable | None = None,
                       asynchronous: bool = True, has_aux: bool = False) -> Callable:  # fmt: skip
        """``(params, batch, rngs=None) → (loss, grads)``, ``((loss, aux), grads)`` with ``has_aux``
        (see :meth:`axonn_jax.Partitioned.value_and_grad`)."""
        check_differentiable(self.plan.params)
        if inputs is not None and not callable(inputs):
            raise TypeError(
                f"inputs must be a function of the batch that returns the model's inputs, got a "
                f"{type(inputs).__name__}. Remedy: inputs=lambda batch: (batch[0],) "
                "(positional inputs) or inputs=lambda batch: {'x': batch['x']} (keywords)."
            )
        if inputs is None:  # the batch, its items, or (a dict batch) the keyword inputs of partition()'s call
            inputs = functools.partial(default_inputs, keywords=self.call.keywords)
        return self._value_and_grad(ScalarLoss.of(loss_fn, has_aux), inputs, microbatches, resolve_remat(remat),
                                    dict(schedule=schedule, limit=limit, timeout=timeout, delay=delay,
                                         asynchronous=asynchronous))  # fmt: skip

    @abc.abstractmethod
    def _value_and_grad(self, loss_fn: ScalarLoss, inputs: Callable, microbatches: int,
                        remat: Callable | None, pipeline: dict[str, Any]) -> Callable:  # fmt: skip
        """The gradient function; ``pipeline``: the dispatch queue's options.

        ``inputs(batch)`` returns the model's inputs: a tuple (positional) or a
        dict (keywords), joined to the call's flags by ``self.call.of_inputs``.
        """

    #: the :class:`~axonn_jax.runtime.train_step.TrainStep` of this engine
    step_type: type[TrainStep]

    def train_step(self, loss_fn: Callable, optimizer, **options) -> TrainStep:
        """A complete step (see :meth:`axonn_jax.Partitioned.train_step`)."""
        return self.step_type(self, loss_fn, optimizer, **options)

    def report(self, args: tuple, kwargs: dict, *, optimizer_slots: int = 2, loss_fn: Callable | None = None,
               batch=None) -> StepReport | PipelineReport:  # fmt: skip
        """Communication, memory and FLOPs of one training step (traced, no devices; per stage on
        pipelines), once per input signature; no inputs: the example inputs given to ``partition``.

        With ``loss_fn`` (and its ``batch``), the step with its loss planned with the model, as
        ``value_and_grad(loss_fn)`` runs it; ``ValueError`` if that loss cannot be planned."""
        if not args and not kwargs:
            args, kwargs = self.program.traced.example_call()
        key = (call_signature(args, kwargs), optimizer_slots, loss_fn,
               None if loss_fn is None else call_signature((batch,), {}))  # fmt: skip
        if key not in self._reports:
            args, kwargs = abstract_call(args, kwargs)
            program = self.program_for(args, kwargs)
            if loss_fn is not None:
                kwargs = {**kwargs, BATCH_KEYWORD: abstract_call((batch,), {})[0][0]}
                program = loss_program(program, self.plan, self.options, self.call, loss_fn, args, kwargs)
            self._reports[key] = self._build_report(program, args, kwargs, optimizer_slots=optimizer_slots)
        return self._reports[key]

    @abc.abstractmethod
    def _build_report(self, program: Program, args: tuple, kwargs: dict, *,
                      optimizer_slots: int) -> StepReport | PipelineReport:  # fmt: skip
        """:meth:`report`'s result for one call (abstract ``args``/``kwargs``)."""

    # --- optimizer state: the form a train step returns ---------------------------
    @abc.abstractmethod
    def pack_states(self, states: dict[int, Any]) -> Any:
        """Per-stage optimizer states (this process's stages) in the form ``step(...)`` returns."""

    @abc.abstractmethod
    def unpack_states(self, packed) -> dict[int, Any] | None:
        """:meth:`pack_states`'s form back as ``{stage: state}``; ``None`` if ``packed`` is
        not of that form (another optimizer's state, e.g. from ``pm.init_optimizer``)."""


def is_traced(tree) -> bool:
    """True inside ``jax.jit`` (or another transformation): some leaf is a tracer (every
    process traces the call there; nothing runs from Python, nothing is agreed on the host)."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))
