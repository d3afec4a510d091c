"""The dependency-driven dispatch queue of one process (AxoNN's message-driven pipeline).

Tasks (:class:`~axonn_jax.runtime.pipeline.tasks.Task`) are forwards and
backwards of the stages this process owns. A task is ready when its input has *arrived*: stage 0's forwards need
nothing (but stage ``s`` keeps at most ``limit - s`` microbatches between
forward and backward), other forwards need the previous stage's activation,
backwards need the next stage's gradient; the last stage runs its backward
right after its forward (one program). The queue posts the receives of
the next messages on every link (as many as may be sent before one is
consumed, so no sender waits on a receive), asks its
:class:`~axonn_jax.runtime.pipeline.schedules.Schedule` which ready task to
run (the message-driven schedule: whichever has its input, backward first;
``"1f1b"`` and ``"gpipe"``: a fixed order per stage, for comparison), and
hands outputs to the transport without waiting. With a zero-bubble schedule
(``"zb"``, ``"zb-h1"``) a backward is two tasks: B sends the input gradients
and keeps what W needs; W, ready as soon as its B has run, sums the weight
gradients.

Dispatch is asynchronous: a task's program is launched and the queue moves on
at once, so the stages of one process compute at the same time on their own
devices. An input has arrived when its arrays are *ready* (``is_ready()``),
not merely handed over as futures, so what runs next is still decided by what
has arrived. The queue never waits on its own outputs: each device group
(mesh) holds at most ``depth`` launched, unfinished tasks (the next one queued
behind the running one), and a watcher thread per mesh notes when each task
finishes, which wakes the queue. ``asynchronous=False`` runs one task at a
time (each waited for before the next is picked), the baseline the overlap is
measured against.

Every task is recorded (stage, kind, microbatch, start, end, idle time before
it) for :mod:`axonn_jax.runtime.pipeline.timeline`: a task starts when it was
launched or when the task before it on the same mesh finished, whichever is
later, and ends when its outputs are ready.

Example:
    >>> queue = DispatchQueue(programs, [0, 1], transport, schedule="message")      # doctest: +SKIP
    >>> run = queue.run_training(params, microbatch_args, microbatch_batches, 4)  # doctest: +SKIP
    >>> run.losses, run.records[0]                                                # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import jax

from axonn_jax.runtime.memory import shard_bytes
from axonn_jax.runtime.pipeline.schedules import MessageDriven, Schedule, make_schedule
from axonn_jax.runtime.pipeline.stage_program import StageProgram
from axonn_jax.runtime.pipeline.tasks import (ForwardRun, Message, Task, TaskKind, TaskRecord,
                                              TrainingRun)  # fmt: skip
from axonn_jax.runtime.pipeline.transport import Transport

F, B, FB, W = TaskKind.FORWARD, TaskKind.BACKWARD, TaskKind.FORWARD_BACKWARD, TaskKind.WEIGHTS

#: longest idle wait of the queue: the transport returns sooner when a task ends or a message
#: arrives or is computed (this only bounds how late a timeout is noticed)
IDLE_WAIT = 0.05


@dataclasses.dataclass
class _StageState:
    program: StageProgram
    lane: _Lane
    forwards: int = 0  # forwards launched (the next forward is microbatch ``forwards``)
    backwards: int = 0
    inbound: dict = dataclasses.field(default_factory=dict)  # mb → arrays
    cotangents: dict = dataclasses.field(default_factory=dict)  # mb → arrays
    residuals: dict = dataclasses.field(default_factory=dict)  # mb → vjp
    weights: int = 0  # split schedules: W tasks launched
    deferred: dict = dataclasses.field(default_factory=dict)  # split schedules: mb → what B left for W
    expect_f: int = 0  # next microbatch whose forward message is expected
    expect_b: int = 0
    #: sums over microbatches: (parameter gradients, state updates); forward only: state updates
    totals: object = None
    peak: int = 0
    held: dict = dataclasses.field(default_factory=dict)  # (kind, mb) → bytes per device held
    peak_bytes: int = 0  # most bytes per device held at once in residuals and deferred W inputs
    posted_f: int = 0  # receives are posted for the forward messages of microbatches below this
    posted_b: int = 0


def _hold(st: _StageState, key: tuple, tree) -> None:
    """Counts ``tree`` (residuals awaiting B, or what B left for W) as held by the stage until
    :func:`_release`; updates the stage's peaks (microbatches, bytes per device)."""
    st.held[key] = shard_bytes(tree)
    st.peak = max(st.peak, len(st.residuals) + len(st.deferred))
    st.peak_bytes = max(st.peak_bytes, sum(st.held.values()))


