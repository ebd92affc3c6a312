"""The numerical contract at the edges (docs/numerical-contract.md), for every implementation.

NaN / ±inf in q, k, v: the set of non-finite elements of out, lse, dq, dk and dv equals the
float64 reference's exactly (a poison reaches the rows and keys that see it, never as 0; a
masked-out poison reaches nothing), and every finite element matches within the suite's
tolerance. Extreme scales (0, -0.0, negative, tiny, huge) give exact results under jit.

Shapes are small (the emulated cuda and interpreted pallas kernels are slow) but span two
64-key tiles of the cuda kernels, with poisons on both sides of tile and mask edges.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from cases import EPS, FACTOR, GRAD_EPS, Shape, make_qkv
from jax_flash.reference import attention_reference

SHAPE = Shape(2, 40, 90, 2, 1, 32)  # B, T, S, N, K, H: two query heads share the kv head
DTYPE = jnp.bfloat16
NAN, INF = float("nan"), float("inf")


def _masks(kind):
    s, t = SHAPE.s, SHAPE.t
    if kind == "none":
        return {}
    if kind == "causal":  # bottom-right: row t sees keys <= t + 50
        return dict(is_causal=True, query_offset=s - t)
    if kind == "window":
        return dict(local_window_size=(6, 2), query_offset=30)
    if kind == "lengths":  # batch row 0: 30 queries, 60 keys; row 1: everything
        return dict(
            query_seq_lengths=jnp.asarray([30, t], jnp.int32), key_value_seq_lengths=jnp.asarray([60, s], jnp.int32)
        )
    if kind == "segments":  # query segment 2 of row 1 sees no key (keys have 0 and 1 only)
        q_seg = np.zeros((2, t), np.int32)
        q_seg[:, 20:] = 1
        q_seg[1, 35:] = 2
        kv_seg = np.zeros((2, s), np.int32)
        kv_seg[:, 45:] = 1
        return dict(segment_ids=(jnp.asarray(q_seg), jnp.asarray(kv_seg)))
    if kind == "combo":
        kw = _masks("causal")
        kw.update(_masks("lengths"))
        kw.update(_masks("segments"))
        return kw
    raise ValueError(kind)


# (mask kind, [(operand, index (b, position, head, feature | None = the whole row), value)])
POISON_CASES = {
    # Batch 0: row 7 of head 1 (its out, lse, dq and the dk, dv of the keys it sees).
    # Batch 1: key 70 (second 64-key tile), seen by rows >= 20 only; rows 0..19 stay exact.
    "qk_nan-causal": ("causal", [("q", (0, 7, 1, 3), NAN), ("k", (1, 70, 0, 5), NAN)]),
    # Values: out of the rows that see them is NaN, their lse and the dv they send are not.
    # Key 20 is seen by every row, key 85 by rows >= 35.
    "v-causal": ("causal", [("v", (0, 20, 0, 2), NAN), ("v", (1, 85, 0, 0), INF)]),
    # +inf in k: the raw score is ±inf depending on q's sign; NaN either way.
    "k_inf-window": ("window", [("k", (1, 40, 0, 0), INF)]),
    # -inf in the whole of a q row: every score -inf, which must not read as an empty row.
    "q_neginf-segments": ("segments", [("q", (1, 30, 0, None), -INF)]),
    # Keys / values / queries past the lengths are masked for everyone: nothing changes,
    # but value 59 (inside row 0's 60 keys) poisons all of row 0's valid queries.
    "masked-lengths": (
        "lengths",
        [("k", (0, 75, 0, 1), NAN), ("v", (0, 61, 0, 3), INF), ("q", (0, 33, 0, 4), NAN), ("v", (0, 59, 0, 0), -INF)],
    ),
    # bias (xla, pallas): NaN at a visible pair poisons row 5 of batch 0; +inf behind the
    # causal mask changes nothing; a -inf row (3 of batch 1) is empty even with NaN value 2
    # visible behind it.
    "bias-causal": (
        "causal",
        [
            ("bias", (0, 0, 5, 30), NAN),
            ("bias", (1, 0, 10, 70), INF),
            ("bias", (1, 0, 3, None), -INF),
            ("v", (1, 2, 0, 1), NAN),
        ],
    ),
    "mixed-combo": (
        "combo",
        [
            ("q", (1, 12, 1, 0), INF),
            ("k", (1, 64, 0, 7), -INF),
            ("v", (0, 44, 0, 9), NAN),
            ("k", (0, 80, 0, 2), NAN),
            ("v", (1, 5, 0, None), NAN),
        ],
    ),
    # With a soft cap (third element: extra arguments): float32's smallest normal, which
    # saturates every logit (derivative 1 - tanh² = 0). The masked poisons still change
    # nothing, also through the cap's derivative (never formed at a masked NaN logit); rows
    # that see value 59 get NaN dq and dk of the keys they see (the NaN cotangent times the
    # zero derivative, as jax.nn's autodiff gives; docs/numerical-contract.md).
    "masked-lengths-saturated_cap": (
        "lengths",
        [("k", (0, 75, 0, 1), NAN), ("q", (0, 33, 0, 4), NAN), ("v", (0, 59, 0, 0), -INF)],
        dict(logits_soft_cap=1.1754944e-38),
    ),
}


def _poisoned(case):
    q, k, v = make_qkv(SHAPE, DTYPE)
    kind, poisons, *extra = POISON_CASES[case]
    arrays = dict(q=q, k=k, v=v)
    kw = _masks(kind)
    kw.update(*extra)
    if any(name == "bias" for name, *_ in poisons):  # [B, 1, T, S]
        rng = np.random.default_rng(3)
        arrays["bias"] = jnp.asarray(rng.normal(size=(SHAPE.b, 1, SHAPE.t, SHAPE.s)), jnp.float32)
    for name, (b, pos, head, feat), value in poisons:
        index = (b, pos, head) if feat is None else (b, pos, head, feat)
        arrays[name] = arrays[name].at[index].set(value)
    if "bias" in arrays:
        kw["bias"] = arrays["bias"]
    return arrays["q"], arrays["k"], arrays["v"], kw


def _needs(impl, q, k, v, kw):
    why = jax_flash.explain(q, k, v, implementation=impl, **kw).reasons[impl]
    if why is not None:
        pytest.skip(f"{impl}: {why}")


def _outputs_and_grads(fn, q, k, v, kw, **extra):
    """out, lse, dq, dk, dv of `fn`; both outputs carry a random cotangent (the lse one only
    where lse is finite)."""
    cot = jax.random.normal(jax.random.PRNGKey(7), q.shape, jnp.float32)
    dlse = jax.random.normal(jax.random.PRNGKey(8), q.shape[:-1], jnp.float32)

    def loss(q, k, v):
        out, lse = fn(q, k, v, return_residual=True, **kw, **extra)
        finite_lse = jnp.where(jnp.isfinite(lse), lse, 0)
        return jnp.sum(out.astype(jnp.float32) * cot) + jnp.sum(finite_lse * dlse), (out, lse)

    grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return tuple(np.asarray(jnp.asarray(x, jnp.float64)) for x in (out, lse, *grads))


@functools.cache
def _references(case):
    """(float64 reference, reference at the input dtype) of a case, shared by the impls."""
    q, k, v, kw = _inputs(case)
    return (
        _outputs_and_grads(attention_reference, q, k, v, kw, compute_dtype=jnp.float64),
        _outputs_and_grads(attention_reference, q, k, v, kw),
    )


def _inputs(case):
    if case in SCALES:
        q, k, v = make_qkv(SHAPE, DTYPE)
        return q, k, v, dict(scale=SCALES[case], **_masks("combo"))
    return _poisoned(case)


NAMES = ("out", "lse", "dq", "dk", "dv")


def _check_against_reference(impl, case, *, grads_exact=True):
    q, k, v, kw = _inputs(case)
    _needs(impl, q, k, v, kw)
    got = _outputs_and_grads(jax_flash.attention, q, k, v, kw, implementation=impl)
    ref64, ref_lo = _references(case)
    for i, (name, a, r64, rlo) in enumerate(zip(NAMES, got, ref64, ref_lo)):
        finite = np.isfinite(r64)
        bad = np.argwhere(np.isfinite(a) != finite)
        assert bad.size == 0, (
            f"{name}: non-finite pattern differs from the reference at {len(bad)} elements, "
            f"first {bad[:4].tolist()} (impl {a[tuple(bad[0])]}, reference {r64[tuple(bad[0])]})"
        )
        if name == "lse":  # -inf exactly where the reference has -inf (rows that see nothing)
            np.testing.assert_array_equal(a == -np.inf, r64 == -np.inf, err_msg="lse -inf pattern")
        if i >= 2 and not grads_exact:
            continue
        eps = (EPS if i < 2 else GRAD_EPS)[jnp.dtype(DTYPE).name] * (10 if name == "lse" else 1)
        lo_err = np.max(np.abs(rlo[finite] - r64[finite]), initial=0.0)
        err = np.max(np.abs(a[finite] - r64[finite]), initial=0.0)
        assert err <= FACTOR * lo_err + eps, f"{name}: error {err:.3g} > {FACTOR * lo_err + eps:.3g}"
    return got, ref64


@pytest.mark.parametrize("case", list(POISON_CASES))
def test_nonfinite_pattern(impl, case):
    got, ref64 = _check_against_reference(impl, case)
    out = ref64[0]
    # The case poisons something (the check is not vacuous) and leaves something exact.
    assert np.isnan(out).any() and np.isfinite(out).any()
    # A poisoned row is NaN, never an empty row's 0 / -inf.
    assert not np.any(np.isinf(got[1]) & np.isnan(out).any(-1)), "a poisoned row reads as empty"
    assert np.all(np.isnan(got[0][np.isnan(out)])), "non-finite outputs are NaN"


@pytest.mark.parametrize("isa", ["avx512", "amx_emulated"])
@pytest.mark.parametrize("case", ["k_inf-window", "mixed-combo"])
def test_nonfinite_pattern_on_cpu_isas(isa, case, monkeypatch):
    """The cpu kernels' other products make a ±inf score NaN as the default ones do: float32
    products (avx512) and the AMX tiles' code (emulated). An ISA this CPU lacks is skipped."""
    from jax_flash import _jax_flash_ext

    monkeypatch.setenv("JAX_FLASH_CPU_ISA", isa)
    try:
        assert _jax_flash_ext.cpu_isa() == isa
    except ValueError as e:
        pytest.skip(str(e))
    test_nonfinite_pattern("cpu", case)


