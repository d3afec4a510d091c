"""Measure the current machine: collective bandwidth and latency by group, GEMM rate, memory.

For every group shape the model can ask about — ``size`` devices nested
inside groups of product ``inner`` (x varies fastest, as in the grid's mesh)
— it times ``psum`` over the group at a few message sizes (best of
``repeats`` runs, every group of that shape at once, as in a real step) and
fits ``t = α + wire_bytes / β`` (the ring all-reduce's wire bytes,
:func:`~axonn_jax.partitioner.report.ring_wire_bytes`). A collective is
timed inside a program, as a step runs it: a program of :data:`CHAIN`
dependent ``psum`` s against one of a single ``psum``, so that launching
the program (on simulated CPU devices several times a small psum's own
cost) is not charged to every collective of a step.
Compute is a float32 GEMM, memory bandwidth a streaming ``a·s + b``, and
activation work a softmax forward and backward, each run on every device at once (simulated CPU devices share the cores, as they do in
a step). The result is a
:class:`~axonn_jax.perf.machines.Machine` whose ``gpus_per_node`` is the
device count (one node) and whose efficiency is 1 (the peak *is* the
measured GEMM rate).

Example::

    machine = measure_machine()            # every device of this process
    save(machine, "this-machine.json")     # then: axonn-jax plan --machine this-machine.json
"""

from __future__ import annotations

import datetime
import os
import time

import numpy as np

from axonn_jax.partitioner.report import ring_wire_bytes
from axonn_jax.perf.machines import Machine

#: Per-device message sizes (float32 elements) timed for each group.
MESSAGE_ELEMENTS = (2**10, 2**15, 2**18)
#: Dependent collectives in the long program of :func:`measure_collectives`.
CHAIN = 16


def _time(fn, *args, repeats: int) -> float:
    """Best of ``repeats`` runs: other processes on the machine only ever add time."""
    fn(*args).block_until_ready()  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return min(times)


def _extra_time(long, short, x, *, repeats: int, tries: int = 3) -> float:
    """How much longer ``long(x)`` runs than ``short(x)``: timed again while noise makes it ≤ 0."""
    for _ in range(tries):
        extra = _time(long, x, repeats=repeats) - _time(short, x, repeats=repeats)
        if extra > 0:
            return extra
    raise ValueError(
        f"a program of more collectives did not take longer in {tries} tries: the machine was too "
        "busy to time them. Remedy: profile again on a quiet machine, with more --repeats."
    )


def fit_latency_bandwidth(wire_bytes, seconds) -> tuple[float, float]:
    """Least-squares ``t = α + bytes/β`` in relative error; returns ``(α seconds, β GB/s)``, α ≥ 0.

    Relative: the sizes span orders of magnitude, and in absolute error the
    largest message alone would set α.

    Example:
        >>> a, b = fit_latency_bandwidth([1e3, 1e6, 1e7], [1e-5 + 1e-6, 1e-5 + 1e-3, 1e-5 + 1e-2])
        >>> round(a * 1e6, 3), round(b, 3)
        (10.0, 1.0)
    """
    x, y = np.asarray(wire_bytes, float), np.asarray(seconds, float)
    if np.any(y <= 0):
        raise ValueError(f"collective times {list(y)} s must be positive")
    slope, intercept = np.polyfit(x, y, 1, w=1.0 / y)
    if intercept < 0 or slope <= 0:  # noisy small messages: force through the origin
        intercept = 0.0
        slope = float(np.sum(x / y) / np.sum(x * x / y**2))
    if slope <= 0:
        raise ValueError(
            f"collective times {list(y)} s do not grow with the message ({list(x)} wire bytes): "
            "the machine was too busy to time them. Remedy: profile again on a quiet machine, "
            "with more --repeats."
        )
    return float(intercept), float(1.0 / slope / 1e9)


