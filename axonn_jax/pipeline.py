"""Pipelined training steps: ``pm.value_and_grad(loss_fn)`` when ``grid.pipeline > 1``.

Each process runs the stages it owns (one per process under ``mpiexec``, all of
them in a single process) through the dispatch queue
(:mod:`axonn_jax.runtime.dispatch`); activations and gradients move through
a transport (in-process device copies, or MPI between processes).

Parameters of a pipelined model form the model's usual pytree in which every
leaf lives on the mesh of the first stage (on this process) that uses it, and
leaves used by no stage of this process are ``None``. A parameter used by
several stages (tied embeddings) is copied to each of them and its gradient is
the sum of theirs, on every process that holds it.

Example (``mpiexec -n 2 python train.py``)::

    pm = axonn_jax.partition(model, axonn_jax.Grid(pipeline=2), tokens)
    params = pm.init(jax.random.key(0))        # this rank's stage only
    step = pm.value_and_grad(loss_fn, microbatches=4)
    loss, grads = step(params, tokens)         # grads: this rank's stage
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from axonn_jax.partitioner.trace import call_leaves
from axonn_jax.runtime.dispatch import DispatchQueue, StepResult
from axonn_jax.runtime.executor import Executor
from axonn_jax.runtime.stage_program import StageProgram, batch_sharding, place, stage_flows


@functools.lru_cache(maxsize=None)
def remat_wrapper(policy: str) -> Callable[[Callable], Callable]:
    """``f → apply_remat(f, policy)`` (one object per policy, so compiled programs are shared)."""
    from axonn_jax.remat import apply_remat, remat_policy

    remat_policy(policy)  # validates the name

    def wrap(fn: Callable) -> Callable:
        return apply_remat(fn, policy)

    return wrap


def resolve_remat(remat) -> Callable | None:
    """A policy name ("none", "full", "save_dots", "offload"), a wrapper, or None."""
    if remat is None or callable(remat):
        return remat
    return remat_wrapper(str(remat))


def default_inputs(batch) -> tuple:
    """The model's positional arguments from a batch: the batch itself, or its items."""
    return tuple(batch) if isinstance(batch, tuple) else (batch,)


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """How a pipelined step runs (see :meth:`axonn_jax.Partitioned.value_and_grad`)."""

    microbatches: int = 1
    schedule: str = "message"
    limit: int | None = None
    timeout: float = 60.0
    remat: Callable | None = None
    delay: Callable | None = None

    def __post_init__(self) -> None:
        from axonn_jax.runtime.schedules import check_schedule

        check_schedule(self.schedule)
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {self.microbatches}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1 microbatch in flight, got {self.limit}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """Which stages use which parameters, and each parameter's home stage here.

    ``home[i]`` is the first stage on this process that uses parameter ``i``
    (stage 0 for a parameter no stage uses), or ``None`` when no stage of this
    process needs it.
    """

    users: tuple[tuple[int, ...], ...]
    local: tuple[int, ...]
    home: tuple[int | None, ...]

    @classmethod
    def from_users(cls, users, local) -> StageLayout:
        home = []
        for stages in users:
            here = [s for s in stages if s in local] or ([0] if not stages and 0 in local else [])
            home.append(here[0] if here else None)
        return cls(tuple(map(tuple, users)), tuple(local), tuple(home))

    def is_local(self, i: int) -> bool:
        return self.home[i] is not None

    def shared(self) -> list[int]:
        """Parameters used by more than one stage."""
        return [i for i, stages in enumerate(self.users) if len(stages) > 1]