def _release(st: _StageState, key: tuple) -> None:
    st.held.pop(key, None)


@dataclasses.dataclass(frozen=True)
class _Launched:
    task: Task  # as run (the last stage's training forward: FORWARD_BACKWARD)
    launched: float  # perf_counter() when the queue picked it (before any emulated delay)
    outputs: list  # the arrays whose readiness means the task has finished


class _Lane:
    """The launched, unfinished tasks of one mesh, in launch order, and the thread that
    waits for each to finish (a device runs its programs one after another)."""

    def __init__(self, finished: queue.Queue, wake: threading.Event):
        self.pending: deque[_Launched] = deque()
        self._todo: queue.Queue = queue.Queue()
        self._finished, self._wake = finished, wake
        self.last_end = 0.0  # when this mesh's previous task finished (perf_counter)
        self._thread = threading.Thread(target=self._watch, name="axonn-task-watcher", daemon=True)
        self._thread.start()

    def launch(self, task: _Launched) -> None:
        self.pending.append(task)
        self._todo.put(task)

    def stop(self) -> None:
        """The watcher ends once the tasks before it are done (not waited for here)."""
        self._todo.put(None)

    def join(self) -> None:
        """Wait for the watcher to end (after :meth:`stop`): no thread of this lane is left
        inside JAX, where the interpreter's exit would abort it."""
        self._thread.join()

    def _watch(self) -> None:
        while (task := self._todo.get()) is not None:
            error = None
            try:
                jax.block_until_ready(task.outputs)
            except BaseException as exc:  # surfaced on the queue's thread
                error = exc
            self._finished.put((self, time.perf_counter(), error))
            self._wake.set()


class PipelineTimeout(RuntimeError):
    """No task could run for ``timeout`` seconds: a peer stage is gone or stuck."""


