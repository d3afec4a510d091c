"""Memory report: bytes per device by kind and by memory space, planned and measured.

*Planned* bytes follow from the parameter layouts and dtypes
(:func:`planned_bytes`). *Measured* bytes come from two sources:

* live arrays (:func:`array_bytes`): what each ``jax.Array`` really holds on
  one device, split by memory kind (``device`` vs ``pinned_host``);
* compiled programs (:func:`compiled_bytes`): ``Compiled.memory_analysis()``
  for arguments, outputs and temporaries. Backends that report host memory
  separately (GPU) are read directly; where host bytes are folded into the
  totals (CPU, jax 0.10), arguments and outputs are split by the compiled entry
  layout (``S(5)`` marks host memory) and temporaries count as device memory.

Example::

    report = MeasuredMemory.measure(
        params_per_device=opt_params_per_device,
        params=params, master=state.master, optimizer=state.inner,
    )
    print(report)          # bytes and bytes/parameter per kind, device vs host
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

import jax
import numpy as np

from axonn_jax.runtime.master_optimizer import MasterOptimizer

#: Memory space number that XLA layouts use for host memory (``S(5)``).
HOST_SPACE = 5


@dataclasses.dataclass(frozen=True)
class Bytes:
    """Bytes on one device, by memory space."""

    device: int = 0
    host: int = 0

    def __add__(self, other: Bytes) -> Bytes:
        return Bytes(self.device + other.device, self.host + other.host)

    @property
    def total(self) -> int:
        return self.device + self.host


# --- live arrays ----------------------------------------------------------------


def array_bytes(tree) -> Bytes:
    """Bytes that the arrays of ``tree`` hold on their most loaded device, by memory kind."""
    per_device: dict = {}
    for leaf in jax.tree.leaves(tree):
        host = getattr(leaf.sharding, "memory_kind", None) in ("pinned_host", "unpinned_host")
        for shard in leaf.addressable_shards:
            used = per_device.setdefault(shard.device, [0, 0])
            used[host] += shard.data.nbytes
    if not per_device:
        return Bytes()
    return Bytes(max(u[0] for u in per_device.values()), max(u[1] for u in per_device.values()))


def shard_bytes(tree) -> int:
    """Bytes one device holds of ``tree``'s arrays (or sharded shape structs), from each leaf's
    sharding alone: no buffer is touched, so it costs next to nothing on a hot path (the
    dispatch queue's count of held residuals). Even shardings: ``array_bytes(tree).total``."""
    return sum(math.prod(x.sharding.shard_shape(tuple(x.shape))) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(tree) if getattr(x, "sharding", None) is not None)  # fmt: skip


def local_param_count(params, shardings) -> int:
    """Number of parameter elements one device stores (its shards)."""
    return sum(
        math.prod(s.shard_shape(tuple(np.shape(p))))
        for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings))
    )


# --- compiled programs ----------------------------------------------------------


def compiled_bytes(compiled) -> dict[str, Bytes]:
    """Per-device ``arguments``, ``outputs``, ``temp`` and ``aliased`` bytes of ``compiled``."""
    stats = compiled.memory_analysis()
    reported_host = stats.host_argument_size_in_bytes + stats.host_output_size_in_bytes
    if reported_host or stats.host_temp_size_in_bytes:
        return {
            "arguments": Bytes(stats.argument_size_in_bytes, stats.host_argument_size_in_bytes),
            "outputs": Bytes(stats.output_size_in_bytes, stats.host_output_size_in_bytes),
            "temp": Bytes(stats.temp_size_in_bytes, stats.host_temp_size_in_bytes),
            "aliased": Bytes(stats.alias_size_in_bytes, stats.host_alias_size_in_bytes),
        }
    arguments, outputs = entry_layout_bytes(compiled.as_text())
    return {
        "arguments": arguments,
        "outputs": outputs,
        "temp": Bytes(stats.temp_size_in_bytes, 0),
        "aliased": Bytes(stats.alias_size_in_bytes, 0),
    }


_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]\{([^}]*)\}")
_SPACE = re.compile(r"S\((\d+)\)")


def entry_layout_bytes(hlo_text: str) -> tuple[Bytes, Bytes]:
    """Bytes of the entry computation's parameters and of its results, by memory space.

    Reads ``entry_computation_layout={(f32[2,16]{1,0:S(5)}, ...)->(...)}`` from a
    compiled module's text (``S(5)``: host memory). Tuple index tables, which
    ``memory_analysis()`` adds to the output size, are not counted.
    """
    start = hlo_text.find("entry_computation_layout={")
    if start < 0:
        raise ValueError("no entry_computation_layout in the compiled module text")
    depth, i = 0, start + len("entry_computation_layout=")
    for i in range(i, len(hlo_text)):
        depth += {"{": 1, "}": -1}.get(hlo_text[i], 0)
        if depth == 0:
            break
    layout = hlo_text[start:i]
    params, _, results = layout.partition(")->")

    def split(text: str) -> Bytes:
        total = [0, 0]
        for dtype, dims, layout in _SHAPE.findall(text):
            space = _SPACE.search(layout)
            count = math.prod(int(d) for d in dims.split(",") if d)
            total[bool(space and int(space.group(1)) == HOST_SPACE)] += count * _itemsize(dtype)
        return Bytes(*total)

    return split(params), split(results)