class PipelinedValueAndGrad:
    """``(params, batch) → (loss, grads)`` for a pipelined :class:`Partitioned`.

    The loss is the mean of the microbatch losses (equal to the full-batch loss
    for losses that average over examples) and is returned on every process;
    ``grads`` holds this process's leaves (``None`` elsewhere).
    """

    def __init__(self, pm, loss_fn: Callable, *, inputs: Callable | None, options: PipelineOptions):
        self.pm, self.loss_fn = pm, loss_fn
        self.inputs = inputs or default_inputs
        self.options = options
        self.last_result: StepResult | None = None

    # --- program set-up (once per input shapes) ------------------------------
    def _setup(self, args, kwargs):
        pm = self.pm
        traced, jaxpr, layouts = pm._program(args, kwargs)
        # shared by every step object with the same loss and remat: compiled once
        key = (self.loss_fn, self.options.remat, pm._signature(traced.arg_avals),
               traced.arg_tree, traced.static_args)
        cache = pm._stage_programs
        if key in cache:
            return cache[key]
        executor, flows = executor_and_flows(pm, traced, jaxpr, layouts)
        meshes = pm.stage_meshes
        last = len(flows) - 1
        programs = [
            StageProgram(f, executor, pm.grid, meshes[f.index], last=f.index == last,
                         out_tree=traced.out_tree, loss_fn=self.loss_fn,
                         remat=self.options.remat)  # fmt: skip
            for f in flows
        ]
        cache[key] = (traced, programs)
        return cache[key]

    # --- one step ---------------------------------------------------------------
    def __call__(self, params, batch) -> tuple[Any, Any]:
        pm, opts = self.pm, self.options
        m = opts.microbatches
        batch_leaves, batch_tree = jax.tree.flatten(batch)
        size = _check_batch(batch_leaves, m, pm.grid)
        mb_size = size // m

        def microbatch(mb):
            leaves = [leaf[mb * mb_size : (mb + 1) * mb_size] for leaf in batch_leaves]
            return jax.tree.unflatten(batch_tree, leaves)

        example = self.inputs(microbatch(0))
        traced, programs = self._setup(example, {})
        layout = pm.stage_layout
        leaves = pm._param_leaves(params)
        stage_params = {
            s: [_on(_planned(leaves[i], pm.plan.params[i]), programs[s].param_sharding(i))
                for i in programs[s].flow.params]
            for s in layout.local
        }
        args_cache: dict = {}

        def stage_args(s, mb):
            if (s, mb) not in args_cache:
                arg_leaves, _ = call_leaves(self.inputs(microbatch(mb)), {})
                prog = programs[s]
                args_cache[(s, mb)] = [
                    place(arg_leaves[j], prog.sharding(prog.executor.arg_layouts[j]))
                    for j in prog.flow.args
                ]
            return args_cache.pop((s, mb))

        last_mesh = programs[-1].mesh

        def loss_batch(mb):
            return jax.tree.map(
                lambda x: place(x, batch_sharding(last_mesh, pm.grid, np.shape(x))), microbatch(mb)
            )

        if not all(programs[s].compiled for s in layout.local):
            self._compile(programs, stage_params, stage_args, loss_batch)
        queue = DispatchQueue(programs, layout.local, pm.transport, schedule=opts.schedule,
                              limit=opts.limit, timeout=opts.timeout, delay=opts.delay)  # fmt: skip
        result = queue.run(stage_params, stage_args, loss_batch, m)
        self.last_result = result
        grads = self._combine(result, programs, leaves, m)
        loss = self._loss(result)
        return loss, jax.tree.unflatten(pm.plan.param_tree, grads)

    def _compile(self, programs, stage_params, stage_args, loss_batch) -> None:
        """Compile every local stage, then wait for all processes to have done so."""
        last = len(programs) - 1
        for s in self.pm.stage_layout.local:
            programs[s].compile(stage_params[s], stage_args(s, 0), loss_batch(0) if s == last else None)
        if self.pm.multiprocess:  # a peer still compiling must not look like a dead peer
            self.pm.transport.comm.Barrier()

    def trace(self, json_path=None, png_path=None, title: str = "pipeline timeline"):
        """The last step's tasks of every rank (on rank 0; ``None`` elsewhere).

        Writes a Chrome/Perfetto trace JSON and a PNG timeline when paths are given.
        """
        from axonn_jax.runtime import trace

        if self.last_result is None:
            raise RuntimeError("no step has run yet: call the step first, then trace()")
        comm = self.pm.transport.comm if self.pm.multiprocess else None
        rows = trace.gather(self.last_result, comm)
        if rows is not None:
            if json_path is not None:
                trace.write_chrome_trace(json_path, rows)
            if png_path is not None:
                trace.plot_timeline(png_path, rows, title)
        return rows

    def _combine(self, result: StepResult, programs, leaves, m: int) -> list:
        """Per-leaf gradient on its home mesh: the sum over local stages, divided by m."""
        layout = self.pm.stage_layout
        grads: list = [None] * len(leaves)
        for s, stage_grads in result.grads.items():
            for i, g in zip(programs[s].flow.params, stage_grads):
                g = _on(g, leaves[i].sharding)
                grads[i] = g if grads[i] is None else grads[i] + g
        for i in range(len(leaves)):
            if layout.is_local(i) and grads[i] is None:  # used by no stage
                grads[i] = jax.numpy.zeros_like(leaves[i])
        grads = [None if g is None else g / m for g in grads]
        if self.pm.multiprocess:
            grads = _sum_shared_across_processes(grads, layout, self.pm)
        return grads

    def _loss(self, result: StepResult):
        """Mean microbatch loss, computed on the last stage and sent to every process."""
        local = float(np.mean([float(x) for x in result.losses])) if result.losses else 0.0
        if not self.pm.multiprocess:
            return np.float32(local)
        comm = self.pm.transport.comm
        last_owner = min(d.process_index for d in self.pm.stage_meshes[-1].devices.flat)
        return np.float32(comm.bcast(local if comm.Get_rank() == last_owner else None, root=last_owner))


