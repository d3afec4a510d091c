"""Forward-only passes over pipeline stages: ``pm.apply`` when ``grid.pipeline > 1``.

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

from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from axonn_jax.partitioner.program import Program
from axonn_jax.partitioner.trace import call_leaves
from axonn_jax.runtime.executor import Executor
from axonn_jax.runtime.model_call import ModelCall, microbatch_rngs
from axonn_jax.runtime.overlap import Overlap
from axonn_jax.runtime.pipeline.dispatch import DispatchQueue
from axonn_jax.runtime.pipeline.runner import _check_batch, _on, _planned, check_microbatches
from axonn_jax.runtime.pipeline.state_updates import deliver_updates
from axonn_jax.runtime.pipeline.stage_program import StageProgram
from axonn_jax.runtime.placement import PlacedModel
from axonn_jax.runtime.sharded import place

#: ``programs(args, kwargs)`` → the Program of the model called on those inputs
ProgramSource = Callable[[tuple, dict], Program]


def pipelined_forward(placed: PlacedModel, programs: ProgramSource, params, args: tuple,
                      kwargs: dict, *, microbatches: int = 1, overlap: Overlap = Overlap(),
                      timeout: float = 60.0):  # fmt: skip
    """The model's outputs for ``args``/``kwargs`` (split into ``microbatches`` along dim 0)."""
    m = check_microbatches(microbatches)
    rngs = kwargs.get("rngs")
    call = {k: v for k, v in kwargs.items() if k != "rngs"}
    leaves, tree = jax.tree.flatten((args, call))
    arrays = [i for i, x in enumerate(leaves) if hasattr(x, "shape") and np.ndim(x) > 0]
    size = _check_batch([leaves[i] for i in arrays], m, placed.grid) // m

    def microbatch(mb):
        part = list(leaves)
        for i in arrays:
            part[i] = leaves[i][mb * size : (mb + 1) * size]
        mb_args, mb_kwargs = jax.tree.unflatten(tree, part)
        if rngs:  # one stream per microbatch, as in training
            mb_kwargs["rngs"] = microbatch_rngs(rngs, mb, m)
        return mb_args, mb_kwargs

    program, stages = _forward_programs(placed, programs, *microbatch(0), overlap)
    ModelCall.of(program.traced).check_microbatches(m)  # nnx RNG state: one key per call
    plan, local = placed.plan, placed.homes.local
    param_leaves = placed.param_leaves(params)
    stage_params = {s: [_on(_planned(param_leaves[i], plan.params[i]), stages[s].param_sharding(i))
                        for i in stages[s].flow.params] for s in local}  # fmt: skip

    def stage_args(s, mb):
        arg_leaves, _ = call_leaves(*microbatch(mb))
        st = stages[s]
        return [place(arg_leaves[j], st.sharding(st.executor.arg_layouts[j])) for j in st.flow.args]

    if not all(stages[s].forward_compiled for s in local):
        for s in local:
            stages[s].compile_forward_only(stage_params[s], stage_args(s, 0))
        placed.host.barrier()  # a peer still compiling must not look like a dead peer
    queue = DispatchQueue(stages, local, placed.transport, timeout=timeout)
    result = queue.run_forward(stage_params, stage_args, m)
    full = _outputs(placed, stages[-1], result.outputs, program)
    for k, x in _state_updates(placed, program, stages, result.updates, param_leaves, m).items():
        full[k] = x
    return jax.tree.unflatten(program.out_tree, full)


def _forward_programs(placed: PlacedModel, programs: ProgramSource, args, kwargs, overlap):
    program = programs(args, kwargs)
    key = (program.signature, "forward", overlap)
    cache = placed.stage_programs
    if key not in cache:
        executor = Executor(program, overlap=overlap)
        cache[key] = (program, [StageProgram(f, executor, placed.meshes[f.index],
                                             last=f.index == len(program.stage_flows) - 1)
                                for f in program.stage_flows])  # fmt: skip
    return cache[key]


def _outputs(placed: PlacedModel, last: StageProgram, per_microbatch: list, program: Program) -> list:
    """Every model output leaf as a host array, on every process (state outputs: ``None``)."""
    host = None
    if per_microbatch:  # this process runs the last stage: gather each output to one copy
        replicated = NamedSharding(last.mesh, P())
        parts = [jax.jit(lambda xs: xs, out_shardings=[replicated] * len(xs))(list(xs))
                 for xs in per_microbatch]  # fmt: skip
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


def _state_updates(placed: PlacedModel, program: Program, stages: list[StageProgram],
                   summed: dict[int, list], param_leaves: list, m: int) -> dict:  # fmt: skip
    """Output position → updated state leaf (mean over microbatches), held as its variable is.

    A state output the model returns unchanged is its variable as held;
    ``None`` where another process holds it.
    """
    updated = deliver_updates(placed, stages, {s: u or [] for s, u in summed.items()},
                              param_leaves, m)  # fmt: skip
    return {k: param_leaves[i] if updated[i] is None else updated[i]
            for k, i in program.traced.state_outputs}  # fmt: skip


def is_traced(tree) -> bool:
    """True inside ``jax.jit`` (or another transformation): some leaf is a tracer."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


