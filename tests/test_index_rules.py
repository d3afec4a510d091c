"""Index updates and batched lookups: scatter-add, scatter, gathers with batching dims.

Each model mixes them with Dense layers, so their operands arrive split over
the batch axes (indices, updates) and over x or y (features). Outputs and
gradients equal the plain model's, no equation falls back to replication and
no work is repeated (``pm.report().compute``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from idiom_cases import INDEX, PICK, ROWS, TOKENS, UPDATES, AddInto, PickTokens

import axonn_jax
from axonn_jax import Grid

GRIDS = ["x=2,y=2,z=2", "x=4,data=2", "z=2,data=4", "x=2,z=2,data=2", "y=2,z=2,data=2"]
CASES = {"scatter": (AddInto(), (ROWS, UPDATES, INDEX)), "batched_gather": (PickTokens(), (TOKENS, PICK))}


@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("name", list(CASES))
def test_index_ops_are_split_and_exact(name, grid, devices):
    model, args = CASES[name]
    variables = model.init(jax.random.key(0), *args)

    def loss(out):
        return jnp.mean(out**2)

    want, want_grads = jax.value_and_grad(lambda v: loss(model.apply(v, *args)))(variables)
    pm = axonn_jax.partition(model, Grid.parse(grid), *args)
    assert pm.plan.fallbacks == (), pm.plan.warnings
    report = pm.report().compute
    assert report.redundancy <= 1.05, (report.redundancy, report.repeated(3))
    got, grads = jax.jit(jax.value_and_grad(lambda p: loss(pm.apply(p, *args))))(pm.shard(variables["params"]))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    grads = pm.gather(grads)
    flat = jax.tree_util.tree_leaves_with_path(want_grads["params"])
    scale = max(float(np.max(np.abs(g))) for _, g in flat)
    for (path, g), mine in zip(flat, jax.tree.leaves(grads)):
        np.testing.assert_allclose(np.asarray(mine), np.asarray(g), rtol=0, err_msg=str(path),
                                   atol=1e-5 * float(np.max(np.abs(g))) + 1e-6 * scale)  # fmt: skip


def test_segment_sum_is_reduce_scattered_onto_its_segments():
    """The plan: updates split like the edges, the sum reduce-scattered onto the nodes."""
    from axonn_jax.partitioner import plan_model
    from axonn_jax.partitioner.flows import variable_layouts

    class Aggregate(nn.Module):
        @nn.compact
        def __call__(self, rows, updates, index):
            return nn.Dense(8)(jax.ops.segment_sum(nn.Dense(16)(updates), index, num_segments=64) + rows)

    plan, program = plan_model(Aggregate(), Grid(z=2, data=4), ROWS, UPDATES, INDEX)
    layouts = variable_layouts(program.jaxpr, plan.grid, program.param_storage, program.arg_layouts,
                               scatter_batch=program.scatter_batch)  # fmt: skip
    (eqn,) = [e for e in program.jaxpr.eqns if e.primitive.name == "scatter-add"]
    assert layouts[eqn.invars[2]][0] == ("data", "z")  # each device adds its edges' updates
    assert layouts[eqn.outvars[0]][0] == ("data", "z")  # and holds its block of the sums


def test_rows_looked_up_by_batch_split_indices_gather_the_table():
    """``nodes[senders]``: each device looks up its own edges' nodes in the gathered table,
    instead of every device looking up every edge and summing (the indices replicated)."""
    from axonn_jax.partitioner import plan_model, rules
    from axonn_jax.partitioner.flows import variable_layouts

    class Lookup(nn.Module):
        @nn.compact
        def __call__(self, rows, updates, index):
            return nn.Dense(8)(nn.Dense(16)(rows)[index] + updates)

    grid = Grid(x=2, z=2, data=2)
    plan, program = plan_model(Lookup(), grid, ROWS, UPDATES, INDEX)
    layouts = variable_layouts(program.jaxpr, grid, program.param_storage, program.arg_layouts,
                               scatter_batch=program.scatter_batch)  # fmt: skip
    (eqn,) = [e for e in program.jaxpr.eqns if e.primitive.name == "gather"]
    step = rules.rule(eqn, [layouts[v] for v in eqn.invars], rules.Context(grid))
    assert step.targets[1][0] == ("data", "z")  # the indices keep their split
    assert step.reduce == [()] and layouts[eqn.outvars[0]][0] == ("data", "z")
