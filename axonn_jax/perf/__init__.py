"""Performance model: communication, compute and memory of a planned model on a grid.

Modules, one concept each:

* :mod:`~axonn_jax.perf.paper` — eqs (1)–(5) of the SC'24 paper for one layer;
* :mod:`~axonn_jax.perf.spec` — :class:`ModelSpec`, what the model reads about
  a model, and :func:`gpt_spec`; :mod:`~axonn_jax.perf.traced` —
  :func:`spec_from_model` for any Flax model;
* :mod:`~axonn_jax.perf.comm` — the collectives our kernels run in one step;
* :mod:`~axonn_jax.perf.memory` — bytes per device;
* :mod:`~axonn_jax.perf.step` — predicted step time;
* :mod:`~axonn_jax.perf.machines` — machine profiles (eq. 7);
  :mod:`~axonn_jax.perf.microbench` — measure this machine.

The grid search is :mod:`axonn_jax.search`; the command line is
``axonn-jax plan`` (:mod:`axonn_jax.cli`).
"""

from axonn_jax.perf.comm import Collective, collectives
from axonn_jax.perf.machines import Machine
from axonn_jax.perf.memory import Memory, memory
from axonn_jax.perf.options import Options
from axonn_jax.perf.paper import layer_volumes
from axonn_jax.perf.spec import ModelSpec, gpt_spec
from axonn_jax.perf.step import Prediction, predict

__all__ = [
    "Collective",
    "Machine",
    "Memory",
    "ModelSpec",
    "Options",
    "Prediction",
    "collectives",
    "gpt_spec",
    "layer_volumes",
    "memory",
    "predict",
]
