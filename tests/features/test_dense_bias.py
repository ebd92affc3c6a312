"""Dense bias and mask in the compiled kernels: a bias [B|1, N|1, T|1, S|1] (float16, bfloat16
or float32) and a boolean mask of the same broadcast shapes, read by the kernels through their
broadcast strides, and dbias reduced over the broadcast dims inside the backward.

Each case runs forward and backward once (out, lse and the gradients in q, k, v and bias, with
cotangents on out and lse) and compares them with the float64 reference under the suite's
tolerance (err <= 2·err(reference at the input dtype) + eps). Shapes are ragged at +1 / -1 of
the cpu kernels' 128-row, 128-key tiles, so that the bias' tiles straddle every tile edge.
Poisoned bias elements: a NaN where the pair is masked changes nothing (bit for bit); a NaN, a
row of -inf and a -inf next to a non-finite value where the pairs are visible give the
reference's NaN / empty pattern. DENSE_IMPLS: the compiled implementations that take them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_flash
from cases import EPS, FACTOR, GRAD_EPS, Shape, make_qkv, make_sinks, mask_kwargs
from jax_flash.reference import attention_reference

DENSE_IMPLS = ("cpu", "cuda")
# Those whose float32 inputs the poison and numerical-gradient checks use (cuda takes 16-bit
# inputs only: its poison checks run in float16, its gradients against the reference).
F32_DENSE_IMPLS = ("cpu",)


def _poison_dtype(impl):
    return jnp.float32 if impl in F32_DENSE_IMPLS else jnp.float16


@dataclasses.dataclass(frozen=True)
class BiasCase:
    name: str
    shape: Shape
    dtype: str
    bias_dims: str  # one letter per dim: the full size (B, N, T, S) or 1 (broadcast)
    bias_dtype: str
    mask_dims: str | None  # the dense mask's dims, or None
    mask_kind: str  # the structured masks (cases.mask_kwargs)
    sinks: bool = False

    def __str__(self):
        return self.name


CASES = [
    # T5's relative bias: one [N, T, S] for the whole batch; GQA, causal, T = 128 + 1, S = 128 - 1.
    BiasCase("t5_gqa_causal", Shape(2, 129, 127, 4, 2, 64), "bfloat16", "1NTS", "float32", None, "causal"),
    # Per-key bias and key-padding mask per batch row (summed over heads and rows); MQA, window.
    BiasCase("keys_window_mqa", Shape(2, 127, 129, 2, 1, 32), "bfloat16", "B11S", "bfloat16", "B11S", "window"),
    # Per-query-row bias (summed over batch, heads and keys: the chunks' partials), soft cap, sinks.
    BiasCase(
        "rows_softcap_sinks", Shape(1, 129, 260, 2, 2, 32), "float16", "11T1", "float16", "1NTS", "softcap", sinks=True
    ),
    # A full-size float16 bias for float32 inputs (dbias written tile by tile) with a [T, S] mask
    # and the combo of causal, soft cap, key lengths and segment ids. ([1, N, 1, S]: below.)
    BiasCase("full_combo", Shape(2, 65, 129, 2, 2, 40), "float32", "BNTS", "float16", "11TS", "combo"),
]


def _dims(spec: str, shape: Shape) -> tuple:
    full = dict(B=shape.b, N=shape.n, T=shape.t, S=shape.s)
    return tuple(1 if c == "1" else full[c] for c in spec)


def make_bias(case: BiasCase, seed: int = 11):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(size=_dims(case.bias_dims, case.shape)), jnp.dtype(case.bias_dtype))


def make_mask(case: BiasCase, seed: int = 12):
    if case.mask_dims is None:
        return None
    rng = np.random.default_rng(seed)
    m = rng.random(size=_dims(case.mask_dims, case.shape)) < 0.8
    if case.mask_dims[2:] == "TS":
        m[0, 0, 1, :] = False  # a query row that sees no key
    return jnp.asarray(m)


def run(fn, q, k, v, bias, kw, cot, dlse, **extra):
    """(out, lse, dq, dk, dv, dbias) of one call, with cotangents cot on out and dlse on lse."""

    def loss(q, k, v, bias):
        out, lse = fn(q, k, v, bias, return_residual=True, **kw, **extra)
        finite_lse = jnp.where(jnp.isfinite(lse), lse, 0)
        total = jnp.sum(out.astype(jnp.float32) * cot) + jnp.sum(finite_lse * dlse)
        return total, (out, lse)

    grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, bias)
    return (out, lse, *grads)


NAMES = ("out", "lse", "dq", "dk", "dv", "dbias")


def assert_like_reference(results, ref64, ref_lo, dtype):
    """NaN / ±inf where the float64 reference has them, and the suite's tolerance elsewhere."""
    for name, x, r64, rlo in zip(NAMES, results, ref64, ref_lo):
        x, r64, rlo = (np.asarray(jnp.asarray(a, jnp.float64)) for a in (x, r64, rlo))
        assert x.shape == r64.shape, (name, x.shape, r64.shape)
        np.testing.assert_array_equal(np.isnan(x), np.isnan(r64), err_msg=f"{name}: NaN pattern")
        np.testing.assert_array_equal(np.isinf(x), np.isinf(r64), err_msg=f"{name}: inf pattern")
        finite = np.isfinite(r64)
        if not finite.any():
            continue
        eps = (EPS if name in ("out", "lse") else GRAD_EPS)[dtype if name != "lse" else "float32"]
        tol = FACTOR * np.max(np.abs(rlo[finite] - r64[finite])) + eps * (10 if name == "lse" else 1)
        err = np.max(np.abs(x[finite] - r64[finite]))
        assert err <= tol, f"{name} error {err:.3g} > {tol:.3g}"


