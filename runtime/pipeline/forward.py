"""Forward-only passes over pipeline stages: ``pm.apply`` / ``pm.forward`` of the Pipelined engine.

Evaluation and sampling need the model's outputs, not its gradients. The
stages run through the same dispatch queue as training
(:mod:`axonn_jax.runtime.pipeline.dispatch`, forward tasks only, message-driven:
each stage runs whichever microbatch has arrived) with programs that keep no
residuals. The outputs of the last stage are gathered and sent to every
process, as host NumPy arrays in the model's output structure. Updated model
state (``mutable=["batch_stats"]``, nnx state) stays on the stage that
computes it, like the parameters: device arrays in their storage layout
(``None`` for leaves another process holds), the mean over microbatches.

It is eager (the queue is Python), so it cannot run inside ``jax.jit``.

Example::

    logits = pm.apply(params, tokens)                       # pipeline=2: every process
    logits = pm.forward(params, tokens, microbatches=4)     # stages overlap on microbatches
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from axonn_jax.partitioner.program import Program
from axonn_jax.runtime.microbatches import call_slices, check_microbatches
from axonn_jax.runtime.model_call import ModelCall
from axonn_jax.runtime.agreement import agree_on_call, call_description
from axonn_jax.runtime.pipeline.dispatch import DispatchQueue
from axonn_jax.runtime.pipeline.setup import StagePrograms, compile_stages, stage_inputs
from axonn_jax.runtime.pipeline.stage_program import StageProgram
from axonn_jax.runtime.pipeline.state_updates import deliver_updates
from axonn_jax.runtime.placement import PlacedModel
from axonn_jax.runtime.sharded import replicate


def pipelined_forward(stages: StagePrograms, placed: PlacedModel, params, args: tuple, kwargs: dict, *,
                      microbatches: int = 1, timeout: float = 60.0):  # fmt: skip
    """The model's outputs for ``args``/``kwargs`` (split into ``microbatches`` along dim 0)."""
    described = call_description(dict(args=args, kwargs=kwargs), microbatches=microbatches)
    agree_on_call(placed.host, "pm.apply", described, timeout)  # before any collective: bounded
    m = check_microbatches(microbatches)
    microbatch = call_slices(args, kwargs, m, placed.grid)
    program, programs = stages.forward(*microbatch(0))
    ModelCall.of(program.traced).check_microbatches(m)  # nnx RNG state: one key per call
    param_leaves, inputs, error = stage_inputs(  # a leaf no stage reads may be None: e.g. a dropout counter
        programs, placed, lambda: placed.param_leaves(params, unread_holes=True), microbatch)
    compile_stages(programs, placed, lambda st: st.forward_compiled,
                   lambda s: programs[s].compile_forward_only(inputs.params[s], inputs.args(s, 0)), error)
    queue = DispatchQueue(programs, placed.homes.local, placed.transport, timeout=timeout)
    result = queue.run_forward(inputs.params, inputs.args, m)
    full = _outputs(placed, programs[-1], result.outputs, program)
    for k, x in _state_updates(placed, program, programs, result.updates, param_leaves, m).items():
        full[k] = x
    return jax.tree.unflatten(program.out_tree, full)


def _outputs(placed: PlacedModel, last: StageProgram, per_microbatch: list, program: Program) -> list:
    """Every model output leaf as a host array, on every process (state outputs: ``None``)."""
    host = None
    if per_microbatch:  # this process runs the last stage: gather each output to one copy
        parts = [replicate(list(xs), last.mesh) for xs in per_microbatch]
        host = [np.concatenate([np.asarray(p[k].addressable_data(0)) for p in parts])
                if np.ndim(parts[0][k]) else np.asarray(parts[0][k].addressable_data(0))
                for k in range(len(parts[0]))]  # fmt: skip
    if placed.multiprocess:
        owner = min(d.process_index for d in last.mesh.devices.flat)
        host = placed.host.broadcast(host, root=owner)
    full = [None] * program.out_tree.num_leaves
    for k, x in zip(last.flow.output_positions, host):
        full[k] = x
    return full


def _state_updates(placed: PlacedModel, program: Program, stages: Sequence[StageProgram],
                   summed: dict[int, list], param_leaves: list, m: int) -> dict:  # fmt: skip
    """Output position → updated state leaf (mean over microbatches), held as its variable is.

    A state output the model returns unchanged is its variable as held;
    ``None`` where another process holds it.
    """
    updated = deliver_updates(placed, stages, summed, param_leaves, m)
    return {k: param_leaves[i] if updated[i] is None else updated[i]
            for k, i in program.traced.state_outputs}  # fmt: skip

