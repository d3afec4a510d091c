"""Keeps JAX's persistent compilation cache from reloading XLA:CPU programs whose collectives
would lose their order.

XLA:CPU runs a program's operations as a graph of thunks; one shared *communicator*
resource orders all of its collectives, including those inside a loop body, a conditional
branch or a call (nested thunk sequences). An executable loaded from its serialized form
(what JAX's persistent cache stores) gets a fresh resource per nested sequence
(``ThunkSequenceSerDesProtobuf::FromProto``, jaxlib 0.10), so a loop whose body
communicates is no longer ordered against the collectives outside it: two devices of one
program may enter different collectives first and wait for each other until XLA's
stuck-rendezvous check aborts the process. A compiled executable, or one whose collectives
all sit in one computation, is not affected.

:func:`install` (called on ``import axonn_jax``) makes JAX neither store nor load a CPU
executable whose collectives sit in more than one computation; it compiles those anew.
"""

from __future__ import annotations

import inspect
import re

#: HLO opcodes of the collectives XLA:CPU runs as collective thunks (``-start`` forms included)
COLLECTIVES = frozenset({"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                         "collective-broadcast", "ragged-all-to-all"})  # fmt: skip
_OPCODE = re.compile(r"(?:^|\s)([a-z][a-z0-9-]*)\(")


def collective_computations(hlo_text: str) -> set[str]:
    """The names of the computations in an HLO module's text that hold a collective.

    >>> collective_computations('''HloModule m
    ... body {
    ...   p = f32[4]{0} parameter(0)
    ...   ROOT s = f32[4]{0} all-reduce(p), replica_groups={{0,1}}, to_apply=add
    ... }
    ... ENTRY main {
    ...   x = f32[4]{0} parameter(0)
    ...   ROOT w = f32[4]{0} while(x), condition=cond, body=body
    ... }''')
    {'body'}
    """
    found: set[str] = set()
    name = None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace():  # a computation's header, or the module's, or "}"
            words = line.removeprefix("ENTRY ").split()
            name = words[0].lstrip("%") if line.rstrip().endswith("{") and words else None
            continue
        _, eq, rest = line.partition("=")
        opcode = _OPCODE.search(rest) if eq and name else None
        if opcode and opcode.group(1).removesuffix("-start") in COLLECTIVES:
            found.add(name)
    return found


def reloads_in_order(executable) -> bool:
    """Whether XLA:CPU keeps the order of ``executable``'s collectives when it is reloaded:
    they all sit in one computation (or there are none)."""
    return all(len(collective_computations(m.to_string())) <= 1 for m in executable.hlo_modules())


def install() -> None:
    """Make JAX's persistent cache skip CPU executables that :func:`reloads_in_order` rejects
    (neither written nor, when an older run wrote one, loaded). Idempotent."""
    from jax._src import compiler

    if not (hasattr(compiler, "_cache_write") and hasattr(compiler, "_cache_read")):
        return  # another JAX without these cache functions: nothing to guard
    if getattr(compiler._cache_write, "_axonn_guard", False):
        return
    write, read = compiler._cache_write, compiler._cache_read
    write_params, read_params = inspect.signature(write), inspect.signature(read)
    if not ({"backend", "executable"} <= set(write_params.parameters) and "backend" in read_params.parameters):
        return  # cache functions whose arguments the guard cannot name: leave them alone

    def guarded_write(*args, **kwargs):
        given = write_params.bind(*args, **kwargs).arguments
        if given["backend"].platform == "cpu" and not reloads_in_order(given["executable"]):
            return None
        return write(*args, **kwargs)

    def guarded_read(*args, **kwargs):
        found = read(*args, **kwargs)
        executable = found[0] if isinstance(found, tuple) else None
        if (executable is not None and read_params.bind(*args, **kwargs).arguments["backend"].platform == "cpu"
                and not reloads_in_order(executable)):
            return (None,) * len(found)
        return found

    guarded_write._axonn_guard = True
    compiler._cache_write, compiler._cache_read = guarded_write, guarded_read
