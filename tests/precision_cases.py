"""The fp16 loss-scaled train step shared by the in-process and ``mpiexec`` loss-scale tests."""

from __future__ import annotations

import jax
import optax

from axonn_jax.runtime.precision import all_finite, as_planned


def loss_scaled_step(pm, opt):
    """Jitted ``step(params, state, scale, tokens, weights) -> (params, state, scale, finite)``.

    Per-example loss weights let a test blow up the fp16 gradients of chosen
    shards; the finite flag is global (one jit over the sharded gradients).
    """

    @jax.jit
    def step(params, state, scale, tokens, weights):
        def loss_fn(p):
            logits = pm.apply(as_planned(p, pm.plan), tokens)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
            return scale.scale_loss((ce.mean(axis=1) * weights).mean())

        grads = jax.grad(loss_fn)(params)
        finite = all_finite(grads)
        params, state = opt.update(grads, state, params, finite=finite, grad_scale=scale.scale)
        return params, state, scale.update(finite), finite

    return step
