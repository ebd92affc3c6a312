"""The edges of the numerical contract (docs/numerical-contract.md): windows of any size,
soft caps across float32's range, zero-size inputs, second derivatives and the limits every
implementation knows at trace time — for every implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from cases import EPS, FACTOR, GRAD_EPS, Shape, make_qkv, max_err
from jax_flash import cuda as cuda_impl, pallas as pallas_impl
from jax_flash._normalize import canonicalize
from jax_flash._vjp import SECOND_ORDER_MESSAGE
from jax_flash.reference import attention_reference

# H = 32 has cuda kernels; T, S cross no tile of the compiled implementations, so every
# window below is decided by the band, not by a block boundary.
SHAPE = Shape(2, 20, 24, 2, 1, 32)
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def _dtype(impl):
    return jnp.bfloat16 if impl == "cuda" else jnp.float32


def _loss(fn, cot, dlse, **kw):
    def f(q, k, v):
        out, lse = fn(q, k, v, return_residual=True, **kw)
        lse = jnp.where(jnp.isfinite(lse), lse, 0)
        return jnp.sum(out.astype(jnp.float32) * cot) + jnp.sum(lse * dlse)

    return f


def _check(impl, kw, grads=True):
    """out, lse (and dq, dk, dv) of `impl` against the float64 reference, with the suite's
    tolerance rule (tests/cases.py)."""
    q, k, v = make_qkv(SHAPE, _dtype(impl))
    name = jnp.dtype(q.dtype).name
    run = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, implementation=impl, return_residual=True, **kw))
    out, lse = run(q, k, v)
    ref64, lse64 = attention_reference(q, k, v, return_residual=True, compute_dtype=jnp.float64, **kw)
    ref_lo, lse_lo = attention_reference(q, k, v, return_residual=True, **kw)
    assert max_err(out, ref64) <= FACTOR * max_err(ref_lo, ref64) + EPS[name]
    assert max_err(lse, lse64) <= FACTOR * max_err(lse_lo, lse64) + 10 * EPS["float32"]
    if not grads:
        return
    cot = jax.random.normal(jax.random.PRNGKey(3), q.shape, jnp.float32)
    dlse = jax.random.normal(jax.random.PRNGKey(4), q.shape[:-1], jnp.float32)
    g = jax.jit(jax.grad(_loss(jax_flash.attention, cot, dlse, implementation=impl, **kw), (0, 1, 2)))(q, k, v)
    g64 = jax.grad(_loss(attention_reference, cot, dlse, compute_dtype=jnp.float64, **kw), (0, 1, 2))(q, k, v)
    g_lo = jax.grad(_loss(attention_reference, cot, dlse, **kw), (0, 1, 2))(q, k, v)
    for label, a, r64, rlo in zip(("dq", "dk", "dv"), g, g64, g_lo):
        err, tol = max_err(a, r64), FACTOR * max_err(rlo, r64) + GRAD_EPS[name]
        assert err <= tol, f"{label} error {err:.3g} > {tol:.3g}"


# ---------------------------------------------------------------- windows of any size

OFFSETS = np.asarray([INT32_MAX, INT32_MIN], np.int32)  # one per batch row


@pytest.mark.parametrize(
    "window, offsets, grads",
    [
        pytest.param((0, 2**31 - 1), None, True, id="right_int32_max"),
        pytest.param((2**31 - 9, 3), None, False, id="left_int32_max_minus_8"),
        pytest.param((2**40, 5), None, False, id="left_2e40"),
        pytest.param(2**70, None, False, id="both_2e70"),
        # Offsets at both ends of int32: row 0 sees every key through the huge left side,
        # row 1 every key through the huge right side (exact only with the clamp rule).
        pytest.param((2**33, 2**70), OFFSETS, False, id="offsets_int32_extremes"),
        pytest.param((2**31 + 3, 0), OFFSETS[::-1].copy(), False, id="offsets_causal_side"),
    ],
)
def test_window_any_python_int(impl, window, offsets, grads):
    kw = dict(local_window_size=window)
    if offsets is not None:
        kw["query_offset"] = jnp.asarray(offsets)
    _check(impl, kw, grads=grads)


def test_window_clamp_rule():
    """Canonicalisation clamps each side to T + S + 2**31 (any wider side is the same window for
    every int32 offset) and refuses negative sides, naming the argument."""
    q, k, v = make_qkv(SHAPE, jnp.float32)
    bound = SHAPE.t + SHAPE.s + 2**31
    spec = canonicalize(q, k, v, local_window_size=(2**70, 7)).spec
    assert (spec.window_left, spec.window_right) == (bound, 7)
    spec = canonicalize(q, k, v, local_window_size=bound - 1).spec
    assert (spec.window_left, spec.window_right) == (bound - 1, bound - 1)
    for bad in ((-1, 3), (3, -(2**70)), -2):
        with pytest.raises(ValueError, match="local_window_size"):
            jax_flash.attention(q, k, v, local_window_size=bad)


# ---------------------------------------------------------------- soft caps


@pytest.mark.parametrize("cap", [1e30, 1.2e-38, float(np.finfo(np.float32).tiny)], ids=["1e30", "1.2e-38", "tiny"])
def test_soft_cap_extremes_exact(impl, cap):
    _check(impl, dict(logits_soft_cap=cap), grads=cap != float(np.finfo(np.float32).tiny))


@pytest.mark.parametrize("cap", [0.0, -0.0, -1.0, 1e-46, 1e-40, 1.1e-38, 1.01e30, 3.4e38, float("inf"), float("nan")])
def test_soft_cap_outside_float32_normals_refused(impl, cap):
    q, k, v = make_qkv(SHAPE, _dtype(impl))
    with pytest.raises(ValueError, match="logits_soft_cap"):
        jax.jit(lambda q: jax_flash.attention(q, k, v, logits_soft_cap=cap, implementation=impl)).trace(q)


# ---------------------------------------------------------------- zero-size inputs

ZERO_SIZES = {
    "B0": ((0, 8, 2, 32), (0, 8, 2, 32)),
    "batch_axes_0x3": ((0, 3, 8, 2, 32), (0, 3, 8, 2, 32)),
    "T0": ((2, 0, 2, 32), (2, 8, 2, 32)),
    "N0": ((2, 8, 0, 32), (2, 8, 2, 32)),
    "S0": ((2, 8, 2, 32), (2, 0, 2, 32)),
    "all0": ((0, 0, 0, 32), (0, 0, 1, 32)),
}


@pytest.mark.parametrize("name", list(ZERO_SIZES))
def test_zero_size(impl, name):
    """An empty result of the right shapes everywhere; with S = 0 every row sees no key: out 0,
    lse -inf and zero gradients. Also with a bias (its gradient is zero too)."""
    qs, ks = ZERO_SIZES[name]
    dt = _dtype(impl)
    q = jnp.full(qs, 0.5, dt)
    k = v = jnp.full(ks, 0.25, dt)
    bias = None
    if impl in ("xla", "pallas"):
        bias = jnp.ones((*qs[:-3], qs[-2], qs[-3], ks[-3]), jnp.float32)
    run = jax.jit(
        lambda q, k, v, b: jax_flash.attention(q, k, v, b, implementation=impl, is_causal=True, return_residual=True)
    )
    out, lse = run(q, k, v, bias)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:-1]
    assert np.all(np.asarray(out, np.float32) == 0)
    assert np.all(np.asarray(lse) == -np.inf)
    f = lambda q, k, v, b: jnp.sum(run(q, k, v, b)[0].astype(jnp.float32))
    grads = jax.jit(jax.grad(f, argnums=(0, 1, 2) if bias is None else (0, 1, 2, 3)))(q, k, v, bias)
    for g, x in zip(grads, (q, k, v, bias)):
        assert g.shape == x.shape and g.dtype == x.dtype
        assert np.all(np.asarray(g, np.float32) == 0)


def test_zero_size_head_dim_and_kv_heads_refused():
    with pytest.raises(ValueError, match="head dim H >= 1"):
        jax_flash.attention(jnp.zeros((1, 4, 2, 0)), jnp.zeros((1, 4, 2, 0)), jnp.zeros((1, 4, 2, 0)))
    with pytest.raises(ValueError, match=r"at least one head \(K >= 1\)"):
        jax_flash.attention(jnp.zeros((1, 4, 0, 8)), jnp.zeros((1, 4, 0, 8)), jnp.zeros((1, 4, 0, 8)))


# ---------------------------------------------------------------- second derivatives


def test_second_derivatives_refused(impl):
    """grad of grad, jax.hessian and jacfwd of a gradient: a jax_flash NotImplementedError
    naming what to use instead, at trace time; forward mode on attention itself: JAX's own
    message for a custom_vjp."""
    q, k, v = make_qkv(Shape(1, 8, 8, 2, 1, 32), _dtype(impl))
    f = lambda q: jnp.sum(jax_flash.attention(q, k, v, implementation=impl).astype(jnp.float32))
    assert jax.grad(f)(q).shape == q.shape  # once is fine
    second = {
        "grad_of_grad": lambda q: jax.grad(lambda q: jnp.sum(jax.grad(f)(q).astype(jnp.float32)))(q),
        "hessian": jax.hessian(f),
        "jacfwd_of_grad": jax.jacfwd(jax.grad(f)),
        "jacrev_of_grad": jax.jacrev(jax.grad(f)),
    }
    for name, fn in second.items():
        with pytest.raises(NotImplementedError, match=r"jax_flash\.reference") as e:
            jax.jit(fn).trace(q)
        assert str(e.value) == SECOND_ORDER_MESSAGE, name
    for fn in (jax.jacfwd(f), lambda q: jax.jvp(f, (q,), (q,))):
        with pytest.raises(TypeError, match="forward-mode autodiff"):
            jax.jit(fn).lower(q)  # jvp of a custom_vjp traces; JAX refuses when lowering


# ---------------------------------------------------------------- limits known at trace time


def _abstract(q_shape, k_shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(q_shape, dtype), jax.ShapeDtypeStruct(k_shape, dtype)


def _explain(q, k, **kw):
    """jax_flash.explain on abstract arrays (under a trace: nothing is allocated)."""
    found = {}

    def f(q, k):
        found["e"] = jax_flash.explain(q, k, k, **kw)
        return q

    jax.jit(f).trace(q, k)
    return found["e"]


LIMITS = {
    # B·ceil(S / 64) CTAs of the backward in grid.x: above 2**31 - 1 for cuda; pallas runs it.
    "cuda_grid_x": (((65535, 1, 1, 32), (65535, 2**22, 1, 32)), {"cuda": "key blocks x batch", "pallas": None}),
    # The backward's 1-D delta grid: ceil(B·T·N / 8) CTAs at H = 128 (pallas folds N > 65535
    # into 2**30 + 32 programs, which it can launch).
    "cuda_delta_grid": (((1, 64, 2**28 + 8, 128), (1, 64, 1, 128)), {"cuda": "delta grid", "pallas": None}),
    # Batch and heads beyond Triton's grid.y/z: folded into grid.x, where they do not fit.
    "pallas_fold": (((70000, 16, 40000, 32), (70000, 16, 1, 32)), {"cuda": None, "pallas": "65535"}),
    # B above 65535 with a small grid: every implementation runs it.
    "wide_batch_ok": (((70000, 16, 2, 32), (70000, 16, 1, 32)), {"cuda": None, "pallas": None}),
}


@pytest.mark.parametrize("name", list(LIMITS))
def test_trace_time_limits(name):
    """The kernels' launch limits are in `unsupported()`: explain reports them, a requested
    implementation raises ValueError naming the limit, implementation=None picks one that runs."""
    (q_shape, k_shape), expected = LIMITS[name]
    q, k = _abstract(q_shape, k_shape)
    e = _explain(q, k)
    for impl, limit in expected.items():
        why = e.reasons[impl]
        if limit is None:
            assert why is None or not any(w in why for w in ("grid", "launch", "int32")), why
            continue
        assert why is not None and limit in why, why
        with pytest.raises(ValueError, match=f'implementation="{impl}" cannot run this call: .*{limit}'):
            jax.jit(lambda q, k, impl=impl: jax_flash.attention(q, k, k, implementation=impl)).trace(q, k)
    assert e.selected is not None and e.reasons[e.selected] is None
    jax.jit(lambda q, k: jax_flash.attention(q, k, k)).trace(q, k)  # None picks one that runs


def _spec(q_shape, k_shape):
    """The canonical spec of abstract inputs (canonicalised under a trace: no memory)."""
    out = {}

    def f(q, k):
        out["spec"] = canonicalize(q, k, k).spec
        return q

    jax.jit(f).trace(*_abstract(q_shape, k_shape))
    return out["spec"]


def test_launch_limits_at_the_boundary():
    """The limit functions are exact at their boundary: one CTA or program more fails."""
    b = (2**31 - 1) // 64  # S = 64·64: 64 key blocks per batch row
    assert cuda_impl.launch_limit(_spec((b, 1, 1, 32), (b, 64 * 64, 1, 32))) is None
    assert "grid.x" in cuda_impl.launch_limit(_spec((b + 1, 1, 1, 32), (b + 1, 64 * 64, 1, 32)))
    # H = 192: the backward's 32-key blocks (S = 64·64 is 128 of them per batch row).
    b = (2**31 - 1) // 128
    assert cuda_impl.launch_limit(_spec((b, 1, 1, 192), (b, 64 * 64, 1, 192))) is None
    assert "S/32" in cuda_impl.launch_limit(_spec((b + 1, 1, 1, 192), (b + 1, 64 * 64, 1, 192)))
    n = 65536  # above grid.y: the grid (blocks, N, B) is folded into grid.x
    assert pallas_impl.launch_limit(_spec((1, 16, n, 32), (1, 16, 1, 32))) is None
    blocks = -(-(2**31 - 1) // n)  # blocks · N >= 2**31 - 1
    assert pallas_impl.launch_limit(_spec((1, 16 * (blocks - 1), n, 32), (1, 16, 1, 32))) is None
    assert "grid.x" in pallas_impl.launch_limit(_spec((1, 16 * blocks, n, 32), (1, 16, 1, 32)))
    # jax asserts a folded grid.x below 2**31 - 1: exactly 2**31 - 1 programs do not launch.
    assert pallas_impl.launch_limit(_spec((1, 16, 2**31 - 2, 32), (1, 16, 1, 32))) is None
    assert "grid.x" in pallas_impl.launch_limit(_spec((1, 16, 2**31 - 1, 32), (1, 16, 1, 32)))


def test_sequence_length_limit():
    q, k = _abstract((1, 2**30, 1, 32), (1, 8, 1, 32))
    with pytest.raises(ValueError, match=r"query has T = 1073741824 positions.*2\*\*30 - 1"):
        _explain(q, k)
    q, k = _abstract((1, 8, 1, 32), (1, 2**30, 1, 32))
    with pytest.raises(ValueError, match=r"key has S = 1073741824"):
        jax.jit(lambda q, k: jax_flash.attention(q, k, k, implementation="xla")).trace(q, k)