def _itemsize(hlo_type: str) -> int:
    bits = {"pred": 8, "bf16": 16, "f16": 16, "f32": 32, "f64": 64, "s8": 8, "u8": 8, "s16": 16,
            "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64, "c64": 64, "c128": 128}  # fmt: skip
    if hlo_type not in bits:
        raise ValueError(f"unknown HLO element type {hlo_type!r}")
    return bits[hlo_type] // 8


# --- planned --------------------------------------------------------------------


def planned_bytes(opt: MasterOptimizer, params) -> dict[str, Bytes]:
    """Bytes per device that ``opt`` plans for ``params`` (arrays or shape structs).

    Kinds: ``params`` and ``grads`` (precision dtype, on the device), ``master``
    and ``optimizer`` (where ``opt`` keeps them), ``buffers`` (the largest
    streaming bucket's masters and state, loaded on the device; with
    ``prefetch``, the largest two consecutive buckets').
    """
    shardings = opt.state_shardings(params)
    n = local_param_count(params, opt.param_shardings)
    half = n * opt.precision.param_dtype.itemsize

    def state_bytes(tree, specs) -> int:
        return sum(
            math.prod(s.shard_shape(tuple(x.shape))) * np.dtype(x.dtype).itemsize
            for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(specs))
        )

    abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(np.shape(p), opt.precision.master_dtype), params)
    inner = jax.eval_shape(opt.optimizer.init, abstract)
    master = n * opt.precision.master_dtype.itemsize if opt.keeps_master else 0
    optimizer = state_bytes(inner, shardings.inner)
    place = (lambda b: Bytes(0, b)) if opt.offload else (lambda b: Bytes(b, 0))
    buffers = 0
    if opt.offload and opt.update_on == "device":
        per_param = (master + optimizer) / max(n, 1)
        leaves, leaf_shardings = jax.tree.leaves(params), jax.tree.leaves(opt.param_shardings)
        sizes = [int(per_param * local_param_count([leaves[i] for i in b], [leaf_shardings[i] for i in b]))
                 for b in opt.buckets(params)]  # fmt: skip
        together = 2 if opt.prefetch else 1  # buckets on the device at once
        buffers = max(sum(sizes[k:k + together]) for k in range(len(sizes)))
    return {
        "params": Bytes(half, 0),
        "grads": Bytes(n * opt.precision.grad_dtype.itemsize, 0),
        "master": place(master),
        "optimizer": place(optimizer),
        "buffers": Bytes(buffers, 0),
    }


# --- the report -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MeasuredMemory:
    """Bytes per device by kind (rows) and memory space, planned and measured.

    ``measured`` rows may be missing (not measured); ``params_per_device`` turns
    bytes into bytes per parameter.
    """

    params_per_device: int
    planned: Mapping[str, Bytes]
    measured: Mapping[str, Bytes]

    @classmethod
    def measure(cls, opt: MasterOptimizer, params, state, *, extra: Mapping[str, Bytes] | None = None):
        """Planned bytes of ``opt`` next to the live bytes of ``params`` and ``state``.

        ``extra`` adds measured rows (e.g. ``grads`` or ``activations`` from
        :func:`compiled_bytes`).
        """
        measured = {
            "params": array_bytes(params),
            "master": array_bytes(state.master) if state.master is not None else Bytes(),
            "optimizer": array_bytes(state.inner),
            **dict(extra or {}),
        }
        n = local_param_count(params, opt.param_shardings)
        return cls(n, planned_bytes(opt, params), measured)

    def model_state_per_param(self, space: str = "device", which: str = "measured") -> float:
        """Bytes per parameter of params + grads + master + optimizer + buffers in ``space``."""
        rows = self.measured if which == "measured" else self.planned
        kinds = ("params", "grads", "master", "optimizer", "buffers")
        return sum(getattr(rows[k], space) for k in kinds if k in rows) / max(self.params_per_device, 1)

    def __str__(self) -> str:
        n = max(self.params_per_device, 1)
        header = ("kind", "planned device", "planned host", "measured device", "measured host", "B/param dev")
        rows = [header]
        for kind in dict.fromkeys([*self.planned, *self.measured]):
            p, m = self.planned.get(kind), self.measured.get(kind)
            cell = lambda b, s: "-" if b is None else f"{getattr(b, s):,}"  # noqa: E731
            per = m if m is not None else p
            rows.append((kind, cell(p, "device"), cell(p, "host"), cell(m, "device"), cell(m, "host"),
                         f"{per.device / n:.2f}"))  # fmt: skip
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = [f"memory per device ({self.params_per_device:,} parameters per device)"]
        for i, row in enumerate(rows):
            lines.append("  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))))
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.append(
            f"model state on the device: {self.model_state_per_param('device'):.2f} B/param measured, "
            f"{self.model_state_per_param('device', 'planned'):.2f} planned"
        )
        return "\n".join(lines)
