"""Read the collectives out of compiled HLO text.

Used to check that a compiled program communicates exactly what the 4D
algorithm (and the plan's communication report) says. Understands the three
replica-group syntaxes XLA prints (explicit ``{{0,1},{2,3}}``, iota
``[2,2]<=[4]`` / ``[2,2]<=[2,2]T(1,0)``, and ``mesh['a'=2,'b'=2] {'b'}`` with
optional ``device_ids=(...)``), tuple-shaped (combined) collectives, and the
asynchronous ``-start``/``-done`` pairs of GPU programs (counted once).

Example:
    >>> text = "%a = f32[8,16]{1,0} all-reduce(%p), replica_groups={{0,1},{2,3}}, to_apply=%r"
    >>> [c.kind for c in collectives(text)]
    ['all-reduce']
    >>> collectives(text)[0].wire_bytes
    512.0
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from axonn_jax.partitioner.report import KINDS, ring_wire_bytes

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip

_OP = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+"
    r"(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\((?P<rest>.*)$"
)
_ARRAY = re.compile(r"(?P<dtype>[a-z]+\d*(?:e\d+m\d+\w*)?)\[(?P<dims>[\d,]*)\]")
_IOTA = re.compile(r"\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")
_MESH = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\((?P<ids>[^)]*\)?)\))?\s*\{(?P<sel>[^}]*)\}"
)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program, as seen on every participating device."""

    name: str
    kind: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) of each result
    groups: tuple[tuple[int, ...], ...]
    op_name: str = ""

    @property
    def group_size(self) -> int:
        return len(self.groups[0]) if self.groups else 1

    @property
    def result_bytes(self) -> int:
        """Bytes of the result(s) on one device."""
        return sum(_DTYPE_BYTES[d] * math.prod(dims) for d, dims in self.shapes)

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends with ring algorithms (0 for singleton groups).

        all-gather (g-1)/g·R, reduce-scatter (g-1)·R (R = the shard), all-reduce
        2(g-1)/g·R, all-to-all (g-1)/g·R, collective-permute R.
        """
        return ring_wire_bytes(self.kind, self.group_size, self.result_bytes)

    @property
    def trivial(self) -> bool:
        """True for a collective over groups of one device (moves nothing)."""
        return self.kind != "collective-permute" and self.group_size <= 1


def collectives(hlo_text: str, *, num_devices: int | None = None) -> list[Collective]:
    """All collectives in ``hlo_text`` (``Compiled.as_text()``), in program order."""
    found = []
    for line in hlo_text.splitlines():
        match = _OP.match(line)
        if not match:
            continue
        rest = match["rest"]
        shapes = _result_shapes(match["shape"], start=bool(match["start"]), kind=match["kind"])
        if match["kind"] == "collective-permute":
            groups = _explicit_groups(_attr(rest, "source_target_pairs") or "{}")
        else:
            groups = _replica_groups(rest, num_devices)
        op_name = re.search(r'op_name="([^"]*)"', rest)
        found.append(
            Collective(
                name=match["name"],
                kind=match["kind"],
                shapes=shapes,
                groups=groups,
                op_name=op_name.group(1) if op_name else "",
            )
        )
    return found


def _result_shapes(text: str, *, start: bool, kind: str) -> tuple:
    arrays = [(m["dtype"], _dims(m["dims"])) for m in _ARRAY.finditer(text)]
    arrays = [(d, s) for d, s in arrays if d in _DTYPE_BYTES]
    if start and kind in ("all-gather", "collective-permute", "all-to-all") and len(arrays) >= 2:
        # async start ops return (operands..., results...): keep the results half.
        arrays = arrays[len(arrays) // 2 :]
    return tuple(arrays)


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def _attr(rest: str, key: str) -> str | None:
    """The raw text of ``key=...`` up to the next top-level ``, word=``."""
    start = rest.find(key + "=")
    if start < 0:
        return None
    text = rest[start + len(key) + 1 :]
    depth = 0
    for i, ch in enumerate(text):
        if ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
        elif ch == "," and depth == 0 and re.match(r",\s*[a-z_]+=", text[i:]):
            if not text[i:].lstrip(", ").startswith("device_ids="):
                return text[:i]
    return text


def _replica_groups(rest: str, num_devices: int | None) -> tuple[tuple[int, ...], ...]:
    raw = _attr(rest, "replica_groups")
    if raw is None:
        raw = "{}"
    raw = raw.strip()
    if raw.startswith("mesh["):
        return _mesh_groups(raw)
    if _IOTA.match(raw):
        return _iota_groups(_IOTA.match(raw))
    groups = _explicit_groups(raw)
    if not groups and num_devices:
        groups = (tuple(range(num_devices)),)
    return groups


def _explicit_groups(raw: str) -> tuple[tuple[int, ...], ...]:
    return tuple(
        tuple(int(v) for v in inner.split(",") if v.strip())
        for inner in re.findall(r"\{([\d,\s]*)\}", raw)
        if inner.strip()
    )


def _iota(dims: str, perm: str | None) -> np.ndarray:
    shape = _dims(dims)
    ids = np.arange(math.prod(shape)).reshape(shape)
    return ids.transpose(_dims(perm)) if perm else ids


def _iota_groups(match: re.Match) -> tuple[tuple[int, ...], ...]:
    ids = _iota(match["dims"], match["perm"]).reshape(_dims(match["shape"]))
    return tuple(tuple(int(v) for v in row) for row in ids)


def _mesh_groups(raw: str) -> tuple[tuple[int, ...], ...]:
    match = _MESH.search(raw)
    if not match:
        raise ValueError(f"unrecognised replica_groups syntax: {raw!r}")
    axes = re.findall(r"'([^']+)'\s*=\s*(\d+)", match["axes"])
    names = [name for name, _ in axes]
    shape = [int(size) for _, size in axes]
    if match["ids"]:
        iota = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", match["ids"].strip())
        if not iota:
            raise ValueError(f"unrecognised device_ids syntax: {match['ids']!r}")
        ids = _iota(iota.group(1), iota.group(2)).reshape(shape)
    else:
        ids = np.arange(math.prod(shape)).reshape(shape)
    selected = [names.index(s) for s in re.findall(r"'([^']+)'", match["sel"])]
    others = [i for i in range(len(names)) if i not in selected]
    moved = ids.transpose(others + selected)
    group_size = math.prod(shape[i] for i in selected)
    return tuple(tuple(int(v) for v in row) for row in moved.reshape(-1, group_size))


def mesh_axis_groups(device_ids: np.ndarray, axis_names, axes) -> frozenset:
    """The replica groups of a collective over ``axes`` of a mesh of ``device_ids``.

    ``device_ids`` is the mesh's array of device ids; the result is a set of
    frozensets, comparable with ``{frozenset(g) for g in Collective.groups}``.
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    selected = [list(axis_names).index(a) for a in axes]
    others = [i for i in range(device_ids.ndim) if i not in selected]
    size = math.prod(device_ids.shape[i] for i in selected)
    moved = device_ids.transpose(others + selected).reshape(-1, size)
    return frozenset(frozenset(int(v) for v in row) for row in moved)


