"""What a pipelined call sets up before the dispatch queue runs: shared by training and forward passes.

* :class:`StagePrograms`: the :class:`~axonn_jax.runtime.pipeline.stage_program.StageProgram`
  of every stage, built once per input signature and purpose (training with a
  given loss and remat, or forward only) and kept, so that every step object
  with the same inputs compiles once.
* :class:`StageInputs`: one call's parameters on each local stage's mesh (in
  the dtype the programs were built for) and each microbatch's arguments,
  placed where the stage reads them.
* :func:`stage_inputs`: the parameter leaves and :class:`StageInputs`, or the error
  building them raised on this process.
* :func:`compile_stages`: compile the local stages ahead of the first run,
  then wait for every process (a peer still compiling must not look dead); an
  error of one process raises on all.

Example:
    >>> program, stages = stage_programs.training(args, kwargs, loss_fn, remat=None, call=call)  # doctest: +SKIP
    >>> inputs = StageInputs(stages, placed, param_leaves, lambda mb: (args, kwargs))  # doctest: +SKIP
    >>> compile_stages(stages, placed, lambda st: st.compiled, compile_one)             # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from axonn_jax.partitioner.program import Program, call_signature
from axonn_jax.partitioner.trace import call_leaves
from axonn_jax.runtime.collectives import raise_together
from axonn_jax.runtime.executor import Executor
from axonn_jax.runtime.loss_program import loss_program, without_batch
from axonn_jax.runtime.model_call import ModelCall
from axonn_jax.runtime.overlap import Overlap
from axonn_jax.runtime.pipeline.layer_rows import rows_given
from axonn_jax.runtime.pipeline.stage_program import StageProgram
from axonn_jax.runtime.placement import PlacedModel
from axonn_jax.runtime.programs import ProgramCache
from axonn_jax.runtime.sharded import place

#: the stage programs of one call: its Program and one StageProgram per stage (stage 0 first)
Stages = tuple[Program, list[StageProgram]]


class StagePrograms:
    """The stage programs of a pipelined model, per input signature and purpose (built once)."""

    def __init__(self, programs: ProgramCache, meshes: Sequence, overlap: Overlap = Overlap()):
        self.programs, self.meshes, self.overlap = programs, list(meshes), overlap
        self._built: dict = {}
        self._planned: dict = {}  # (call signature, loss, remat) → the loss's Program, or why not

    def training(self, args: tuple, kwargs: dict, loss_fn: Callable, *, remat: Callable | None,
                 call: ModelCall) -> Stages:  # fmt: skip
        """Forward, backward and (last stage) forward+loss+backward programs for these inputs;
        ``loss_fn(outputs, batch) → (loss, aux)`` (a :class:`~axonn_jax.runtime.loss_program.ScalarLoss`,
        or :func:`~axonn_jax.runtime.loss_program.scaled_loss` of one)."""
        program = self.programs.for_call(args, kwargs)

        def model_loss(result, batch):  # (outputs, updates) of a model with state → outputs
            return loss_fn(call.outputs(result)[0], batch)

        def build(flow, executor, mesh, last):
            return StageProgram(flow, executor, mesh, last=last, out_tree=program.out_tree, loss_fn=model_loss,
                                remat=remat, trainable=program.traced.trainable)  # fmt: skip

        return self._get(program, ("training", loss_fn, remat), build)

    def planned_training(self, args: tuple, kwargs: dict, loss_fn: Callable, *, remat: Callable | None,
                         call: ModelCall) -> Stages:  # fmt: skip
        """As :meth:`training`, the loss planned with the last stage (``kwargs`` hold the batch
        under :data:`~axonn_jax.runtime.loss_program.BATCH_KEYWORD`; its last stage's outputs are
        the loss). Raises ``ValueError`` (kept, raised again) when the loss cannot be planned so."""
        key = (call_signature(args, kwargs), loss_fn, remat)
        if key not in self._planned:
            try:
                model = self.programs.for_call(args, without_batch(kwargs))
                self._planned[key] = loss_program(model, self.programs.plan, self.programs.options, call,
                                                  loss_fn, args, kwargs)  # fmt: skip
            except Exception as err:  # noqa: BLE001 - the caller runs the loss after the model
                self._planned[key] = err
        program = self._planned[key]
        if isinstance(program, Exception):
            raise program

        def loss_of(result, batch):  # the stage's outputs are the loss (and the state updates)
            del batch  # a model argument of the planned program
            return call.outputs(result)[0]

        def build(flow, executor, mesh, last):
            return StageProgram(flow, executor, mesh, last=last, out_tree=program.out_tree, loss_fn=loss_of,
                                remat=remat, trainable=program.traced.trainable)  # fmt: skip

        return self._get(program, ("planned", loss_fn, remat), build)

    def forward(self, args: tuple, kwargs: dict) -> Stages:
        """Forward-only programs (no residuals kept) for these inputs."""
        program = self.programs.for_call(args, kwargs)
        return self._get(program, ("forward",), lambda flow, ex, mesh, last: StageProgram(flow, ex, mesh, last=last))

    def _get(self, program: Program, purpose: tuple, build: Callable) -> Stages:
        key = (program.signature, *purpose)
        if key not in self._built:
            executor = Executor(program, overlap=self.overlap)
            last = len(program.stage_flows) - 1
            self._built[key] = (program, [build(f, executor, self.meshes[f.index], f.index == last)
                                          for f in program.stage_flows])  # fmt: skip
        return self._built[key]


class StageInputs:
    """One call's parameters on each local stage and its microbatches' arguments.

    Args:
        stages: every stage's program (stage index order).
        placed: the model on this process's devices.
        param_leaves: the parameter leaves as held here (``None`` for other processes').
        calls: ``calls(mb)`` → the model call ``(args, kwargs)`` of microbatch ``mb``.
    """

    def __init__(self, stages: Sequence[StageProgram], placed: PlacedModel, param_leaves: Sequence,
                 calls: Callable[[int], tuple[tuple, dict]]):  # fmt: skip
        self.stages, self._calls = list(stages), calls
        params = placed.plan.params
        #: local stage → its parameters (``flow.params`` order) on its mesh, in the planned dtype
        #: (of a stacked parameter, the rows of its layers: ``layer_rows``)
        self.params = {s: [place(rows_given(self.stages[s].flow, i, in_planned_dtype(param_leaves[i], params[i])),
                                 self.stages[s].param_sharding(i)) for i in self.stages[s].flow.params]
                       for s in placed.homes.local}  # fmt: skip

    def args(self, stage: int, mb: int) -> list:
        """The model arguments stage ``stage`` reads, of microbatch ``mb``, on its mesh."""
        arg_leaves, _ = call_leaves(*self._calls(mb))
        st = self.stages[stage]
        return [place(arg_leaves[j], st.sharding(st.executor.arg_layouts[j])) for j in st.flow.args]


def stage_inputs(stages: Sequence[StageProgram], placed: PlacedModel, leaves_of: Callable[[], list],
                 calls: Callable) -> tuple[list | None, StageInputs | None, BaseException | None]:  # fmt: skip
    """``(parameter leaves, StageInputs, None)``, or ``(None, None, error)`` when building them
    failed on this process (a leaf its stage reads is missing): hand the error to
    :func:`compile_stages`, which raises it on every process instead of here alone."""
    try:
        leaves = leaves_of()
        return leaves, StageInputs(stages, placed, leaves, calls), None
    except Exception as err:  # noqa: BLE001 - raised again by compile_stages
        return None, None, err


def compile_stages(stages: Sequence[StageProgram], placed: PlacedModel, compiled: Callable[[StageProgram], bool],
                   compile_one: Callable[[int], None], error: BaseException | None = None) -> None:  # fmt: skip
    """Compile this process's stages unless ``compiled`` says they are, then wait for every
    process (a peer still compiling must not look like a dead peer); a stage that fails to
    trace or compile (a refused loss), or ``error`` (this process could not prepare its
    stages' inputs), raises on every process. Once compiled, ``error`` is raised here (the
    others' stages then time out waiting for this one). The collective runs only where a stage
    must compile: every process gets here with the same input shapes (the call's agreement,
    :mod:`~axonn_jax.runtime.agreement`, raised otherwise), so all compile or none."""
    local = placed.homes.local
    if all(compiled(stages[s]) for s in local):
        if error is not None:
            raise error
        return
    try:
        for s in local if error is None else ():
            compile_one(s)
    except Exception as err:  # noqa: BLE001 - raised again by raise_together, on every process
        error = err
    raise_together(placed.host, error, "building the pipeline stages")


def in_planned_dtype(x: jax.Array, param) -> jax.Array:
    """A (possibly half-precision) parameter in the dtype the stage programs were built for."""
    return x if x.dtype == np.dtype(param.dtype) else x.astype(param.dtype)
