"""The dependency-driven dispatch queue of one process (AxoNN's message-driven pipeline).

Tasks are ``F(stage, mb)`` and ``B(stage, mb)`` for the stages this process
owns. A task is ready when its input has arrived: stage 0's forwards need
nothing (but at most ``limit`` microbatches may be in flight between its
forward and its backward), other forwards need the previous stage's
activation, backwards need the next stage's gradient; the last stage runs its
backward right after its forward (one program). The queue posts the receive
of the next message on every link before it computes, asks its
:class:`~axonn_jax.runtime.pipeline.schedules.Schedule` which ready task to
run (the message-driven schedule: whichever has its input, backward first;
``"1f1b"`` and ``"gpipe"``: a fixed order per stage, for comparison), and hands
outputs to the transport without waiting.

Every task is recorded (stage, kind, microbatch, start, end, idle time before
it) for :mod:`axonn_jax.runtime.pipeline.timeline`.

Example:
    >>> queue = DispatchQueue(programs, [0, 1], transport, schedule="message")  # doctest: +SKIP
    >>> result = queue.run(params, microbatch_args, microbatch_batches)         # doctest: +SKIP
    >>> result.losses, result.records[0]                                        # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax

from axonn_jax.runtime.pipeline.schedules import MessageDriven, Schedule, make_schedule
from axonn_jax.runtime.pipeline.stage_program import StageProgram
from axonn_jax.runtime.pipeline.transport import Transport


@dataclasses.dataclass(frozen=True)
class TaskRecord:
    """One executed task (times in seconds since the step started)."""

    stage: int
    kind: str  # "F" forward, "B" backward, "FB" the last stage's forward+loss+backward
    microbatch: int
    start: float
    end: float
    wait: float  # idle time of this stage just before the task


@dataclasses.dataclass
class StepResult:
    losses: list  # per microbatch (last stage only): loss scalars, or outputs (forward only)
    grads: dict[int, list]  # stage → summed parameter gradients (forward only: state updates)
    records: list[TaskRecord]
    peak_in_flight: dict[int, int]  # stage → most microbatches holding residuals at once
    origin: float = 0.0  # wall-clock time (time.time()) of the step's start


@dataclasses.dataclass
class _StageState:
    program: StageProgram
    forwards: int = 0
    backwards: int = 0
    inbound: dict = dataclasses.field(default_factory=dict)  # mb → arrays
    cotangents: dict = dataclasses.field(default_factory=dict)  # mb → arrays
    residuals: dict = dataclasses.field(default_factory=dict)  # mb → vjp
    expect_f: int = 0  # next microbatch whose forward message is expected
    expect_b: int = 0
    grads: list | None = None
    idle_since: float = 0.0
    peak: int = 0
    posted: set = dataclasses.field(default_factory=set)  # message keys with receives posted
    last_kind: str = ""  # kind of the last task this stage ran


class PipelineTimeout(RuntimeError):
    """No task could run for ``timeout`` seconds: a peer stage is gone or stuck."""


class DispatchQueue:
    """Runs one training step's tasks for this process's stages.

    Args:
        programs: the :class:`StageProgram` of every stage (stage index order).
        local: the stages this process runs.
        transport: moves messages between stages.
        schedule: "message" (default), "1f1b", "gpipe", or a
            :class:`~axonn_jax.runtime.pipeline.schedules.Schedule`.
        limit: most microbatches stage 0 keeps in flight (message schedule);
            default the number of stages.
        timeout: seconds without any runnable task before :class:`PipelineTimeout`.
        delay: optional ``delay(stage, kind, mb) -> seconds`` slept before a task
            (to emulate a slow stage in tests and benchmarks).
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
        delay: Callable[[int, str, int], float] | None = None,
    ):
        self.programs, self.local = list(programs), list(local)
        self.transport = transport
        self.num_stages = len(self.programs)
        if isinstance(schedule, str):
            schedule = make_schedule(schedule, limit=limit, stages=self.num_stages)
        self.schedule = schedule
        self.timeout, self.delay = timeout, delay
        self._no_backward = False  # set by run(forward_only=True)

    # --- the step -----------------------------------------------------------
    def run(self, params: dict[int, list], args: Callable[[int, int], list],
            batch: Callable[[int], object] | None, microbatches: int, *,
            forward_only: bool = False) -> StepResult:  # fmt: skip
        """Forward and backward of ``microbatches`` microbatches.

        Args:
            params: stage → its parameter leaves (``flow.params`` order).
            args: ``args(stage, mb)`` → the model arguments that stage reads.
            batch: ``batch(mb)`` → the loss's batch on the last stage.
            forward_only: run forwards only, keep no residuals, and return the
                last stage's outputs per microbatch in ``StepResult.losses`` and
                each stage's state updates, summed over microbatches, in
                ``StepResult.grads`` (message-driven: each stage runs whichever
                forward has arrived).
        """
        last = self.num_stages - 1
        t0, origin = time.perf_counter(), time.time()
        states = {}
        self._no_backward = forward_only
        schedule = MessageDriven(microbatches) if forward_only else self.schedule
        schedule.start(self.local, self.num_stages, microbatches)
        for s in self.local:
            states[s] = _StageState(self.programs[s], idle_since=t0)
            self._expect(states[s], s, microbatches)

        def has_input(s: int, kind: str, mb: int) -> bool:
            return self._has_input(states[s], s, kind, mb)

        losses: list = []
        records: list[TaskRecord] = []
        idle_deadline = time.perf_counter() + self.timeout
        while not all(self._finished(st, s, microbatches) for s, st in states.items()):
            for s, st in states.items():
                self._poll(st, s, microbatches)
            task = schedule.pick(states, has_input, microbatches)
            if task is None:
                if time.perf_counter() > idle_deadline:
                    raise PipelineTimeout(self._stuck_message(states, microbatches))
                time.sleep(0.0002)
                continue
            s, kind, mb = task
            st = states[s]
            start = time.perf_counter()
            if self.delay is not None:  # an emulated slow task: counted as busy time
                time.sleep(self.delay(s, kind, mb) or 0.0)
            if forward_only:
                outputs = self._forward_only(st, s, mb, params[s], args)
                if s == last:
                    losses.append(outputs)
            elif kind == "F" and s == last:
                losses.append(self._forward_backward(st, s, mb, params[s], args, batch))
            elif kind == "F":
                self._forward(st, s, mb, params[s], args)
            else:
                self._backward(st, s, mb)
            end = time.perf_counter()
            label = "FB" if kind == "F" and s == last and not forward_only else kind
            records.append(TaskRecord(s, label, mb, start - t0, end - t0, start - st.idle_since))
            st.idle_since = end
            st.last_kind = kind
            schedule.ran(s)
            idle_deadline = time.perf_counter() + self.timeout
        self.transport.close()
        grads = {s: st.grads for s, st in states.items()}
        peak = {s: st.peak for s, st in states.items()}
        return StepResult(losses, grads, records, peak, origin)

    # --- readiness ------------------------------------------------------------
    def _expect(self, st: _StageState, s: int, m: int) -> None:
        """Post the receives of the next forward and backward message of stage ``s``."""
        if s > 0 and st.expect_f < m:
            self._post(st, ("F", s, st.expect_f), st.program.inbound_avals(), s - 1)
        if s < self.num_stages - 1 and st.expect_b < m and not self._no_backward:
            self._post(st, ("B", s, st.expect_b), st.program.outbound_cotangent_avals(), s + 1)

    def _post(self, st, key, avals, source: int) -> None:
        if key in st.posted:
            return
        st.posted.add(key)
        self.transport.expect(key, avals, self.programs[source].mesh)

    def _poll(self, st: _StageState, s: int, m: int) -> None:
        if s > 0 and st.expect_f < m:
            arrays = self.transport.arrived(("F", s, st.expect_f))
            if arrays is not None:
                st.inbound[st.expect_f] = arrays
                st.expect_f += 1
        if s < self.num_stages - 1 and st.expect_b < m and not self._no_backward:
            arrays = self.transport.arrived(("B", s, st.expect_b))
            if arrays is not None:
                st.cotangents[st.expect_b] = arrays
                st.expect_b += 1
        self._expect(st, s, m)

    def _has_input(self, st: _StageState, s: int, kind: str, mb: int) -> bool:
        """The task's input is here (a forward must also be the stage's next microbatch)."""
        if kind == "B":
            return mb in st.cotangents and mb in st.residuals
        return mb == st.forwards and (s == 0 or mb in st.inbound)

    def _finished(self, st: _StageState, s: int, m: int) -> bool:
        if s == self.num_stages - 1 or self._no_backward:
            return st.forwards == m
        return st.backwards == m

    # --- the tasks ----------------------------------------------------------
    def _forward(self, st, s, mb, params, args) -> None:
        inbound = st.inbound.pop(mb, [])
        outs, vjp = st.program.forward(params, args(s, mb), inbound)
        jax.block_until_ready(outs)
        st.residuals[mb] = vjp
        st.peak = max(st.peak, len(st.residuals))
        st.forwards += 1
        nxt = self.programs[s + 1]
        self.transport.send(("F", s + 1, mb), outs, nxt.inbound_shardings)

    def _forward_only(self, st, s, mb, params, args) -> list | None:
        """A forward without residuals: sends the activations on, or returns the model outputs.

        The stage's state updates (BatchNorm statistics) are summed over microbatches.
        """
        inbound = st.inbound.pop(mb, [])
        outs, updates = st.program.forward_only(params, args(s, mb), inbound)
        jax.block_until_ready(outs)
        st.forwards += 1
        self._accumulate(st, updates)
        if s == self.num_stages - 1:
            return outs
        nxt = self.programs[s + 1]
        self.transport.send(("F", s + 1, mb), outs, nxt.inbound_shardings)
        return None

    def _forward_backward(self, st, s, mb, params, args, batch):
        inbound = st.inbound.pop(mb, [])
        loss, g_params, g_in = st.program.forward_backward(params, args(s, mb), inbound, batch(mb))
        jax.block_until_ready(g_in)
        st.forwards += 1
        st.backwards += 1
        self._accumulate(st, g_params)
        self._send_backward(s, mb, g_in)
        return loss

    def _backward(self, st, s, mb) -> None:
        g_params, g_in = st.program.backward(st.residuals.pop(mb), st.cotangents.pop(mb))
        jax.block_until_ready(g_in)
        st.backwards += 1
        self._accumulate(st, g_params)
        self._send_backward(s, mb, g_in)

    def _send_backward(self, s, mb, g_in) -> None:
        """The inbound gradients of stage ``s`` go to stage ``s - 1`` (nothing for stage 0)."""
        if s > 0:
            prev = self.programs[s - 1]
            shardings = prev.outbound_shardings
            self.transport.send(("B", s - 1, mb), g_in, [shardings[i] for i in prev.diff_out])

    @staticmethod
    def _accumulate(st, g_params) -> None:
        st.grads = list(g_params) if st.grads is None else _add(st.grads, list(g_params))

    def _stuck_message(self, states, m) -> str:
        parts = []
        for s, st in states.items():
            waiting = []
            if s > 0 and st.expect_f < m:
                waiting.append(f"forward message of microbatch {st.expect_f} from stage {s - 1}")
            if s < self.num_stages - 1 and st.expect_b < m:
                waiting.append(f"gradient of microbatch {st.expect_b} from stage {s + 1}")
            parts.append(f"stage {s} (done F {st.forwards}/{m}, B {st.backwards}/{m}) waits for "
                         + (", ".join(waiting) or "nothing"))  # fmt: skip
        return (
            f"pipeline made no progress for {self.timeout:.0f} s: " + "; ".join(parts)
            + ". A peer process has probably failed (see its error above). Raise the "
            "limit with timeout=... if a single task legitimately takes longer."
        )


@jax.jit
def _add(a, b):
    return jax.tree.map(lambda x, y: x + y, a, b)
