"""The partitioner: Flax model → 4D layouts and pipeline stages → Plan + Program.

Pure: it needs no devices, imports nothing of :mod:`axonn_jax.runtime`, and
never mutates the user's model. :func:`plan_model` is its entry point.

Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from axonn_jax.partitioner import Grid, plan_model
    >>> plan, program = plan_model(nn.Dense(64), Grid(x=2, y=2, z=2),
    ...                            jax.ShapeDtypeStruct((8, 32), jnp.float32))
    >>> plan.param("kernel").role.value
    'normal'
"""

from axonn_jax.partitioner.grid import Grid
from axonn_jax.partitioner.plan import ParamPlan, Plan
from axonn_jax.partitioner.program import PlanOptions, Program, plan_model, program_for
from axonn_jax.partitioner.roles import ParamRole

__all__ = ["Grid", "ParamPlan", "ParamRole", "Plan", "PlanOptions", "Program", "plan_model", "program_for"]
