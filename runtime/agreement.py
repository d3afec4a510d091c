"""Before a call over several processes compiles or runs anything: do they make the same call?

A pipelined call (``pm.apply`` / ``pm.forward``, a pipelined train step or
``pm.value_and_grad``) is collective: every process runs its stages and they
exchange messages, gather outputs and compile together. So is a train step on a
grid whose one mesh spans several processes (``pm.train_step``: one SPMD program,
each process keeping its part of the global batch). Ways of breaking that used
to hang a process or silently train on other data instead of failing:

* only some processes make the call (``if rank == 0: pm.apply(...)``, a common
  "generate on the main rank" habit): the caller blocked in the gather of the
  outputs, with no timeout;
* the processes pass inputs of other shapes (a per-process epoch remainder): the
  process that must compile the new shape waited for the others in a collective
  that only a compiling process makes (a pipeline), or each process trained on
  its own reading of the batch without a word (one mesh);
* a process leaves the training loop early: the others waited in the step's
  collectives until JAX's coordination service gave up minutes later.

:func:`agree_on_call` runs first in each such call: one bounded allgather
(:meth:`~axonn_jax.runtime.collectives.HostComm.allgather_within`, 1 KiB per
process) of what this process calls (kind, input shapes and dtypes, static
arguments, microbatches), its digest, when it entered and its timeout. Every
process that completes it holds the same records and so reaches the same
verdict; the ones that do not complete it within ``timeout`` raise
:class:`CallNotJoined`. It does nothing in a single process.

* records that differ: :class:`CallMismatch` (a ``ValueError``) on every process,
  naming the processes and what differs;
* a process that entered more than its timeout before another (it has given up
  and raised :class:`CallNotJoined`, so this record is the one it left behind):
  :class:`CallNotJoined` on every process that completed it, naming both times;
* ``AXONN_JAX_CHECK_BATCH=1``: the digest covers the values of the inputs too
  (a host copy and a hash of every input per call: a debugging aid), so
  processes that pass the same shapes with other values raise
  :class:`CallMismatch` instead of silently mixing one process's inputs with
  another's targets.

Example (under ``mpiexec -n 2``)::

    agree_on_call(host, "pm.apply", lambda: describe_call(args=args, kwargs=kwargs), timeout=60)
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
from collections.abc import Callable

import jax
import numpy as np

from axonn_jax.partitioner.provenance import user_frame
from axonn_jax.runtime.collectives import RECORD_BYTES, HostCollectives

#: set to 1 to compare the values of the inputs too (host copies: a debugging aid)
CHECK_VALUES_ENV = "AXONN_JAX_CHECK_BATCH"

_HEADER = struct.Struct("<ddI16s")  # entered (time.time), timeout, description length, digest

#: what the error says of each kind of call
REMEDIES = {
    "pm.apply": "pm.apply / pm.forward over several processes is collective: call it on every "
                "process, with the same inputs (e.g. generate on every process and print on "
                "process 0 only)",
    "train step": "a train step over several processes (pm.train_step, a pipelined pm.value_and_grad) "
                  "is collective: call it on every process, with the same global batch (same shapes, "
                  "dtypes and values: each process reads the whole batch and keeps its part, on a "
                  "pipeline the first stage its inputs and the last its targets; e.g. drop or pad an "
                  "epoch's remainder the same way on every process)",
    "checkpoint": "a Checkpointer and its save / restore are collective over the job's processes: create "
                  "it and call them on every process (each writes and reads its own shards; e.g. save on "
                  "every process, print on process 0 only)",
}  # fmt: skip


#: how the messages name each kind of call
NAMES = {"pm.apply": "pm.apply / pm.forward", "train step": "the train step", "checkpoint": "a Checkpointer call"}


class CallNotJoined(RuntimeError):
    """Not every process made this collective call within the timeout."""


class CallMismatch(ValueError):
    """The processes made different collective calls (kind, input shapes/dtypes, values)."""


def call_description(values: dict, **parts) -> Callable[[], list[str]]:
    """``describe`` for :func:`agree_on_call`: :func:`describe_call` of ``values`` and ``parts``,
    and with ``AXONN_JAX_CHECK_BATCH=1`` the :func:`value_digests` of ``values``."""

    def describe() -> list[str]:
        lines = describe_call(**values, **parts)
        return lines + value_digests(**values) if checking_values() else lines

    return describe


def describe_call(**parts) -> list[str]:
    """``name: dtype[shape]`` (arrays) or ``name: value`` (static leaves) for every leaf of
    every part, in order: what must be the same on every process.

    >>> describe_call(batch=(np.zeros((2, 3), np.float32),), microbatches=2)
    ['batch[0]: float32[2, 3]', 'microbatches: 2']
    """
    lines = []
    for name, part in parts.items():
        leaves, _ = jax.tree_util.tree_flatten_with_path(part)
        if not leaves:
            lines.append(f"{name}: {part!r}"[:120])
        for path, leaf in leaves:
            where = name + jax.tree_util.keystr(path)
            if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
                lines.append(f"{where}: {_dtype_name(leaf.dtype)}{list(leaf.shape)}")
            else:
                lines.append(f"{where}: {leaf!r}"[:120])
    return lines


def value_digests(**parts) -> list[str]:
    """A short hash of each array leaf's values (host copies; leaves this process cannot read
    whole are skipped): with ``AXONN_JAX_CHECK_BATCH=1``, the values processes must agree on."""
    lines = []
    for name, part in parts.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(part)[0]:
            if not hasattr(leaf, "shape") or not getattr(leaf, "is_fully_addressable", True):
                continue
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                leaf = jax.random.key_data(leaf)
            digest = hashlib.blake2b(np.ascontiguousarray(np.asarray(leaf)).tobytes(), digest_size=8).hexdigest()
            lines.append(f"{name}{jax.tree_util.keystr(path)} values: {digest}")
    return lines


def checking_values() -> bool:
    """Whether ``AXONN_JAX_CHECK_BATCH`` asks for the values of the inputs to be compared."""
    return os.environ.get(CHECK_VALUES_ENV, "") not in ("", "0")


def agree_on_call(host: HostCollectives, kind: str, describe: Callable[[], list[str]], timeout: float) -> None:
    """Return when every process entered the same ``kind`` of call with the same
    ``describe()`` within ``timeout`` s; otherwise raise on every process (see the module).
    ``kind``: a key of :data:`REMEDIES`. A collective with a bounded wait; in one process it
    returns at once (``describe`` is not called)."""
    if getattr(host, "comm", None) is None:  # one process: nothing to agree on
        return
    description = describe()
    where = _call_site()
    text = "\n".join([f"{NAMES[kind]} at {where}", *description])
    digest = hashlib.blake2b("\n".join([kind, *description]).encode(), digest_size=16).digest()
    body = text.encode()[: RECORD_BYTES - _HEADER.size]
    entered = time.time()
    record = _HEADER.pack(entered, float(timeout), len(body), digest) + body
    records = host.allgather_within(record, timeout)
    me = host.rank
    if records is None:
        raise CallNotJoined(
            f"{NAMES[kind]} at {where}: not every process entered this call within timeout={timeout:g} s "
            f"(process {me} waited since {_clock(entered)}). Remedy: {REMEDIES[kind]}. If a "
            "process is merely slower to get here (a long evaluation or save on one process "
            "only), raise timeout=...; if another process failed, see its error."
        )
    parsed = [_parse(r) for r in records]
    latest = max(p[0] for p in parsed)
    late = [r for r, p in enumerate(parsed) if latest - p[0] > 0.98 * p[1] - 0.05]
    if late:  # those processes gave up (or will, at once): nobody may go on
        r = late[0]
        last = max(range(len(parsed)), key=lambda q: parsed[q][0])
        raise CallNotJoined(
            f"the processes are out of step: process {r} entered {_first_line(parsed[r][3])} at "
            f"{_clock(parsed[r][0])}, but process {last} made its matching call, "
            f"{_first_line(parsed[last][3])}, only {latest - parsed[r][0]:.1f} s later, beyond "
            f"process {r}'s timeout={parsed[r][1]:g} s: process {r} gave up waiting (it raised that "
            f"not every process entered the call). Remedy: {REMEDIES[_kind_of(parsed[r][3], kind)]}."
        )
    groups: dict[bytes, list[int]] = {}
    for r, p in enumerate(parsed):
        groups.setdefault(p[2], []).append(r)
    if len(groups) > 1:
        raise CallMismatch(_mismatch_message(kind, parsed, list(groups.values())))


def _mismatch_message(kind: str, parsed: list, groups: list[list[int]]) -> str:
    first = groups[0]
    base = parsed[first[0]][3].split("\n")
    parts = []
    for group in groups[1:]:
        other = parsed[group[0]][3].split("\n")
        diffs = []
        if other[0].split(" at ")[0] != base[0].split(" at ")[0]:
            diffs.append(f"calls {other[0]} but {_ranks(first)} calls {base[0]}")
        else:
            named = {line.split(": ")[0]: line for line in base[1:]}
            mine = {line.split(": ")[0]: line for line in other[1:]}
            for name in [*named, *[n for n in mine if n not in named]]:
                if named.get(name) != mine.get(name):
                    diffs.append(f"has {mine.get(name, f'no {name}')} but {_ranks(first)} has "
                                 f"{named.get(name, f'no {name}')}")  # fmt: skip
            if not diffs:
                diffs.append("passes other inputs (beyond what fits in the record)")
        shown = diffs[:3] + ([f"and {len(diffs) - 3} more"] if len(diffs) > 3 else [])
        parts.append(f"{_ranks(group)} " + "; ".join(shown))
    kinds = {parsed[g[0]][3].split("\n")[0].split(" at ")[0] for g in groups}
    what = ("shapes, dtypes or static arguments" if not any(" values: " in p[3] for p in parsed)
            else "shapes, dtypes, static arguments or values")  # fmt: skip
    cause = ("the processes made different pipelined calls at the same time" if len(kinds) > 1
             else f"the processes passed inputs of other {what} to {NAMES[kind]}")  # fmt: skip
    remedy = REMEDIES[kind] if len(kinds) == 1 else " ".join(REMEDIES.values())
    return f"{cause}: " + ". ".join(parts) + f". Remedy: {remedy}."


def _parse(record: bytes) -> tuple[float, float, bytes, str]:
    entered, timeout, length, digest = _HEADER.unpack_from(record)
    text = record[_HEADER.size : _HEADER.size + length].decode(errors="replace")
    return entered, timeout, digest, text


def _kind_of(text: str, default: str) -> str:
    """The kind of call a record's text names (``default`` if none)."""
    return next((k for k, name in NAMES.items() if text.startswith(name + " at ")), default)


def _first_line(text: str) -> str:
    return text.split("\n")[0]


def _ranks(group: list[int]) -> str:
    return ("process " if len(group) == 1 else "processes ") + ", ".join(map(str, group))


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


def _dtype_name(dtype) -> str:
    """The dtype as JAX computes with it (a NumPy int64 batch is int32 without x64, as
    ``partitioner.trace.abstract`` has it: one call, not a mismatch)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):  # typed PRNG keys
        return str(dtype)
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype)).name


def _call_site() -> str:
    """``file:line`` of the first caller outside axonn_jax (for the messages only: processes may
    make the same call from other lines)."""
    frame, _ = user_frame()
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