def test_nonfinite_reference_rule():
    """The reference itself, on the rule's words: causal with a NaN key 70 (seen by rows t
    with t + 50 >= 70) and a NaN value 20 (seen by every row)."""
    q, k, v = make_qkv(SHAPE, jnp.float64)
    k = k.at[0, 70, 0, 5].set(NAN)
    v = v.at[1, 20, 0, 2].set(NAN)
    kw = _masks("causal")
    out, lse, dq, dk, dv = _outputs_and_grads(attention_reference, q, k, v, kw, compute_dtype=jnp.float64)
    rows = np.arange(SHAPE.t)
    sees_k = rows + 50 >= 70
    # batch 0: rows that see key 70 are NaN (out, lse, dq); so are dk, dv of the keys they see.
    assert np.array_equal(np.isnan(out[0]).all(-1), np.broadcast_to(sees_k[:, None], (SHAPE.t, SHAPE.n)))
    assert np.array_equal(np.isnan(lse[0]).any(-1), sees_k)
    assert np.array_equal(np.isnan(dq[0]).any((-1, -2)), sees_k)
    keys_seen = np.arange(SHAPE.s) <= (SHAPE.t - 1) + 50
    assert np.array_equal(np.isnan(dk[0, :, 0]).any(-1), keys_seen)
    assert np.array_equal(np.isnan(dv[0, :, 0]).any(-1), keys_seen)
    # batch 1: every row sees value 20: out NaN, lse finite, dv finite (P does not depend on v).
    assert np.isnan(out[1]).all() and np.isfinite(lse[1]).all() and np.isfinite(dv[1]).all()
    assert np.isnan(dq[1]).all()
    assert np.array_equal(np.isnan(dk[1, :, 0]).any(-1), keys_seen)


# Scale 0, -0.0 and negative scales are cases of the shared suite (tests/cases.py).
SCALES = {"scale_1e-30": 1e-30, "scale_3e9": 3e9, "scale_1e30": 1e30}


@pytest.mark.parametrize("case", list(SCALES))
def test_nonfinite_extreme_scale(impl, case):
    """Exact under jit at every scale: the forward always; gradients where they are well
    conditioned (for |scale · logit| >> 1 the softmax is one-hot and FlashAttention's
    dS = P (dP - D) is scale times a rounding difference: only finiteness is asserted)."""
    got, _ = _check_against_reference(impl, case, grads_exact=abs(SCALES[case]) < 1e3)
    for name, a in zip(NAMES, got):
        if name != "lse":
            assert np.isfinite(a).all(), f"{name} not finite"