def _inputs(case: BiasCase):
    q, k, v = make_qkv(case.shape, jnp.dtype(case.dtype))
    kw = mask_kwargs(case.mask_kind, case.shape)
    mask = make_mask(case)
    if mask is not None:
        kw["mask"] = mask
    if case.sinks:
        kw["sinks"] = make_sinks(case.shape)
    out_shape = q.shape[:-1] + v.shape[-1:]
    cot = jax.random.normal(jax.random.PRNGKey(7), out_shape, jnp.float32)
    dlse = jax.random.normal(jax.random.PRNGKey(8), q.shape[:-1], jnp.float32)
    return q, k, v, make_bias(case), kw, cot, dlse


def _compare(impl, q, k, v, bias, kw, cot, dlse):
    why = jax_flash.explain(q, k, v, bias, implementation=impl, **kw).reasons[impl]
    if why is not None:
        pytest.skip(f"{impl}: {why}")
    got = run(jax_flash.attention, q, k, v, bias, kw, cot, dlse, implementation=impl)
    assert got[0].dtype == q.dtype and got[5].dtype == bias.dtype and got[5].shape == bias.shape
    ref64 = run(attention_reference, q, k, v, bias, kw, cot, dlse, compute_dtype=jnp.float64)
    ref_lo = run(attention_reference, q, k, v, bias, kw, cot, dlse)
    assert_like_reference(got, ref64, ref_lo, str(q.dtype))
    return got