# --- dependency structure (for checking scheduling windows) ----------------

_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.+?)\s+(?P<op>[a-z][\w\-]*)\((?P<rest>.*)$"
)


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: its opcode, result shape text and operand names."""

    name: str
    opcode: str
    shape: str
    operands: tuple[str, ...]

    @property
    def dims(self) -> tuple[int, ...] | None:
        """Dimensions of an array result (``None`` for tuples)."""
        match = _ARRAY.fullmatch(self.shape.split("{")[0])
        return _dims(match["dims"]) if match else None


def computations(hlo_text: str) -> dict[str, list[Instruction]]:
    """Instructions of every computation in ``hlo_text``, in printed order.

    Example:
        >>> text = "ENTRY e {\\n  a = f32[2]{0} parameter(0)\\n  b = f32[2]{0} negate(a)\\n}"
        >>> [(i.name, i.operands) for i in computations(text)["e"]]
        [('a', ()), ('b', ('a',))]
    """
    found: dict[str, list[Instruction]] = {}
    current = None
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if header and not line.startswith(" "):
            current = found.setdefault(header.group(1), [])
            continue
        match = _INSTR.match(line)
        if current is None or not match:
            continue
        rest = match["rest"]
        depth, end = 1, len(rest)
        for i, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                end = i
                break
        operands = tuple(re.findall(r"%?([A-Za-z_][\w.\-]*)(?=\s*(?:,|$))", rest[:end]))
        current.append(Instruction(match["name"], match["op"], match["shape"], operands))
    return found


def ancestors(instructions: list[Instruction]) -> dict[str, frozenset[str]]:
    """Every instruction's transitive operands within one computation."""
    by_name = {i.name: i for i in instructions}
    memo: dict[str, frozenset[str]] = {}
    for inst in instructions:  # printed order is a topological order
        direct = [o for o in inst.operands if o in by_name]
        memo[inst.name] = frozenset(direct).union(*(memo.get(o, frozenset()) for o in direct))
    return memo


@dataclasses.dataclass(frozen=True)
class AsyncWindow:
    """An asynchronous collective of a scheduled program and what runs while it is in flight."""

    kind: str
    start: str
    done: str
    matmuls_inside: tuple[str, ...]  # matmuls scheduled between start and done


def _is_matmul_line(line: str, opcode: str) -> bool:
    return opcode in ("dot", "convolution") or "gemm" in line or (
        opcode == "fusion" and re.search(r'op_name="[^"]*(dot_general|conv_general)', line) is not None
    )


def async_windows(hlo_text: str) -> list[AsyncWindow]:
    """``-start``/``-done`` pairs of collectives, in schedule order, with the matmuls between.

    Reads the entry computation of a *compiled* (scheduled) module, e.g. GPU
    ``Compiled.as_text()``; synchronous backends (CPU) have no pairs.

    Example:
        >>> text = '''ENTRY e {
        ...   s = (f32[4]{0}, f32[8]{0}) all-gather-start(p), dimensions={0}
        ...   d = f32[8,8]{1,0} dot(a, b)
        ...   g = f32[8]{0} all-gather-done(s)
        ... }'''
        >>> [(w.kind, w.matmuls_inside) for w in async_windows(text)]
        [('all-gather', ('d',))]
    """
    lines = hlo_text[hlo_text.find("ENTRY"):].splitlines()[1:]
    open_: dict[str, tuple[str, list]] = {}
    windows = []
    for line in lines:
        match = _INSTR.match(line)
        if not match:
            continue
        name, opcode = match["name"], match["op"]
        if opcode.endswith("-start") and opcode[: -len("-start")] in KINDS:
            open_[name] = (opcode[: -len("-start")], [])
        elif opcode.endswith("-done") and opcode[: -len("-done")] in KINDS:
            start = re.findall(r"%?([A-Za-z_][\w.\-]*)", match["rest"])[0]
            if start in open_:
                kind, inside = open_.pop(start)
                windows.append(AsyncWindow(kind, start, name, tuple(inside)))
        elif _is_matmul_line(line, opcode):
            for _, inside in open_.values():
                inside.append(name)
    return windows