def executor_and_flows(pm, traced, jaxpr, layouts):
    """The model's executor and its per-stage data flows (``pm._program``'s outputs)."""
    from axonn_jax.partitioned import _output_layout

    executor = Executor(
        jaxpr.jaxpr, jaxpr.consts, pm.grid,
        param_storage=[p.storage for p in pm.plan.params],
        arg_layouts=layouts.args, out_layouts=layouts.outs, overlap=pm.overlap,
    )  # fmt: skip
    out_targets = [_output_layout(lay) for lay in layouts.outs]
    flows = stage_flows(jaxpr.jaxpr, pm.plan.stages, traced.num_params,
                        executor.layouts(), out_targets)  # fmt: skip
    return executor, flows


def _check_batch(leaves, microbatches: int, grid) -> int:
    if not leaves:
        raise ValueError("the batch is empty: pass the model inputs (and targets) as arrays")
    sizes = {int(np.shape(x)[0]) if np.ndim(x) else -1 for x in leaves}
    if len(sizes) != 1 or -1 in sizes:
        raise ValueError(
            f"every batch leaf needs the same leading batch dimension; got sizes {sorted(sizes)}"
        )
    size = sizes.pop()
    need = microbatches * grid.data * grid.z
    if microbatches < 1 or size % need:
        raise ValueError(
            f"batch size {size} is not divisible by microbatches × data × z = {microbatches} × "
            f"{grid.data} × {grid.z} = {need} (grid {grid}). Remedy: use a batch size that is a "
            "multiple of it, or fewer microbatches."
        )
    return size


def _planned(x: jax.Array, param) -> jax.Array:
    """A (possibly half-precision) parameter in the dtype the stage programs were built for."""
    return x if x.dtype == np.dtype(param.dtype) else x.astype(param.dtype)


def _on(x: jax.Array, sharding) -> jax.Array:
    return x if x.sharding == sharding else jax.device_put(x, sharding)


def _sum_shared_across_processes(grads: list, layout: StageLayout, pm) -> list:
    """Tied parameters held by several processes: each holder gets the sum of all copies.

    Each shard is exchanged with the processes holding the same mesh position
    in the other stages that use the parameter, and the partial sums are added
    in process order, so every copy receives bitwise the same gradient.
    """
    from mpi4py import MPI

    comm = pm.transport.comm
    me = comm.Get_rank()
    meshes = pm.stage_meshes
    for i in layout.shared():
        g = grads[i]
        if g is None:
            continue
        home = meshes[layout.home[i]]
        flat_home = list(home.devices.flat)
        partials, requests, shards = [], [], []
        for shard in g.addressable_shards:
            pos = flat_home.index(shard.device)
            peers = sorted({meshes[t].devices.flat[pos].process_index for t in layout.users[i]}
                           - {me})  # fmt: skip
            mine = np.ascontiguousarray(np.asarray(shard.data))
            received = {q: np.empty_like(mine) for q in peers}
            tag = (i * home.devices.size + pos) % 30000
            for q in peers:
                requests.append(comm.Isend(mine, dest=q, tag=tag))
                requests.append(comm.Irecv(received[q], source=q, tag=tag))
            partials.append((mine, received))
            shards.append(shard)
        MPI.Request.Waitall(requests)
        summed = []
        for (mine, received), shard in zip(partials, shards):
            parts = dict(received)
            parts[me] = mine
            total = parts[min(parts)].copy()
            for q in sorted(parts)[1:]:
                total = total + parts[q]
            summed.append(jax.device_put(total, shard.device))
        grads[i] = jax.make_array_from_single_device_arrays(g.shape, g.sharding, summed)
    return grads


def microbatched_value_and_grad(pm, loss_fn: Callable, inputs: Callable, microbatches: int,
                                remat: Callable | None = None) -> Callable:  # fmt: skip
    """Without a pipeline: a jittable ``(params, batch) → (loss, grads)``.

    Microbatches run one after another in the same program and their
    gradients are averaged (the loss is the mean of the microbatch losses).
    """

    def loss_of(params, batch):
        return loss_fn(pm.apply(params, *inputs(batch)), batch)

    grad_fn = jax.value_and_grad(remat(loss_of) if remat else loss_of)

    def value_and_grad(params, batch):
        if microbatches == 1:
            return grad_fn(params, batch)
        leaves, tree = jax.tree.flatten(batch)
        size = _check_batch(leaves, microbatches, pm.grid) // microbatches
        total_loss, total = 0.0, None
        for mb in range(microbatches):
            part = jax.tree.unflatten(tree, [x[mb * size : (mb + 1) * size] for x in leaves])
            loss, grads = grad_fn(params, part)
            total_loss = total_loss + loss
            total = grads if total is None else jax.tree.map(jax.numpy.add, total, grads)
        return total_loss / microbatches, jax.tree.map(lambda g: g / microbatches, total)

    return value_and_grad