@pytest.mark.parametrize("impl", DENSE_IMPLS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_bias_and_mask(impl, case):
    _compare(impl, *_inputs(case))


def test_default_picks_cpu_for_a_biased_call():
    if jax.default_backend() != "cpu":
        pytest.skip("CPU backend only")
    q, k, v, bias, kw, _, _ = _inputs(CASES[0])
    e = jax_flash.explain(q, k, v, bias, **kw)
    if e.reasons["cpu"] is not None:
        pytest.skip(f"cpu unavailable: {e.reasons['cpu']}")
    assert e.selected == "cpu"
    assert "read in place" in e.notes["cpu"] and "dbias summed over B" in e.notes["cpu"]


POISON_SHAPE = Shape(1, 130, 129, 2, 1, 32)  # two query and two key tiles, one column / row past


@pytest.mark.parametrize("impl", DENSE_IMPLS)
def test_nan_bias_at_masked_pairs_changes_nothing(impl):
    """NaN in the bias wherever the pair is masked (above the causal diagonal, or where the dense
    mask is false), with the soft cap on (whose derivative at NaN is NaN): every result is bit
    for bit that of the clean bias, and dbias is 0 there."""
    q, k, v = make_qkv(POISON_SHAPE, _poison_dtype(impl))
    case = BiasCase("poison", POISON_SHAPE, "float32", "11TS", "float32", "11TS", "causal")
    bias, mask = make_bias(case), make_mask(case)
    t, s = POISON_SHAPE.t, POISON_SHAPE.s
    masked = (np.arange(s)[None, :] > np.arange(t)[:, None]) | ~np.asarray(mask[0, 0])
    poisoned = jnp.where(masked[None, None], jnp.nan, bias)
    kw = dict(is_causal=True, logits_soft_cap=3.0, mask=mask, implementation=impl)
    cot = jax.random.normal(jax.random.PRNGKey(1), q.shape, jnp.float32)
    dlse = jax.random.normal(jax.random.PRNGKey(2), q.shape[:-1], jnp.float32)
    clean = run(jax_flash.attention, q, k, v, bias, kw, cot, dlse)
    dirty = run(jax_flash.attention, q, k, v, poisoned, kw, cot, dlse)
    for name, a, b in zip(NAMES, clean, dirty):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    dbias = np.asarray(dirty[5])[0, 0]
    assert np.all(dbias[masked] == 0) and np.all(np.isfinite(dbias)) and np.any(dbias[~masked] != 0)


@pytest.mark.parametrize("impl", DENSE_IMPLS)
def test_poisoned_bias_at_visible_pairs_like_the_reference(impl):
    """Visible pairs: a NaN bias poisons its row (out, lse, and the gradients it reaches), a row
    whose bias is -inf everywhere is empty (out 0, lse -inf), and a -inf bias at a key whose
    value is NaN does not hide that value (the rows of its batch are NaN, lse finite), as in
    the reference."""
    shape = Shape(2, 40, 129, 2, 1, 32)
    case = BiasCase("visible", shape, "float32", "1NTS", "float32", None, "none")
    q, k, v = make_qkv(shape, _poison_dtype(impl))
    bias = np.array(make_bias(case))
    bias[0, 1, 5, 17] = np.nan
    bias[0, 0, 9, :] = -np.inf
    v = v.at[1, 100, 0, 3].set(jnp.nan)
    bias[0, :, :, 100] = -np.inf
    cot = jax.random.normal(jax.random.PRNGKey(3), q.shape, jnp.float32)
    dlse = jax.random.normal(jax.random.PRNGKey(4), q.shape[:-1], jnp.float32)
    out, lse, *_ = _compare(impl, q, k, v, jnp.asarray(bias), {}, cot, dlse)
    out, lse = np.asarray(out), np.asarray(lse)  # [B, T, N, H], [B, T, N]
    assert np.isnan(out[:, 5, 1]).all() and np.isnan(lse[:, 5, 1]).all()
    assert np.all(out[:, 9, 0] == 0) and np.all(lse[:, 9, 0] == -np.inf)
    assert np.isnan(out[1, 20, 0]).all() and np.isfinite(lse[1, 20, 0])
    assert np.isfinite(out[0, 20, 0]).all()


@pytest.mark.parametrize("impl", F32_DENSE_IMPLS)
def test_check_grads_with_broadcast_bias(impl):
    """Numerical gradients (reverse mode, float32) in q, k, v and a [1, N, 1, S] bias, with a
    dense mask, the soft cap and GQA."""
    shape = Shape(2, 9, 11, 4, 2, 8)
    q, k, v = make_qkv(shape, jnp.float32)
    rng = np.random.default_rng(5)
    bias = jnp.asarray(rng.normal(size=(1, 4, 1, 11)), jnp.float32)
    mask = jnp.asarray(rng.random(size=(2, 1, 9, 11)) < 0.7)
    kw = dict(mask=mask, logits_soft_cap=3.0, implementation=impl)
    f = jax.jit(lambda q, k, v, b: jax_flash.attention(q, k, v, b, **kw))
    check_grads(f, (q, k, v, bias), order=1, modes=["rev"], atol=2e-2, rtol=2e-2, eps=2e-3)


@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=str)
def test_cpu_isas_and_threads(case, monkeypatch):
    """The cpu kernels on every ISA this CPU has (vector widths 4, 8 and 16, against the
    default, which runs bf16 inputs on the bf16 products where the CPU has AVX512-BF16) agree
    within 2% of the largest magnitude, and one thread gives the same bits as all of them:
    dbias' sums run in a fixed order whoever ran which item."""
    from jax_flash import _jax_flash_ext as ext

    q, k, v, bias, kw, cot, dlse = _inputs(case)
    if jax_flash.explain(q, k, v, bias, implementation="cpu", **kw).reasons["cpu"] is not None:
        pytest.skip("cpu unavailable")

    # A new jit per setting: the ISA is fixed when a call is traced.
    def f(*args):
        return jax.jit(
            lambda q, k, v, bias: run(jax_flash.attention, q, k, v, bias, kw, cot, dlse, implementation="cpu")
        )(*args)

    base = [np.asarray(x) for x in f(q, k, v, bias)]
    previous = ext.set_cpu_thread_limit(1)  # the process-wide JAX_FLASH_CPU_THREADS setting
    try:
        for name, a, b in zip(NAMES, base, f(q, k, v, bias)):
            np.testing.assert_array_equal(a, np.asarray(b), err_msg=f"{name}: one thread")
    finally:
        ext.set_cpu_thread_limit(previous)
    for isa in ("generic", "avx2", "avx512", "avx512bf16", "amx", "amx_emulated"):
        monkeypatch.setenv("JAX_FLASH_CPU_ISA", isa)
        try:
            ext.cpu_isa()
        except ValueError:
            continue  # this CPU lacks it
        for name, a, b in zip(NAMES, base, f(q, k, v, bias)):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b), err_msg=f"{name} on {isa}")
            finite = np.isfinite(a)
            scale = np.max(np.abs(a[finite]), initial=1.0)
            assert np.max(np.abs(a[finite] - b[finite]), initial=0.0) <= 2e-2 * scale, f"{name} on {isa}"


@pytest.mark.parametrize("impl", DENSE_IMPLS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_minus_inf_in_a_16_bit_bias_still_sees_its_value(impl, dtype):
    """A -inf in a 16-bit bias is found as such (the kernels then tell its visible pair from a
    masked one): a row whose only non-finite value is behind a -inf bias is NaN; behind the
    dense mask it is not."""
    shape = Shape(1, 8, 20, 1, 1, 32)
    q, k, v = make_qkv(shape, jnp.dtype(dtype))
    v = v.at[0, 3, 0, 0].set(jnp.nan)
    bias = jnp.zeros((1, 1, 1, 20), dtype).at[..., 3].set(-jnp.inf)
    keep = jnp.ones((1, 1, 1, 20), bool).at[..., 3].set(False)
    out = jax_flash.attention(q, k, v, bias, implementation=impl)
    masked = jax_flash.attention(q, k, v, bias, mask=keep, implementation=impl)
    assert np.isnan(np.asarray(out, np.float32)).all()
    assert np.isfinite(np.asarray(masked, np.float32)).all()
