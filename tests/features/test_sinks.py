"""Attention sinks beyond the shared suite (tests/contract/test_attention.py::test_sinks): numerical
gradients, the argument's validation, non-finite sinks, S = 0, vmap and explain."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_flash
from jax_flash.reference import attention_reference

from cases import Shape, make_qkv, make_sinks

# H = 32: a head dim every implementation serves (cuda: 16-bit inputs).
SHAPE = Shape(2, 12, 19, 4, 2, 32)


def _dtype(impl):
    return jnp.bfloat16 if impl == "cuda" else jnp.float32


@pytest.mark.parametrize("fn", ["reference", "xla"])
def test_sinks_check_grads(fn):
    """Numerical gradients in float64 of out (and lse) in q, k, v and sinks: the reference's
    (the ground truth of every other test) and xla's, through the one custom_vjp."""
    shape = Shape(1, 9, 11, 2, 1, 8)
    q, k, v = make_qkv(shape, jnp.float64)
    sinks = make_sinks(shape).astype(jnp.float64)
    kw = dict(is_causal=True, logits_soft_cap=3.0, key_value_seq_lengths=jnp.asarray([7], jnp.int32),
              query_offset=-2, return_residual=True)  # the first two rows see no key
    call = attention_reference if fn == "reference" else lambda *a, **k: jax_flash.attention(*a, implementation="xla", **k)

    f = jax.jit(lambda q, k, v, sinks: call(q, k, v, sinks=sinks, **kw))

    lse = f(q, k, v, sinks)[1]
    assert np.all(np.isfinite(np.asarray(lse))), "every row's lse holds its sink"
    check_grads(f, (q, k, v, sinks), order=1, modes=["rev"], atol=1e-6, rtol=1e-6, eps=1e-4)


Q = jnp.zeros((2, 8, 4, 16), jnp.float32)
KV = jnp.zeros((2, 10, 2, 16), jnp.float32)


@pytest.mark.parametrize(
    "sinks, exc, match",
    [
        (jnp.zeros((4,), jnp.int32), TypeError, r"sinks must be a floating-point array \[N\].*int32"),
        (jnp.zeros((5,), jnp.float32), ValueError, r"sinks must have shape \[N\] = \(4,\).*\(5,\)"),
        (jnp.zeros((1, 4), jnp.float32), ValueError, r"sinks must have shape \[N\] = \(4,\)"),
        (jnp.float32(0.0), ValueError, r"sinks must have shape \[N\] = \(4,\)"),
        ("x", TypeError, r"sinks must be an array"),
    ],
)
def test_sinks_validation(sinks, exc, match):
    for fn in (jax_flash.attention, jax_flash.explain, attention_reference):
        with pytest.raises(exc, match=match):
            fn(Q, KV, KV, sinks=sinks)
    with pytest.raises(exc, match=match):  # at trace time
        jax.jit(lambda q: jax_flash.attention(q, KV, KV, sinks=sinks)).trace(Q)


def test_sinks_nonfinite(impl):
    """A NaN or +inf sink makes every row of its head NaN (out, lse, and dsinks); a -inf sink
    is no sink (the same result as the call without, dsinks 0); the other heads stay exact."""
    dt = _dtype(impl)
    q, k, v = make_qkv(SHAPE, dt)
    sinks = make_sinks(SHAPE).at[1].set(jnp.nan).at[2].set(-jnp.inf).at[3].set(jnp.inf)
    kw = dict(is_causal=True, key_value_seq_lengths=jnp.asarray([19, 0], jnp.int32), return_residual=True)
    run = jax.jit(lambda q, k, v, s: jax_flash.attention(q, k, v, sinks=s, implementation=impl, **kw))
    out, lse = (np.asarray(x, np.float32) for x in run(q, k, v, sinks))
    ref, ref_lse = jax.jit(lambda q, k, v, s: attention_reference(
        q, k, v, sinks=s, compute_dtype=jnp.float64, **kw))(q, k, v, sinks)
    for head in (1, 3):
        assert np.isnan(out[:, :, head]).all() and np.isnan(lse[:, :, head]).all(), head
        assert np.isnan(np.asarray(ref)[:, :, head]).all() and np.isnan(np.asarray(ref_lse)[:, :, head]).all()
    tol = 2e-2 if dt == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(out[:, :, 0], np.asarray(ref, np.float32)[:, :, 0], atol=tol)
    np.testing.assert_allclose(lse[:, :, 0], np.asarray(ref_lse)[:, :, 0], atol=1e-5, rtol=1e-5)
    plain_out, plain_lse = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, implementation=impl, **kw))(q, k, v)
    np.testing.assert_allclose(out[:, :, 2], np.asarray(plain_out, np.float32)[:, :, 2], atol=1e-6)
    np.testing.assert_array_equal(lse[:, :, 2], np.asarray(plain_lse)[:, :, 2])
    assert np.all(lse[1, :, 2] == -np.inf) and np.all(out[1, :, 2] == 0)  # empty rows, no sink

    def loss(s):
        o, l = jax_flash.attention(q, k, v, sinks=s, implementation=impl, **kw)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0))

    dsinks = np.asarray(jax.jit(jax.grad(loss))(sinks))
    assert np.isfinite(dsinks[0]) and dsinks[0] != 0
    assert np.isnan(dsinks[1]) and np.isnan(dsinks[3]) and dsinks[2] == 0