class DispatchQueue:
    """Runs one step's tasks for this process's stages (:meth:`run_training`, :meth:`run_forward`).

    Args:
        programs: the :class:`StageProgram` of every stage (stage index order).
        local: the stages this process runs.
        transport: moves messages between stages.
        schedule: "message" (default), "1f1b", "gpipe", or a
            :class:`~axonn_jax.runtime.pipeline.schedules.Schedule`.
        limit: most microbatches stage 0 keeps in flight (stage ``s``:
            ``limit - s``; message schedule); default the number of stages + 1.
        timeout: seconds without any runnable or running task before
            :class:`PipelineTimeout`.
        delay: optional ``delay(stage, kind, mb) -> seconds`` (``kind`` a
            :class:`~axonn_jax.runtime.pipeline.tasks.TaskKind`) the queue is held
            before a task is launched (to emulate a slow stage in tests and
            benchmarks; it receives messages meanwhile but launches nothing, so
            it only emulates well with one stage per process).
        asynchronous: launch tasks without waiting for them (default); ``False``
            waits for each task before picking the next (the serial baseline).
        depth: most launched, unfinished tasks per mesh (asynchronous only).
    """

    def __init__(
        self,
        programs: Sequence[StageProgram],
        local: Sequence[int],
        transport: Transport,
        *,
        schedule: str | Schedule = "message",
        limit: int | None = None,
        timeout: float = 60.0,
        delay: Callable[[int, TaskKind, int], float] | None = None,
        asynchronous: bool = True,
        depth: int = 2,
    ):
        self.programs, self.local = list(programs), list(local)
        self.transport = transport
        self.num_stages = len(self.programs)
        if isinstance(schedule, str):
            placement = stage_ranks(self.programs)
            schedule = make_schedule(schedule, limit=limit, stages=self.num_stages,
                                     pipeline=len(set(placement)), placement=placement)  # fmt: skip
        self.schedule = schedule
        self.timeout, self.delay = timeout, delay
        if depth < 1:
            raise ValueError(f"depth must be >= 1 launched task per mesh, got {depth}")
        self.depth = depth if asynchronous else 1
        self.asynchronous = asynchronous
        self._no_backward = False  # set by run_forward
        #: B and W run as separate tasks (zero-bubble schedules); set by each run
        self._split = False
        self._ahead = 1  # receives posted ahead per link (set by each run)

    # --- the step -----------------------------------------------------------
    def run_training(self, params: dict[int, list], args: Callable[[int, int], list],
                     batch: Callable[[int], object], microbatches: int) -> TrainingRun:  # fmt: skip
        """Forward and backward of ``microbatches`` microbatches.

        Args:
            params: stage → its parameter leaves (``flow.params`` order).
            args: ``args(stage, mb)`` → the model arguments that stage reads.
            batch: ``batch(mb)`` → the loss's batch on the last stage.
        """
        losses, totals, trace = self._run(params, args, batch, microbatches, self.schedule, False)
        return TrainingRun(*trace, losses=losses, grads={s: t[0] for s, t in totals.items()},
                           updates={s: t[1] for s, t in totals.items()})  # fmt: skip

    def run_forward(self, params: dict[int, list], args: Callable[[int, int], list],
                    microbatches: int) -> ForwardRun:  # fmt: skip
        """Forwards only, keeping no residuals (message-driven: each stage runs whichever
        forward has arrived): the last stage's outputs per microbatch and each stage's
        state updates, summed over microbatches."""
        outputs, totals, trace = self._run(params, args, None, microbatches, MessageDriven(None), True)
        return ForwardRun(*trace, outputs=outputs, updates={s: t or [] for s, t in totals.items()})

    def _run(self, params, args, batch, microbatches: int, schedule: Schedule, forward_only: bool):
        """``(last-stage results per microbatch, {stage: totals}, (records, peak, origin, peak bytes))``."""
        last = self.num_stages - 1
        t0, origin = time.perf_counter(), time.time()
        self._no_backward = forward_only
        self._split = not forward_only and getattr(schedule, "splits_weights", False)
        schedule.start(self.local, self.num_stages, microbatches)
        bound = schedule.in_flight_bound(0)
        self._ahead = microbatches if bound is None else min(bound, microbatches)
        finished: queue.Queue = queue.Queue()
        wake = threading.Event()
        lanes: dict[tuple, _Lane] = {}
        states = {}
        for s in self.local:
            devices = _devices(self.programs[s])
            if devices not in lanes:
                lanes[devices] = _Lane(finished, wake)
                lanes[devices].last_end = t0
            states[s] = _StageState(self.programs[s], lanes[devices])
            self._expect(states[s], s, microbatches)

        def has_input(task: Task) -> bool:
            st = states[task.stage]
            return len(st.lane.pending) < self.depth and self._has_input(st, task)

        losses: dict[int, object] = {}
        records: list[TaskRecord] = []
        idle_deadline = time.perf_counter() + self.timeout
        try:
            while True:
                wake.clear()
                if self._collect(finished, records, t0):
                    idle_deadline = time.perf_counter() + self.timeout
                done = all(self._finished(st, s, microbatches) for s, st in states.items())
                busy = any(lane.pending for lane in lanes.values())
                if done and not busy:
                    break
                for s, st in states.items():
                    self._poll(st, s, microbatches)
                task = None if done else schedule.pick(states, has_input, microbatches)
                if task is None:
                    if busy:
                        idle_deadline = time.perf_counter() + self.timeout
                    elif time.perf_counter() > idle_deadline:
                        raise PipelineTimeout(self._stuck_message(states, microbatches))
                    self.transport.wait(wake, IDLE_WAIT)  # returns early on a task end or a message
                    continue
                s, mb = task.stage, task.microbatch
                st = states[s]
                launched = time.perf_counter()
                if self.delay is not None:  # an emulated slow task: counted as busy time
                    self._emulate(self.delay(s, task.kind, mb) or 0.0, states, microbatches)
                ran = task
                if forward_only:
                    outputs, result = self._forward_only(st, s, mb, params[s], args)
                    if s == last:
                        losses[mb] = result
                elif task.kind is F and s == last:
                    outputs, losses[mb] = self._forward_backward(st, s, mb, params[s], args, batch)
                    ran = Task(s, FB, mb)
                elif task.kind is W:
                    outputs = self._weights(st, mb)
                elif task.kind is F:
                    outputs = self._forward(st, s, mb, params[s], args)
                else:
                    outputs = self._backward(st, s, mb)
                st.lane.launch(_Launched(ran, launched, jax.tree.leaves(outputs)))
                schedule.ran(task)
                idle_deadline = time.perf_counter() + self.timeout
                if not self.asynchronous:  # the serial baseline: this task ends before the next
                    jax.block_until_ready(outputs)
                    while st.lane.pending:
                        self._collect(finished, records, t0, block=True)
        finally:
            for lane in lanes.values():
                lane.stop()
        for lane in lanes.values():  # only without an error: every task has finished
            lane.join()
        self.transport.close()
        totals = {s: st.totals for s, st in states.items()}
        peak = {s: st.peak for s, st in states.items()}
        peak_bytes = {s: st.peak_bytes for s, st in states.items()}
        records.sort(key=lambda r: (r.start, r.stage))
        return tuple(losses[mb] for mb in sorted(losses)), totals, (tuple(records), peak, origin, peak_bytes)

    def _emulate(self, seconds: float, states: dict, m: int) -> None:
        """Hold the queue for ``seconds`` as a device busy that long would, while receiving
        what arrives meanwhile, as a queue waiting on real device work does (a bare sleep
        would stall the MPI progress a peer's send may need)."""
        deadline = time.perf_counter() + seconds
        while (left := deadline - time.perf_counter()) > 0:
            if self.transport.polled:
                for s, st in states.items():
                    self._poll(st, s, m)
            time.sleep(min(left, 0.001 if self.transport.polled else left))  # 1 ms: cheap

    @staticmethod
    def _collect(finished: queue.Queue, records: list, t0: float, block: bool = False) -> bool:
        """Record the tasks that finished; raise the error of one that failed."""
        any_done = False
        while True:
            try:
                lane, end, error = finished.get(block=block)
            except queue.Empty:
                return any_done
            block = False
            if error is not None:
                raise error
            done = lane.pending.popleft()
            task, start = done.task, max(done.launched, lane.last_end)
            records.append(TaskRecord(task.stage, task.kind, task.microbatch, start - t0,
                                      end - t0, start - lane.last_end))  # fmt: skip
            lane.last_end = end
            any_done = True

    # --- readiness ------------------------------------------------------------
    def _expect(self, st: _StageState, s: int, m: int) -> None:
        """Post the receives of the next ``self._ahead`` forward and backward messages of
        stage ``s``: as many as a neighbour may send before this stage consumes one, so a
        sender never waits for a receive to be posted (its other messages queue behind)."""
        if s > 0:
            st.posted_f = self._post((F, s), st.posted_f, min(st.expect_f + self._ahead, m),
                                     st.program.inbound_avals, s - 1)  # fmt: skip
        if s < self.num_stages - 1 and not self._no_backward:
            st.posted_b = self._post((B, s), st.posted_b, min(st.expect_b + self._ahead, m),
                                     st.program.outbound_cotangent_avals, s + 1)  # fmt: skip

    def _post(self, link: tuple[TaskKind, int], start: int, stop: int, avals: Callable,
              source: int) -> int:  # fmt: skip
        """Posts the receives of microbatches ``start … stop - 1`` on ``link``; returns where the
        next posting starts (the message avals are computed only when there is one to post)."""
        if start >= stop:
            return start
        shapes, mesh = avals(), self.programs[source].mesh
        for mb in range(start, stop):
            self.transport.expect(Message(*link, mb), shapes, mesh)
        return stop

    def _poll(self, st: _StageState, s: int, m: int) -> None:
        if s > 0 and st.expect_f < m:
            arrays = self.transport.arrived(Message(F, s, st.expect_f))
            if arrays is not None:
                st.inbound[st.expect_f] = arrays
                st.expect_f += 1
        if s < self.num_stages - 1 and st.expect_b < m and not self._no_backward:
            arrays = self.transport.arrived(Message(B, s, st.expect_b))
            if arrays is not None:
                st.cotangents[st.expect_b] = arrays
                st.expect_b += 1
        self._expect(st, s, m)

    @staticmethod
    def _has_input(st: _StageState, task: Task) -> bool:
        """The task's input has arrived, ready to use (a forward must also be the stage's
        next microbatch; a backward's residuals are its own forward's, launched earlier)."""
        mb = task.microbatch
        if task.kind is B:
            return mb in st.residuals and _ready(st.cotangents.get(mb))
        if task.kind is W:
            return mb in st.deferred
        return mb == st.forwards and (task.stage == 0 or _ready(st.inbound.get(mb)))

    def _finished(self, st: _StageState, s: int, m: int) -> bool:
        if self._split:
            return st.weights == m
        if s == self.num_stages - 1 or self._no_backward:
            return st.forwards == m
        return st.backwards == m

    # --- the tasks (launched, not waited for) -----------------------------------
    def _forward(self, st, s, mb, params, args) -> list:
        inbound = st.inbound.pop(mb, [])
        outs, vjp = st.program.forward(params, args(s, mb), inbound)
        st.residuals[mb] = vjp
        _hold(st, ("residuals", mb), vjp)
        st.forwards += 1
        nxt = self.programs[s + 1]
        self.transport.send(Message(F, s + 1, mb), outs, nxt.inbound_shardings)
        return outs

    def _forward_only(self, st, s, mb, params, args) -> tuple[list, list | None]:
        """A forward without residuals: sends the activations on, or returns the model outputs.

        The stage's state updates (BatchNorm statistics) are summed over microbatches.
        """
        inbound = st.inbound.pop(mb, [])
        outs, updates = st.program.forward_only(params, args(s, mb), inbound)
        st.forwards += 1
        self._accumulate(st, updates)
        if s == self.num_stages - 1:
            return [outs, updates], outs
        nxt = self.programs[s + 1]
        self.transport.send(Message(F, s + 1, mb), outs, nxt.inbound_shardings)
        return [outs, updates], None

    def _forward_backward(self, st, s, mb, params, args, batch) -> tuple[list, object]:
        inbound = st.inbound.pop(mb, [])
        if self._split:  # forward, loss and B; W later
            loss, g_in, left = st.program.forward_backward_input(params, args(s, mb), inbound, batch(mb))
            st.deferred[mb] = left
            _hold(st, ("deferred", mb), left)
            sums = []
        else:
            loss, sums, g_in = st.program.forward_backward(params, args(s, mb), inbound, batch(mb))
            self._accumulate(st, sums)
        st.forwards += 1
        st.backwards += 1
        self._send_backward(s, mb, g_in)
        return [loss, sums, g_in], loss

    def _backward(self, st, s, mb) -> list:
        residuals, cotangents = st.residuals.pop(mb), st.cotangents.pop(mb)
        _release(st, ("residuals", mb))
        st.backwards += 1
        if self._split:  # B: the inbound gradients now, what W needs kept
            g_in, carried = st.program.backward_input(residuals, cotangents)
            st.deferred[mb] = st.program.weight_inputs(residuals, cotangents, carried)
            _hold(st, ("deferred", mb), st.deferred[mb])  # with B's carried values
            sums = []
        else:
            sums, g_in = st.program.backward(residuals, cotangents)
            self._accumulate(st, sums)
        self._send_backward(s, mb, g_in)
        return [sums, g_in]

    def _weights(self, st, mb) -> list:
        """W: the stage's weight gradients (and state updates) of ``mb``, from what its B left."""
        sums = st.program.backward_weights(*st.deferred.pop(mb))
        _release(st, ("deferred", mb))
        st.weights += 1
        self._accumulate(st, sums)
        return sums

    def _send_backward(self, s, mb, g_in) -> None:
        """The inbound gradients of stage ``s`` go to stage ``s - 1`` (nothing for stage 0)."""
        if s > 0:
            prev = self.programs[s - 1]
            shardings = prev.outbound_shardings
            self.transport.send(Message(B, s - 1, mb), g_in, [shardings[i] for i in prev.diff_out])

    @staticmethod
    def _accumulate(st, values) -> None:
        """Adds one microbatch's gradients and state updates (or updates alone) to the stage's sums."""
        st.totals = values if st.totals is None else _add(st.totals, values)

    def _stuck_message(self, states, m) -> str:
        parts = []
        for s, st in states.items():
            waiting = []
            if s > 0 and st.expect_f < m:
                waiting.append(f"forward message of microbatch {st.expect_f} from stage {s - 1}")
            if s < self.num_stages - 1 and st.expect_b < m:
                waiting.append(f"gradient of microbatch {st.expect_b} from stage {s + 1}")
            done = f"F {st.forwards}/{m}, B {st.backwards}/{m}" + (f", W {st.weights}/{m}" if self._split else "")
            parts.append(f"stage {s} (done {done}) waits for "
                         + (", ".join(waiting) or "nothing"))  # fmt: skip
        return (
            f"pipeline made no progress for {self.timeout:.0f} s: " + "; ".join(parts)
            + ". A peer process has probably failed (see its error above). Raise the "
            "limit with timeout=... if a single task legitimately takes longer."
        )


def stage_ranks(programs: Sequence[StageProgram]) -> tuple[int, ...]:
    """The pipeline rank of each stage, read from the meshes: ranks are numbered in the order
    their meshes first appear, so stage ``s < p`` is on rank ``s`` and the later stages follow
    the grid's placement (interleaved: ``s mod p``; V-shaped: ``2p − 1 − s``)."""
    ranks: dict[tuple, int] = {}
    return tuple(ranks.setdefault(_devices(p), len(ranks)) for p in programs)


def _devices(program: StageProgram) -> tuple[int, ...]:
    """The device ids of a stage's mesh: stages with the same ones share a pipeline rank."""
    return tuple(d.id for d in program.mesh.devices.flat)


def _ready(arrays) -> bool:
    """``arrays`` (a message) has arrived and every array in it is computed."""
    if arrays is None:
        return False
    return all(_bits(x).is_ready() for x in jax.tree.leaves(arrays))


def _bits(x: jax.Array) -> jax.Array:
    """The array holding ``x``'s data (typed PRNG keys: their raw bits)."""
    return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x


@jax.jit
def _add(a, b):
    return jax.tree.map(lambda x, y: x + y, a, b)
