"""The engine: a planned model and how it runs, chosen once.

Everything that differs between a grid without pipeline and a pipeline grid
lives in one of two engines, and the choice between them is made in one
place, :func:`build_engine`:

* :class:`SingleMesh` (``pipeline == 1``): the model is one ``shard_map``-ed
  program per input signature on one mesh. ``apply`` is a pure function of
  JAX arrays, gradients come from ``jax.value_and_grad`` (microbatches
  accumulate in one program) and a train step is one jitted program.
* :class:`Pipelined` (``pipeline > 1``): stage programs on their own meshes,
  run by the dispatch queue (:mod:`axonn_jax.runtime.pipeline.dispatch`) with
  a transport between them; ``apply`` is a forward-only pass, gradients come
  from the queue, and the optimizer updates each stage (or, for optimizers
  that mix stages, the exact whole-model update in rounds).

Both implement :class:`Engine`: programs by input signature
(:class:`~axonn_jax.runtime.programs.ProgramCache`), placement
(:attr:`Engine.placed`, built at the first device use), ``init``, ``gather``,
``apply``, ``forward``, ``value_and_grad``, ``train_step`` (a
:class:`~axonn_jax.runtime.train_step.TrainStep` of the engine's kind),
``report`` and the form of the optimizer state a train step returns. The
face (:class:`axonn_jax.Partitioned`) holds one engine and delegates to it;
nothing in the runtime calls back into the face.

Example:
    >>> engine = build_engine(model, plan, program, PlanOptions())   # doctest: +SKIP
    >>> params = engine.init(jax.random.key(0))                      # doctest: +SKIP
    >>> loss, grads = engine.value_and_grad(loss_fn)(params, batch)   # doctest: +SKIP
"""

from __future__ import annotations

from axonn_jax.partitioner.plan import Plan
from axonn_jax.partitioner.program import PlanOptions, Program
from axonn_jax.runtime.engine.base import Engine
from axonn_jax.runtime.engine.pipelined import Pipelined
from axonn_jax.runtime.engine.single_mesh import SingleMesh
from axonn_jax.runtime.overlap import Overlap

__all__ = ["Engine", "Pipelined", "SingleMesh", "build_engine"]


def build_engine(model, plan: Plan, program: Program, options: PlanOptions, *,
                 overlap: Overlap = Overlap()) -> Engine:  # fmt: skip
    """The engine of ``plan``: :class:`Pipelined` with pipeline stages, else :class:`SingleMesh`.

    Pure (no devices): the engine places the plan at its first device use.
    """
    engine = Pipelined if plan.grid.pipeline > 1 else SingleMesh
    return engine(model, plan, program, options, overlap=overlap)
