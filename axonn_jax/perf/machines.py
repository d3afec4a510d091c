"""Machine profiles: bandwidth by group nesting and size (SC'24 eq. 7), compute, memory. Pure.

A collective over a group of ``size`` devices whose inner groups (the axes
nested inside it: x for y, x·y for z, x·y·z for data) have product ``inner``
runs inside a node when ``inner · size <= gpus_per_node``; its bandwidth then
comes from a measured table keyed by ``(inner, size)``. Otherwise it crosses
nodes, and ``inner`` groups share a node's links (eq. 7)::

    β = β_inter / min(gpus_per_node, inner)

Built-in profiles: ``perlmutter`` (A100, 4 per node), ``frontier`` (MI250X
GCDs, 8 per node), ``h100-node`` (8×H100 with NVLink); sources in each
profile's ``source``. ``axonn-jax profile`` measures the current machine and
writes a JSON profile (:func:`save`, :func:`load`).

Example:
    >>> m = get("perlmutter")
    >>> m.bandwidth(1, 4), m.bandwidth(2, 4), m.bandwidth(4, 2)   # GB/s
    (225.0, 40.0, 20.0)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping

from axonn_jax.partitioner.balance import StageCosts


@dataclasses.dataclass(frozen=True)
class Machine:
    """One kind of machine, as the performance model sees it.

    Bandwidths in GB/s (10⁹ B/s) per device as the model uses them (1/β
    multiplies the ring elements × itemsize), latency in µs per collective,
    peak in TFLOP/s per device, memory in GiB per device. ``memory_gbps`` is
    what streaming kernels (the optimizer update) reach on the device,
    ``elementwise_gbps`` the same for activation work (normalisations,
    softmax, their gradients; default: ``memory_gbps``), ``host_memory_gbps``
    what an optimizer update offloaded to the host reaches there for one device
    (at most its share of the host's memory bandwidth).
    """

    name: str
    gpus_per_node: int
    inter_node_gbps: float
    intra_node: Mapping[tuple[int, int], float]
    peak_tflops: float
    efficiency: float
    memory_gib: float
    host_memory_gib: float
    host_link_gbps: float
    memory_gbps: float
    host_memory_gbps: float
    latency_us: Mapping[tuple[int, int], float] = dataclasses.field(default_factory=dict)
    elementwise_gbps: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        positive = dict(gpus_per_node=self.gpus_per_node, inter_node_gbps=self.inter_node_gbps,
                        peak_tflops=self.peak_tflops, efficiency=self.efficiency,
                        memory_gib=self.memory_gib, host_link_gbps=self.host_link_gbps,
                        memory_gbps=self.memory_gbps,
                        host_memory_gbps=self.host_memory_gbps)  # fmt: skip
        for key, value in positive.items():
            if not value > 0:
                raise ValueError(f"machine {self.name!r}: {key} must be > 0, got {value!r}")
        for (inner, size), gbps in self.intra_node.items():
            if inner < 1 or size < 2 or not gbps > 0:
                raise ValueError(
                    f"machine {self.name!r}: bad intra-node entry (inner={inner}, size={size}) "
                    f"-> {gbps} GB/s; inner >= 1, size >= 2, bandwidth > 0"
                )

    # --- eq. 7 -------------------------------------------------------------
    def inside_node(self, inner: int, size: int) -> bool:
        return inner * size <= self.gpus_per_node

    def bandwidth(self, inner: int, size: int) -> float:
        """GB/s of a group of ``size`` devices nested inside groups of product ``inner``."""
        if size <= 1:
            return math.inf
        if not self.inside_node(inner, size) or not self.intra_node:
            return self.inter_node_gbps / min(self.gpus_per_node, inner)
        return _nearest(self.intra_node, inner, size)

    def latency(self, inner: int, size: int) -> float:
        """Seconds of fixed cost per collective call (0 where the profile has none)."""
        if size <= 1 or not self.latency_us:
            return 0.0
        return _nearest(self.latency_us, inner, size) * 1e-6

    def seconds(self, nbytes: float, calls: float, inner: int, size: int) -> float:
        """Time of ``calls`` collectives moving ``nbytes`` (ring wire bytes) in all."""
        if size <= 1:
            return 0.0
        return calls * self.latency(inner, size) + nbytes / (self.bandwidth(inner, size) * 1e9)

    @property
    def activation_gbps(self) -> float:
        """Bandwidth of elementwise activation work (``elementwise_gbps`` or ``memory_gbps``)."""
        return self.elementwise_gbps or self.memory_gbps

    @property
    def flops_per_second(self) -> float:
        """What the model assumes compute reaches: peak × efficiency."""
        return self.peak_tflops * 1e12 * self.efficiency

    def stage_costs(self, stage_size: int = 1) -> StageCosts:
        """The rates pipeline stages of ``stage_size`` devices are cut with (the planner's terms).

        The link between two stages is the pipeline group of the performance
        model (:func:`~axonn_jax.perf.comm.group_of`): ``bandwidth(stage_size, 2)``.

        >>> get("perlmutter").stage_costs(4).link_gbps   # a stage fills a node: eq. 7
        20.0
        """
        return StageCosts(name=self.name, tflops=self.flops_per_second / 1e12,
                          link_gbps=self.bandwidth(stage_size, 2),
                          latency_us=self.latency(stage_size, 2) * 1e6)  # fmt: skip

    def with_efficiency(self, efficiency: float) -> Machine:
        return dataclasses.replace(self, efficiency=efficiency)

    # --- files -------------------------------------------------------------
    def to_json(self) -> dict:
        def table(t):
            return [{"inner": i, "size": s, "value": v} for (i, s), v in sorted(t.items())]

        out = dataclasses.asdict(self)
        out["intra_node"] = table(self.intra_node)
        out["latency_us"] = table(self.latency_us)
        return out

    @classmethod
    def from_json(cls, data: Mapping) -> Machine:
        """The profile ``to_json`` wrote; missing or unknown keys are named.

        >>> Machine.from_json({"name": "m"})
        Traceback (most recent call last):
        ValueError: machine profile misses the keys ['efficiency', ...]; ...
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"a machine profile is a JSON object, got {type(data).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}  # fmt: skip
        unknown, missing = set(data) - fields, required - set(data)
        if missing:
            raise ValueError(f"machine profile misses the keys {sorted(missing)}; "
                             f"every profile has {sorted(required)}")  # fmt: skip
        if unknown:
            raise ValueError(f"machine profile has unknown keys {sorted(unknown)}; known: {sorted(fields)}")
        data = dict(data)
        for key in ("intra_node", "latency_us"):
            entries = data.get(key, [])
            bad = [e for e in entries if not (isinstance(e, Mapping) and {"inner", "size", "value"} <= set(e))]
            if not isinstance(entries, list) or bad:
                raise ValueError(f"machine profile {key!r} must be a list of {{'inner', 'size', 'value'}} "
                                 f"entries, got {bad[0] if bad else entries!r}")  # fmt: skip
            data[key] = {(int(e["inner"]), int(e["size"])): float(e["value"]) for e in entries}
        return cls(**data)


def _nearest(table: Mapping[tuple[int, int], float], inner: int, size: int) -> float:
    """Exact entry, else the closest one (largest keys not above, else the smallest)."""
    if (inner, size) in table:
        return table[(inner, size)]
    below = [k for k in table if k[0] <= inner and k[1] <= size]
    key = max(below) if below else min(table, key=lambda k: (abs(k[0] - inner), abs(k[1] - size)))
    return table[key]


PERLMUTTER = Machine(
    name="perlmutter",
    gpus_per_node=4,
    inter_node_gbps=80.0,
    intra_node={(1, 2): 76.0, (1, 4): 225.0, (2, 2): 76.0},
    peak_tflops=312.0,
    efficiency=0.5,
    memory_gib=40.0,
    host_memory_gib=64.0,
    host_link_gbps=25.0,
    memory_gbps=1244.0,
    host_memory_gbps=51.2,
    source=(
        "bandwidths: the SC'24 AxoNN paper's measured Perlmutter table (GB/s by inner product "
        "and group size; beta_inter = 80, 4 GPUs per node); A100-SXM4-40GB: 312 TFLOP/s bf16 "
        "dense, 40 GB HBM2 at 1555 GB/s (80% for streaming kernels); 256 GB DDR4 per node "
        "(204.8 GB/s, a quarter per GPU); PCIe 4.0 x16 host link"
    ),
)

FRONTIER = Machine(
    name="frontier",
    gpus_per_node=8,
    inter_node_gbps=40.0,
    intra_node={(1, 2): 129.0, (1, 4): 52.0, (1, 8): 135.0, (2, 2): 50.0, (2, 4): 72.0,
                (4, 2): 36.0},  # fmt: skip
    peak_tflops=191.5,
    efficiency=0.5,
    memory_gib=64.0,
    host_memory_gib=64.0,
    host_link_gbps=36.0,
    memory_gbps=1310.0,
    host_memory_gbps=25.6,
    source=(
        "bandwidths: the Frontier table of the public AxoNN performance model (GB/s by inner "
        "product and group size, beta_inter = 40, 8 GCDs per node); MI250X: 383 TFLOP/s bf16 "
        "dense per GPU = 191.5 per GCD, 64 GB HBM2e at 1638 GB/s per GCD (80% for streaming "
        "kernels); 512 GB DDR4 per node (204.8 GB/s, an eighth per GCD); Infinity Fabric "
        "CPU-GPU link"
    ),
)

H100_NODE = Machine(
    name="h100-node",
    gpus_per_node=8,
    inter_node_gbps=320.0,
    intra_node={(i, s): 360.0 for i in (1, 2, 4) for s in (2, 4, 8) if i * s <= 8},
    peak_tflops=989.0,
    efficiency=0.5,
    memory_gib=80.0,
    host_memory_gib=256.0,
    host_link_gbps=50.0,
    memory_gbps=2680.0,
    host_memory_gbps=12.8,
    source=(
        "vendor figures, not measured: H100-SXM5 989 TFLOP/s bf16 dense, 80 GB HBM3 at "
        "3350 GB/s (80% for streaming kernels); NVLink 4 through NVSwitch 450 GB/s per "
        "direction per GPU, taken at 80% (360 GB/s) for every group inside the node; "
        "8 x 400 Gb/s NDR per node at 80% (320 GB/s) as beta_inter; PCIe 5.0 x16 host link; "
        "2 TB DDR5 per node. Measured: the host update, AdamW under jax 0.11.2's "
        "compute_on('device_host') on a lent H100 machine (2026-11-27), 204 M parameters x "
        "28 B in 0.447 s = 12.8 GB/s, far below the DDR5 share (76.8 GB/s)"
    ),
)

BUILTIN: dict[str, Machine] = {m.name: m for m in (PERLMUTTER, FRONTIER, H100_NODE)}


def get(name_or_path: str) -> Machine:
    """A built-in profile by name, or a profile JSON file written by ``axonn-jax profile``."""
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]
    if name_or_path.endswith(".json") or os.path.exists(name_or_path):
        return load(name_or_path)
    raise ValueError(
        f"unknown machine {name_or_path!r}: built-in profiles are {', '.join(sorted(BUILTIN))}; "
        "or pass the path of a profile JSON written by `axonn-jax profile --out FILE.json`"
    )


def load(path: str) -> Machine:
    """A profile JSON written by ``axonn-jax profile``; a bad file raises ``ValueError`` naming it.

    >>> load("this-machine.json").name  # doctest: +SKIP
    'measured-cpu-8'
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(
            f"machine profile {path!r} does not exist. Remedy: write one with "
            f"`axonn-jax profile --out {path}`, or use one of {', '.join(sorted(BUILTIN))}"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"machine profile {path!r} is not valid JSON: {e}") from None
    try:
        return Machine.from_json(data)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"machine profile {path!r}: {e}. Remedy: write it again with "
            f"`axonn-jax profile --out {path}`, or start from `axonn-jax machines` / a built-in "
            f"profile ({', '.join(sorted(BUILTIN))})"
        ) from None


def save(machine: Machine, path: str) -> None:
    with open(path, "w") as f:
        json.dump(machine.to_json(), f, indent=2)
        f.write("\n")
