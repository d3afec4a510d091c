"""Performance model: communication, compute and memory of a planned model on a grid.

The one public face of the model (``axonn_jax.perf``):

* :func:`layer_volumes` — exactly eqs (1)–(5) of the SC'24 paper for one layer;
* :func:`plan_volumes` — what this framework's kernels send for a whole model
  on a grid (re-gathers, norms, non-matmul parameters, pipeline sends
  included), in elements, bytes and seconds;
* :func:`predict` — step time and memory per device; :func:`spec_from_model`
  and :func:`gpt_spec` — the model description both read.

Modules, one concept each: :mod:`~axonn_jax.perf.paper` (the paper's
equations), :mod:`~axonn_jax.perf.spec` (:class:`ModelSpec`),
:mod:`~axonn_jax.perf.traced` (:func:`spec_from_model` for any Flax model),
:mod:`~axonn_jax.perf.comm` (the collectives our kernels run in one step),
:mod:`~axonn_jax.perf.memory` (bytes per device), :mod:`~axonn_jax.perf.step`
(predicted step time), :mod:`~axonn_jax.perf.compiled` (the step time a
compiled program implies), :mod:`~axonn_jax.perf.machines` (machine profiles,
eq. 7) and :mod:`~axonn_jax.perf.microbench` (measure this machine). The grid
search is :mod:`axonn_jax.search`; the command line is ``axonn-jax plan``.

Example:
    >>> from axonn_jax import Grid
    >>> from axonn_jax.perf import gpt_spec, plan_volumes, machines
    >>> spec = gpt_spec(layers=2, hidden=64, heads=4, seq=32, batch=8, vocab=256)
    >>> v = plan_volumes(spec, Grid(x=2, z=2, data=2), machines.get("perlmutter"))
    >>> sorted(v["elements"])
    ['all-gather', 'all-reduce', 'reduce-scatter']
"""

from __future__ import annotations

from axonn_jax.partitioner.grid import Grid
from axonn_jax.perf import machines
from axonn_jax.perf.comm import CollectiveCost, collectives, elements_by
from axonn_jax.perf.machines import Machine
from axonn_jax.perf.memory import Memory, memory
from axonn_jax.perf.options import Options
from axonn_jax.perf.paper import VOLUME_KEYS, layer_volumes
from axonn_jax.perf.spec import ModelSpec, gpt_spec
from axonn_jax.perf.step import Prediction, predict
from axonn_jax.perf.traced import spec_from_model


def plan_volumes(
    spec: ModelSpec, grid: Grid, machine: Machine | None = None, options: Options = Options()
) -> dict:
    """Per-device communication of one training step, by collective kind.

    Returns ``{"elements": {kind: n}, "bytes": {kind: n}, "seconds": {kind: t}}``
    (``seconds`` only with a ``machine``). Elements are ring wire elements;
    bytes use the precision of ``options``.
    """
    cs = collectives(spec, grid, recompute=options.recompute, microbatches=options.microbatches,
                     scatter_batch=options.scatter_batch, loss_rows=options.loss_rows)
    out = {
        "elements": elements_by(cs, "kind"),
        "bytes": {k: v * options.itemsize for k, v in elements_by(cs, "kind").items()},
    }
    if machine is not None:
        seconds: dict[str, float] = {}
        for c in cs:
            t = machine.seconds(c.elements * options.itemsize, c.calls, c.inner, c.size)
            seconds[c.kind] = seconds.get(c.kind, 0.0) + t
        out["seconds"] = seconds
    return out


__all__ = [
    "VOLUME_KEYS",
    "CollectiveCost",
    "Machine",
    "Memory",
    "ModelSpec",
    "Options",
    "Prediction",
    "collectives",
    "gpt_spec",
    "layer_volumes",
    "machines",
    "memory",
    "plan_volumes",
    "predict",
    "spec_from_model",
]