def test_sinks_zero_size(impl):
    """S = 0: every row sees only its sink: out 0, lse = the sink; d lse / d sink = 1 per row."""
    dt = _dtype(impl)
    q = jnp.full((2, 5, 4, 32), 0.5, dt)
    k = v = jnp.zeros((2, 0, 2, 32), dt)
    sinks = jnp.asarray([0.5, -1.0, 3.0, -jnp.inf], jnp.float32)
    run = lambda q, s: jax_flash.attention(q, k, v, sinks=s, implementation=impl, return_residual=True)
    out, lse = jax.jit(run)(q, sinks)
    assert np.all(np.asarray(out, np.float32) == 0)
    np.testing.assert_array_equal(np.asarray(lse), np.broadcast_to(np.asarray(sinks), lse.shape))
    loss = lambda q, s: jnp.sum(jnp.where(jnp.isfinite(run(q, s)[1]), run(q, s)[1], 0))
    dq, dsinks = jax.jit(jax.grad(loss, (0, 1)))(q, sinks)
    assert np.all(np.asarray(dq, np.float32) == 0)
    np.testing.assert_array_equal(np.asarray(dsinks), [10.0, 10.0, 10.0, 0.0])  # B·T rows each


def test_sinks_vmap(impl):
    """vmap over q, k, v with one set of sinks folds into one call, forward and backward;
    mapping the sinks themselves works in xla and is a clear error in the compiled ones."""
    dt = _dtype(impl)
    shape = Shape(1, 8, 12, 2, 1, 32)
    q, k, v = make_qkv(shape, dt)
    sinks = make_sinks(shape)
    f = lambda q, k, v, s: jax_flash.attention(q, k, v, sinks=s, is_causal=True, implementation=impl)
    loss = lambda q, k, v, s: jnp.sum(f(q, k, v, s).astype(jnp.float32))
    step = lambda q, k, v, s: (f(q, k, v, s), jax.grad(loss, (0, 3))(q, k, v, s))
    stack = lambda x: jnp.stack([x, x[::-1]])
    out, (dq, ds) = jax.jit(jax.vmap(step, in_axes=(0, 0, 0, None)))(stack(q), stack(k), stack(v), sinks)
    one = jax.jit(step)
    tol = 1e-2 if dt == jnp.bfloat16 else 1e-5
    for i in range(2):
        out_i, (dq_i, ds_i) = one(stack(q)[i], stack(k)[i], stack(v)[i], sinks)
        np.testing.assert_allclose(np.asarray(out[i], np.float32), np.asarray(out_i, np.float32), atol=tol)
        np.testing.assert_allclose(np.asarray(dq[i], np.float32), np.asarray(dq_i, np.float32), atol=tol)
        np.testing.assert_allclose(np.asarray(ds[i]), np.asarray(ds_i), atol=tol, rtol=tol)
    per_call = jnp.stack([sinks, sinks + 1.0])
    if impl == "xla":
        out = jax.jit(jax.vmap(f))(stack(q), stack(k), stack(v), per_call)
        want = jax.jit(f)(stack(q)[1], stack(k)[1], stack(v)[1], sinks + 1.0)
        np.testing.assert_allclose(np.asarray(out[1]), np.asarray(want), atol=1e-5)
    else:
        with pytest.raises(ValueError, match="sinks cannot be mapped by jax.vmap"):
            jax.vmap(f)(stack(q), stack(k), stack(v), per_call)


def test_explain_sinks(impl):
    q, k, v = make_qkv(SHAPE, _dtype(impl))
    assert jax_flash.explain(q, k, v, sinks=make_sinks(SHAPE), implementation=impl).reasons[impl] is None
