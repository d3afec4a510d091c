"""The engine of a pipeline grid: stage programs on their own meshes, run by the dispatch queue."""

from __future__ import annotations

import functools

import jax

from axonn_jax.runtime.engine.base import Engine, is_traced
from axonn_jax.runtime.pipeline.forward import pipelined_forward
from axonn_jax.runtime.pipeline.setup import StagePrograms
from axonn_jax.runtime.pipeline.training import PipelinedValueAndGrad, PipelineOptions
from axonn_jax.runtime.stage_report import PipelineReport, pipeline_report
from axonn_jax.runtime.train_step import PipelinedStep


class Pipelined(Engine):
    """Stage programs on the stage meshes, run through the dispatch queue and a transport.

    Each process runs its own stages (:attr:`PlacedModel.homes`); parameters
    of other processes' stages are ``None`` in its pytrees. Everything here is
    eager Python around compiled stage programs, so it runs outside ``jax.jit``.
    Training and forward-only passes share the set-up of
    :mod:`~axonn_jax.runtime.pipeline.setup` and the :attr:`stages` cache.
    """

    step_type = PipelinedStep

    @property
    def mesh(self) -> jax.sharding.Mesh:
        raise ValueError(
            f"{self.grid} has pipeline={self.grid.pipeline}: each stage has its own "
            "mesh (pm.stage_meshes); the model trains through pm.value_and_grad / "
            "pm.train_step and runs forward through pm.apply / pm.forward. pm.mesh needs "
            "pipeline=1."
        )

    @functools.cached_property
    def stages(self) -> StagePrograms:
        """The stage programs, built once per input signature and purpose."""
        return StagePrograms(self.programs, self.placed.meshes, self.overlap)

    # --- execution ------------------------------------------------------------
    def apply(self, params, args, kwargs):
        return self.forward(params, args, kwargs)

    def forward(self, params, args, kwargs, *, microbatches=1, timeout=60.0):
        if is_traced((params, args, kwargs)):
            raise ValueError(
                f"pm.apply on a pipeline grid ({self.grid}) runs the stages from Python, one "
                "process per stage, so it cannot be traced by jax.jit/jax.grad. Remedy: call "
                "pm.apply (or pm.forward) outside jax.jit for evaluation and sampling, and "
                "train with pm.value_and_grad / pm.train_step."
            )
        params, _ = self.plan_tree(params)
        return pipelined_forward(self.stages, self.placed, params, args, kwargs,
                                 microbatches=microbatches, timeout=timeout)  # fmt: skip

    def _value_and_grad(self, loss_fn, inputs, microbatches, remat, pipeline):
        options = PipelineOptions(microbatches, remat=remat, **pipeline)
        return PipelinedValueAndGrad(self.stages, self.placed, self.call, loss_fn, inputs=inputs, options=options)

    def _build_report(self, program, args, kwargs, *, optimizer_slots) -> PipelineReport:
        """Every stage's step (collectives, memory, FLOPs), the messages between them, summed."""
        return pipeline_report(self.plan, program, args, kwargs, overlap=self.overlap, optimizer_slots=optimizer_slots)

    # --- optimizer state ------------------------------------------------------
    def init_optimizer(self, optimizer, params, *, wrap=lambda tree: tree):
        raise ValueError(
            f"init_optimizer lays the state out on one mesh, and {self.grid} has "
            f"{self.grid.pipeline} stage meshes. Remedy: step = pm.train_step(loss_fn, "
            "optimizer); params, opt_state = step.init(params)."
        )

    def pack_states(self, states):
        return dict(states)  # {stage: state}, this process's stages

    def unpack_states(self, packed):
        return dict(packed) if isinstance(packed, dict) else None
