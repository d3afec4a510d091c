"""A loop's weight gradients as one matmul after it (runtime/loop_weight_grads.py).

Against ``lax.scan`` differentiated by JAX: the same loss and gradients, and
in the backward no weight-shaped value carried through the loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import subjaxprs
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from axonn_jax.runtime import loop_weight_grads as L
from axonn_jax.runtime.overlap import contraction

T, B, H = 5, 3, 4


def _values(seed: int = 0):
    rng = np.random.default_rng(seed)
    w, u = (jnp.asarray(rng.standard_normal((H, H)) / 2, jnp.float32) for _ in range(2))
    bias = jnp.asarray(rng.standard_normal(H), jnp.float32)
    h0 = jnp.asarray(rng.standard_normal((B, H)), jnp.float32)
    xs = jnp.asarray(rng.standard_normal((T, B, H)), jnp.float32)
    return [w, u, bias], h0, xs


def _cell(consts, carry, x):
    """An RNN step reading w twice (on both sides of a matmul) and u once; the bias is added."""
    w, u, bias = consts
    (h,) = carry
    (x_t,) = x
    h = jnp.tanh(x_t @ w + h @ u + (w @ h.T).T + bias)
    return [h], [h * 2]


def _chained_cell(consts, carry, x):
    """w reaches its matmuls through a transpose and a reshape (as a cast would)."""
    w, u, bias = consts
    (h,) = carry
    return [jnp.tanh(h @ w.T.reshape(H, H) + x[0] @ u + bias)], [h]


def _no_xs_cell(consts, carry, x):
    """A fori-style body (no xs): a weight-tied refinement."""
    w, _, bias = consts
    (h,) = carry
    return [h + jnp.tanh(h @ w + bias)], []


def _loss(scan, body, consts, h0, xs, **options):
    xs_list = [] if body is _no_xs_cell else [xs]
    carry, ys = scan(body, consts, [h0], xs_list, length=T, **options)
    return jnp.sum(carry[0] ** 2) + sum(jnp.sum(jnp.sin(y)) for y in ys)


def _plain(body, consts, init, xs, **options):
    carry, ys = lax.scan(lambda c, x: body(consts, list(c), list(x)), init, xs, **options)
    return list(carry), list(ys)


def _weight_carries(jaxpr, shape) -> int:
    """How many values of ``shape`` the scans of ``jaxpr`` (nested ones too) carry."""
    found = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
            found += sum(v.aval.shape == shape for v in eqn.invars[nc : nc + nk])
    return found + sum(_weight_carries(sub, shape) for sub in subjaxprs(jaxpr))


def test_taps_are_the_matmuls_that_read_only_a_constant():
    """w is read by matmuls on both sides, u by one; the bias by an add: not a tap.
    A constant read by a matmul and by anything else, or against another constant, is no tap."""
    consts, h0, xs = _values()
    closed = jax.make_jaxpr(_cell)(consts, [h0], [xs[0]])
    taps = L.find_taps(closed.jaxpr, 3)
    assert sorted((t.const, t.side) for t in taps) == [(0, 0), (0, 1), (1, 1)]

    def mixed(consts, carry, x):
        w, u, bias = consts
        return [jnp.tanh(carry[0] @ w + jnp.sum(w) + carry[0] @ (u @ u) + bias)], []

    closed = jax.make_jaxpr(mixed)(consts, [h0], [])
    assert L.find_taps(closed.jaxpr, 3) == []

    def chained(consts, carry, x):  # w's cast is also read by a sum: no tap for w
        w16 = consts[0].astype(jnp.bfloat16)
        return [jnp.tanh(carry[0].astype(jnp.bfloat16) @ w16 + jnp.sum(w16) + carry[0] @ consts[1])], []

    closed = jax.make_jaxpr(chained)(consts, [h0], [])
    assert [(t.const, len(t.chain)) for t in L.find_taps(closed.jaxpr, 3)] == [(1, 0)]

    def returned(consts, carry, x):  # w also leaves the body (through a transpose): no tap
        return [jnp.tanh(carry[0] @ consts[0])], [consts[0].T]

    closed = jax.make_jaxpr(returned)(consts, [h0], [])
    assert L.find_taps(closed.jaxpr, 3) == []

    def cast(consts, carry, x):  # the compute-dtype cast of a mixed-precision cell
        return [jnp.tanh(carry[0].astype(jnp.bfloat16) @ consts[0].astype(jnp.bfloat16))], []

    closed = jax.make_jaxpr(cast)(consts, [h0], [])
    assert [(t.const, t.side, len(t.chain)) for t in L.find_taps(closed.jaxpr, 3)] == [(0, 1, 1)]


@pytest.mark.parametrize("options", [dict(), dict(reverse=True), dict(unroll=2)], ids=str)
@pytest.mark.parametrize("body", [_cell, _chained_cell, _no_xs_cell], ids=lambda b: b.__name__)
def test_gradients_equal_jax_scan_and_no_weight_is_carried(body, options):
    consts, h0, xs = _values()
    want, want_grads = jax.value_and_grad(lambda c, h, x: _loss(_plain, body, c, h, x, **options),
                                          argnums=(0, 1, 2))(consts, h0, xs)  # fmt: skip
    fn = jax.value_and_grad(lambda c, h, x: _loss(L.scan, body, c, h, x, **options), argnums=(0, 1, 2))
    got, got_grads = jax.jit(fn)(consts, h0, xs)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)
    plain_jaxpr = jax.make_jaxpr(jax.grad(lambda c: _loss(_plain, body, c, h0, xs, **options)))(consts)
    jaxpr = jax.make_jaxpr(jax.grad(lambda c: _loss(L.scan, body, c, h0, xs, **options)))(consts)
    assert _weight_carries(plain_jaxpr.jaxpr, (H, H)) >= 1  # JAX's own rule carries them
    assert _weight_carries(jaxpr.jaxpr, (H, H)) == 0


def test_forward_and_remat_unchanged():
    consts, h0, xs = _values(1)
    want = _plain(_cell, consts, [h0], [xs], length=T)
    got = jax.jit(lambda c: L.scan(_cell, c, [h0], [xs], length=T))(consts)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-6)
    remat = jax.grad(jax.checkpoint(lambda c: _loss(L.scan, _cell, c, h0, xs)))(consts)
    plain = jax.grad(lambda c: _loss(_plain, _cell, c, h0, xs))(consts)
    for g, w in zip(remat, plain):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)


def _rnn_cell(consts, carry, x, matmul=jnp.matmul):
    w, u, bias = consts
    (h,) = carry
    return [jnp.tanh(x[0] @ w + matmul(h, u) + bias)], [h]


def _contracted_cell(consts, carry, x):
    """``_rnn_cell`` with ``h @ u`` as the executor binds it inside ``shard_map``: a
    ``custom_vjp`` (overlap.contraction) marking the replicated weight varying over "d"."""
    return _rnn_cell(consts, carry, x, lambda h, u: contraction(
        jnp.matmul, h, u, lhs_missing=frozenset(), rhs_missing=frozenset({"d"}), overlap_all_reduce=True))


@pytest.mark.parametrize("mode", ["marked-before", "marked-in-the-body", "contraction"])
def test_inside_shard_map_typed_like_the_batch(mode, devices):
    """Rows split over a mesh axis, the weights replicated, marked varying before the loop, (by
    jnp) inside it, or inside the executor's matmul: the weight gradient is reduced over the axis
    once, after the loop, and equals the single-device gradient."""
    consts, h0, xs = _values(2)
    h0, xs = jnp.tile(h0, (2, 1)), jnp.tile(xs, (1, 2, 1))
    mesh = jax.make_mesh((2,), ("d",), devices=devices[:2])
    body, reference = (_contracted_cell, _rnn_cell) if mode == "contraction" else (_cell, _cell)

    def local(c, h, x):
        if mode == "marked-before":
            c = [lax.pcast(v, ("d",), to="varying") for v in c]
        return lax.psum(_loss(L.scan, body, c, h, x), "d")

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d"), P(None, "d")), out_specs=P())
    h_s = jax.device_put(h0, NamedSharding(mesh, P("d")))
    x_s = jax.device_put(xs, NamedSharding(mesh, P(None, "d")))
    grad = jax.grad(sharded)
    got = jax.jit(grad)(consts, h_s, x_s)
    want = jax.grad(lambda c: _loss(_plain, reference, c, h0, xs))(consts)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)
    assert _weight_carries(jax.make_jaxpr(grad)(consts, h_s, x_s).jaxpr, (H, H)) == 0