def measure_collectives(devices, *, repeats: int = 5, elements=MESSAGE_ELEMENTS, chain: int = CHAIN):
    """``{(inner, size): (α seconds, β GB/s)}`` for every group shape of ``devices``.

    One collective's time is ``(T(chain) − T(1)) / (chain − 1)``, ``T(k)`` the
    best time of a program running ``k`` dependent ``psum`` s (each followed by
    one elementwise pass that keeps the values distinct per device, as a
    step's consumer would): the program's launch and its argument transfers
    cancel out.
    """
    import jax
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    def psums(a, count):
        for _ in range(count):
            a = lax.psum(a, "group") * 0.5 + lax.axis_index("group").astype(a.dtype)
        return a

    n = len(devices)
    out = {}
    for inner in (d for d in range(1, n + 1) if n % d == 0):
        for size in (s for s in range(2, n // inner + 1) if (n // inner) % s == 0):
            outer = n // (inner * size)
            mesh = Mesh(np.asarray(devices).reshape(outer, size, inner), ("outer", "group", "inner"))
            spec = P(("outer", "group", "inner"))
            one, many = (jax.jit(jax.shard_map(lambda a, k=k: psums(a, k), mesh=mesh,
                                               in_specs=spec, out_specs=spec))
                         for k in (1, chain))  # fmt: skip
            wires, times = [], []
            for e in elements:
                x = jax.device_put(np.ones(n * e, np.float32), NamedSharding(mesh, spec))
                times.append(_extra_time(many, one, x, repeats=repeats) / (chain - 1))
                wires.append(ring_wire_bytes("all-reduce", size, e * 4))
            out[(inner, size)] = fit_latency_bandwidth(wires, times)
    return out


def measure_gemm(devices, *, size: int = 512, repeats: int = 5) -> float:
    """FLOP/s one device reaches on a float32 ``size``³ matmul while all devices run one."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(devices), ("d",))
    spec = P("d")
    fn = jax.jit(jax.shard_map(lambda a, b: jnp.matmul(a[0], b[0])[None], mesh=mesh,
                               in_specs=(spec, spec), out_specs=spec))  # fmt: skip
    shape = (len(devices), size, size)
    a = jax.device_put(np.random.default_rng(0).standard_normal(shape, np.float32),
                       NamedSharding(mesh, spec))  # fmt: skip
    seconds = _time(fn, a, a, repeats=repeats)
    return 2.0 * size**3 / seconds


def measure_stream(devices, *, elements: int = 2**20, repeats: int = 5) -> float:
    """GB/s one device streams (``a·s + b``: 12 bytes per element) while all devices run one."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(devices), ("d",))
    spec = P("d")
    fn = jax.jit(jax.shard_map(lambda a, b: a * 1.0001 + b, mesh=mesh, in_specs=(spec, spec),
                               out_specs=spec))  # fmt: skip
    a = jax.device_put(np.ones(len(devices) * elements, np.float32), NamedSharding(mesh, spec))
    return 12 * elements / _time(fn, a, a, repeats=repeats) / 1e9


def measure_elementwise(devices, *, elements: int = 2**18, repeats: int = 5) -> float:
    """GB/s-equivalent of activation work: softmax forward and backward over rows of 256.

    Counted as 16 bytes per element (written, read, gradient written and read,
    float32) — the convention of :data:`axonn_jax.perf.step.ELEMENTWISE_PASSES`.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    def body(a, b):
        return jax.grad(lambda v: jnp.sum(jax.nn.softmax(v, axis=-1) * b))(a)

    mesh = Mesh(np.asarray(devices), ("d",))
    spec = P("d")
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec))
    rows = len(devices) * elements // 256
    a = jax.device_put(np.ones((rows, 256), np.float32), NamedSharding(mesh, spec))
    return 16 * elements / _time(fn, a, a, repeats=repeats) / 1e9


def measure_host_link(device, *, repeats: int = 5) -> float:
    """GB/s of copying 64 MiB from host memory to ``device`` (best of ``repeats``)."""
    import jax

    host = np.ones(2**24, np.float32)
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        jax.device_put(host, device).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return host.nbytes / best / 1e9


def _copy_gbps() -> float:
    """Host memory bandwidth of one copy (best of 5, 64 MiB)."""
    src = np.ones(2**24, np.float32)
    dst = np.zeros_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / 1e9


def _ram_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16.0


def measure_machine(
    devices=None, *, name: str | None = None, repeats: int = 21, gemm_size: int = 512
) -> Machine:
    """Profile ``devices`` (default: all of this process) as a :class:`Machine`."""
    import jax

    devices = list(devices if devices is not None else jax.devices())
    if len(devices) < 2:
        raise ValueError(
            f"profiling needs at least 2 devices, this process sees {len(devices)}. Remedy: "
            "on CPU pass --devices 8 (sets XLA_FLAGS=--xla_force_host_platform_device_count)."
        )
    n = len(devices)
    fits = measure_collectives(devices, repeats=repeats)
    flops = measure_gemm(devices, size=gemm_size, repeats=repeats)
    stream = measure_stream(devices, repeats=repeats)
    elementwise = measure_elementwise(devices, repeats=repeats)
    intra = {key: beta for key, (_, beta) in fits.items()}
    latency = {key: alpha * 1e6 for key, (alpha, _) in fits.items()}
    platform, kind = devices[0].platform, getattr(devices[0], "device_kind", "")
    ram = _ram_gib()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    on_cpu = platform == "cpu"
    return Machine(
        name=name or f"measured-{platform}-{n}",
        gpus_per_node=n,
        inter_node_gbps=min(intra.values()),
        intra_node=intra,
        peak_tflops=flops / 1e12,
        efficiency=1.0,
        memory_gib=ram / n if on_cpu else _device_gib(devices[0], ram / n),
        host_memory_gib=ram / n,
        host_link_gbps=measure_host_link(devices[0], repeats=repeats),
        memory_gbps=stream,
        host_memory_gbps=stream if on_cpu else _copy_gbps() / n,
        latency_us=latency,
        elementwise_gbps=elementwise,
        source=(
            f"measured by `axonn-jax profile` on {n} {platform} devices ({kind}) at {stamp}: "
            f"psum over every (inner, size) group at {list(MESSAGE_ELEMENTS)} float32 elements "
            f"per device, one psum's share of a program of {CHAIN} against one of 1 (best of "
            f"{repeats} each), fit t = latency + wire bytes / bandwidth; "
            f"float32 GEMM {gemm_size}^3, a streaming a*s+b and softmax forward+backward "
            "(elementwise) on all devices at once; "
            "memory = host RAM / devices"
            + ("" if on_cpu else " where the device does not report its own")
        ),
    )


def _device_gib(device, fallback: float) -> float:
    try:
        stats = device.memory_stats() or {}
        return stats.get("bytes_limit", fallback * 2**30) / 2**30
    except Exception:  # pragma: no cover - backends without memory_stats
        return fallback
