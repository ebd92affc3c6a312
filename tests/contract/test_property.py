"""Property-based differential suite: random calls, every implementation against the float64
reference, forward and backward.

Each example (tests/property_cases.py) draws shapes near the kernels' tile sizes, GQA/MQA,
a dtype and head dim, any combination of the mask arguments (causal, windows one-sided and
huge, lengths 0 / negative / beyond T or S, segment ids, query offsets negative and per
row), soft caps, scales from 0 to 1e30, biases and masks (where taken), NaN/Inf at random
positions, empty rows. A configuration the implementation refuses (`explain`) must be a
ValueError with that reason, and the example is drawn again.

Checks, for out, lse, dq, dk, dv and dbias:
* the non-finite pattern equals the float64 reference's, element for element;
* on the finite elements, the suite's rule (tests/cases.py):
  err(impl) <= FACTOR·err(reference at the input dtype) + EPS (GRAD_EPS for gradients),
  both against the float64 reference (GRAD_EPS relative to the gradient's largest magnitude
  where that is above 1); where the reference at the input dtype overflows
  (float16 logits past 65504) its error is measured with float32 logits rounded to the
  input dtype, and an element of a broadcast bias's gradient, a sum of m logits' gradients,
  gets EPS·sqrt(m). (float32 examples keep their logits small: property_cases.draw.) An lse
  may be off by LSE_ULPS_PER_SQRT_H·sqrt(H) ulps of |lse| where that exceeds its EPS, dq and
  dk of float16/bfloat16 inputs by the rounding of dS to the input dtype (_rounded_ds_slack),
  and at |scale| >= 1e8 a gradient by the one-hot softmax's rounding (_one_hot_slack).
* exact: rows with lse = -inf in the reference give out 0, lse -inf and dq 0; keys no query
  sees give dk = dv = 0 (and dbias 0 where a full bias is masked); a row the mask rules
  leave empty is -inf in the reference too.

CI runs CI_EXAMPLES per implementation (few, and tiny shapes, for emulated cuda and
interpreted pallas). Long mode: `--property-examples=N` (or xla:N,cpu:N,cuda:N,pallas:N; env
JAX_FLASH_PROPERTY_EXAMPLES) runs thousands; `JAX_FLASH_PROPERTY_SEED` picks another set.
A failure's message is one line: the command that reruns exactly that example, what
differs, and the drawn configuration (JAX_FLASH_PROPERTY_LOG=<file> also appends it there).
"""

from __future__ import annotations

import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from cases import EPS, FACTOR, GRAD_EPS
from conftest import availability, slow_impl
from jax_flash.reference import attention_reference
from property_cases import EXTREME_SCALES, Gates, dense_mask, draw, visibility

# ---- dimensions that wait for other work ---------------------------------------------------
# NaN/±Inf injections in q, k, v and bias, and scales of magnitude >= 1e8: the propagation
# contract (docs/numerical-contract.md) is implemented by the NaN/Inf work in xla.py,
# pallas/_triton_kernels.py and the cpu/cuda softmax; until it is merged the implementations hide
# poisons as zeros and lose huge logits. Merged (JAX_FLASH_PROPERTY_NAN=1 turns the
# dimension on for one run when this is False).
NAN_CONTRACT_MERGED = True
# Window sides >= 2**31, soft caps that are not a float32 normal (ValueError naming
# logits_soft_cap), soft caps >= 1e4 (the cuda kernels' tanh loses its relative accuracy for
# small arguments: a cap of 1e30 zeroes every logit) and empty B, T, S or N axes: the limits
# work (_normalize.py, _vjp.py, cuda/kernels/softmax.h's tanh_of, the implementations'
# unsupported()). Merged (JAX_FLASH_PROPERTY_LIMITS=1 turns it on for one run when False).
LIMITS_CONTRACT_MERGED = True

# Each switch, or its variable set to 1 for one run (what a failure's line then names).
_SWITCHES = {
    "JAX_FLASH_PROPERTY_NAN": NAN_CONTRACT_MERGED,
    "JAX_FLASH_PROPERTY_LIMITS": LIMITS_CONTRACT_MERGED,
}
_ON = {name: merged or os.environ.get(name) == "1" for name, merged in _SWITCHES.items()}
GATES = Gates(
    poisons=_ON["JAX_FLASH_PROPERTY_NAN"],
    huge_windows=_ON["JAX_FLASH_PROPERTY_LIMITS"],
    bad_soft_caps=_ON["JAX_FLASH_PROPERTY_LIMITS"],
    large_soft_caps=_ON["JAX_FLASH_PROPERTY_LIMITS"],
    zero_size=_ON["JAX_FLASH_PROPERTY_LIMITS"],
)

# Examples per implementation in CI: 155 s of CPU time in all (4 min 15 s of wall time at a
# load average of 8), measured on the 2-core machine: under 3 minutes there when idle. With
# the poisons-with-caps and extreme-scale dimensions on (same counts): 177 s of CPU time,
# 3 min 20 s of wall time at a load average of 9.
CI_EXAMPLES = {"xla": 20, "cpu": 24, "pallas": 5, "cuda": 12}
IMPLS = ("xla", "cpu", "pallas", "cuda")
MAX_ATTEMPTS = 8  # draws until one the implementation claims to support
LSE_ULPS_PER_SQRT_H = 2  # the lse's relative tolerance (see _compare)


def _counts(config) -> dict:
    spec = config.getoption("property_examples") or os.environ.get("JAX_FLASH_PROPERTY_EXAMPLES")
    counts = dict(CI_EXAMPLES)
    if spec:
        for part in str(spec).split(","):
            name, _, num = part.rpartition(":")
            for impl in [name] if name else IMPLS:
                if impl not in IMPLS:
                    raise pytest.UsageError(f"--property-examples: unknown implementation {impl!r}")
                counts[impl] = int(num)
    return counts


def _seed(config) -> int:
    return int(config.getoption("property_seed") or os.environ.get("JAX_FLASH_PROPERTY_SEED", "0"))


def pytest_generate_tests(metafunc):
    if "example_id" not in metafunc.fixturenames:
        return
    only = metafunc.config.getoption("property_example")
    if only:
        ids = [only]
    else:
        counts = _counts(metafunc.config)
        # Interleaved (index first), so that a long run stopped early has covered every implementation.
        ids = [f"{impl}-{i}" for i in range(max(counts.values())) for impl in IMPLS if i < counts[impl]]
    metafunc.parametrize("example_id", ids, ids=ids)


def _reproduce(ex) -> str:
    env = f"JAX_FLASH_PROPERTY_SEED={ex.seed}"
    flags = "".join(f" {name}=1" for name, merged in _SWITCHES.items() if _ON[name] and not merged)
    return f"{env}{flags} python -m pytest -q tests/contract/test_property.py --property-example={ex.id}"


class Failure(AssertionError):
    pass


def _fail(ex, what: str):
    raise Failure(f"{_reproduce(ex)}  # {what} | drawn: {ex.describe()}")


def _np(x):
    return np.asarray(jnp.asarray(x, jnp.float64))


def _compile(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def _step(fn, ex, arrays, **extra):
    """q, k, v, bias, ct, dlse -> out, lse, (dq, dk, dv, dbias) of one implementation."""
    kw = ex.kwargs()
    mask = arrays.get("mask")

    def step(q, k, v, bias, ct, dlse):
        f = lambda q, k, v, bias: fn(q, k, v, bias, mask, return_residual=True, **kw, **extra)
        (out, lse), vjp = jax.vjp(f, q, k, v, bias)
        if not ex.dlse_on_empty:
            dlse = jnp.where(lse == -jnp.inf, 0, dlse)
        return out, lse, vjp((ct.astype(out.dtype), dlse.astype(lse.dtype)))

    return step


def _args(arrays):
    return arrays["q"], arrays["k"], arrays["v"], arrays.get("bias"), arrays["ct"], arrays["dlse"]


def _flatten(result):
    out, lse, (dq, dk, dv, dbias) = result
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv, "dbias": dbias}


def _first(mask):
    idx = np.argwhere(mask)[0]
    return tuple(int(i) for i in idx)


def _one_hot_slack(ex, arrays) -> dict:
    """At |scale| >= EXTREME_SCALES[0] the softmax is one-hot and the gradients are finite
    but not exact (docs/numerical-contract.md), for two reasons, each bounded here:

    * dS = P∘(dP - D) at the row's one key is dP - D = dO·v - dO·O + dlse: dO·v - dO·O is a
      difference of two rounded H-term dot products that the reference's autodiff (and every
      other summation order) gets differently, multiplied by the scale on its way to dq and
      dk: H ulps of float32 of max|dO|·max|v|, times |scale|·max|k| for dq, |scale|·max|q|
      for dk, and alone for dbias.
    * The backward recomputes P = exp(x - lse) of the row's one key from a logit x ~ |scale|
      whose float32 ulp is >= 1 in the exponent: where XLA compiles the forward and the
      backward's recomputation differently (xla, interpreted pallas: contracted multiplies,
      another association) x - lse is a few ulps below 0 and P anything in [0, 1] (the
      exponent is clamped to <= 0). Every P-weighted term may be lost: the dlse term of dq
      (|scale|·|dlse|·max|k| per row), of dk (|scale|·max|q|·Σ|dlse| over the rows of its
      kv head), dv (Σ|dO| over those rows) and dbias (|dlse| per logit, summed over the
      bias's broadcast axes)."""
    if ex.scale is None or abs(ex.scale) < EXTREME_SCALES[0]:
        return {}
    top = {name: float(_finite_abs(arrays[name]).max(initial=0.0)) for name in ("q", "k", "v", "ct")}
    diff = ex.h * float(np.finfo(np.float32).eps) * top["ct"] * top["v"]
    g = ex.n // ex.kh
    dlse = _finite_abs(arrays["dlse"])  # [B, T, N]
    ct = _finite_abs(arrays["ct"]).max(-1)  # [B, T, N]: max over the head dim
    per_kv = lambda x: x.reshape(ex.b, ex.t, ex.kh, g).sum((1, 3))[:, None, :, None]  # [B, 1, K, 1]
    scale = abs(ex.scale)
    slack = {
        "dq": scale * top["k"] * (diff + dlse[..., None]),
        "dk": scale * top["q"] * (diff + per_kv(dlse)),
        "dv": per_kv(ct),
    }
    if ex.bias_shape is not None:
        copies = ex.b * ex.n * ex.t * ex.s / math.prod(ex.bias_shape)
        slack["dbias"] = copies * (diff + float(dlse.max(initial=0.0)))
    return slack


def _effective_scale(ex) -> float:
    return 1 / math.sqrt(ex.h) if ex.scale is None else ex.scale


def _finite_abs(x):
    x = np.abs(_np(x))
    return np.where(np.isfinite(x), x, 0.0)


def _rounded_ds_slack(ex, arrays, ds) -> dict:
    """The kernels round dS (the logits' cotangent, a float32 tile) to the input dtype before
    the dS·K and dSᵀ·Q products, as FlashAttention does to feed the tensor cores: each term
    of dq[t] = scale·Σ_s dS[t, s]·k[s] is off by up to u·|dS[t, s]·k[s]| (u the unit roundoff
    of the input dtype), which FACTOR·err(reference at the input dtype) need not bound (that
    reference may keep dS wider). Each element of dq and dk may be off by that sum, taken
    from the float64 reference's dS (`ds`, [B, N, T, S]: the gradient of a full-size bias);
    float32 inputs round nothing."""
    if ds is None:
        return {}
    u = float(jnp.finfo(ex.dtype).eps) / 2
    scale = abs(_effective_scale(ex))
    g = ex.n // ex.kh
    ds = _finite_abs(ds)  # [B, N, T, S]
    q, k = _finite_abs(arrays["q"]), _finite_abs(arrays["k"])  # [B, T, N, H], [B, S, K, H]
    kk = np.repeat(k, g, axis=2)  # [B, S, N, H]
    dq = u * scale * np.einsum("bnts,bsnh->btnh", ds, kk)
    dk = u * scale * np.einsum("bnts,btnh->bsnh", ds, q)
    dk = dk.reshape(ex.b, ex.s, ex.kh, g, ex.h).sum(3)
    return {"dq": dq, "dk": dk}


def _compare(ex, name, got, r64, rlo, fallback, slack=0.0):
    """The non-finite pattern, then the tolerance on the finite elements (plus `slack`,
    see _one_hot_slack and _rounded_ds_slack)."""
    x, ref, lo = _np(got), _np(r64), _np(rlo)
    if x.shape != ref.shape:
        _fail(ex, f"{name} has shape {x.shape}, the reference {ref.shape}")
    # Finite where the float64 value rounded to the result's dtype is (a gradient past
    # float16's range is inf in float16); the errors are measured against the unrounded value.
    finite = np.isfinite(_np(jnp.asarray(r64).astype(got.dtype)))
    differs = np.isfinite(x) != finite
    if differs.any():
        i = _first(differs)
        _fail(
            ex,
            f"{name}: non-finite pattern differs from the reference at {int(differs.sum())} of "
            f"{x.size} elements, first {i}: got {x[i]}, reference {ref[i]}",
        )
    if not finite.any():
        return
    if not np.array_equal(np.isfinite(lo), finite):
        # The reference at the input dtype overflowed (logits beyond float16): measure the
        # precision's error with float32 logits instead, rounded to the input dtype like a kernel.
        lo = _np(fallback()[name])
    lo = np.where(np.isfinite(lo), lo, ref)
    eps = EPS["float32"] * 10 if name == "lse" else (EPS if name == "out" else GRAD_EPS)[ex.dtype]
    if name in ("dq", "dk", "dv", "dbias"):
        # The gradients' eps is absolute for gradients of magnitude <= 1 and relative above:
        # a scale of 30 makes dk ~ 15 out of the same rounding errors (seed 5, cpu-27: a
        # dk of 14.5 off by 52 float32 ulps, 1.05× over an absolute eps of 5e-5).
        eps *= max(1.0, float(np.max(np.abs(ref), initial=0.0, where=finite)))
    if name == "dbias":
        # One element of a broadcast bias's gradient sums that many logits' gradients, each
        # within eps: their errors add up like a random walk.
        eps *= math.sqrt(ex.b * ex.n * ex.t * ex.s / math.prod(ex.bias_shape))
    if name == "lse":
        # An lse is a logit (plus log l <= log S): a dot product of H terms, times the scale,
        # rounded to the lse's dtype. Its rounding error is relative, ~sqrt(H) ulps of |lse|
        # for a sum in another order (tiles, mma fragments), and FACTOR·err(reference at the
        # input dtype) does not bound it where that reference's sum happens to land closer
        # (extreme scales: |lse| ~ 1e12 in float32 has ulps of 1e5). So each element may be
        # off by LSE_ULPS_PER_SQRT_H·sqrt(H) ulps of its |lse|, where that exceeds eps: below
        # |lse| ~ 50 (every ordinary logit) eps is the larger and the rule is unchanged.
        ulp = float(np.finfo(np.dtype(got.dtype)).eps) / 2
        eps = np.maximum(eps, LSE_ULPS_PER_SQRT_H * math.sqrt(ex.h) * ulp * np.abs(np.where(finite, ref, 0)))
    tol = FACTOR * float(np.max(np.abs(lo[finite] - ref[finite]))) + eps + slack
    err = np.where(finite, np.abs(np.where(finite, x, 0) - np.where(finite, ref, 0)), 0)
    over = err - tol
    if over.max() > 0:
        i = _first(over == over.max())
        _fail(
            ex,
            f"{name} error {err[i]:.3g} > tolerance {np.broadcast_to(tol, err.shape)[i]:.3g} at {i}: "
            f"got {x[i]}, reference {ref[i]}",
        )


def _exact_checks(ex, arrays, got, ref):
    lse64 = _np(ref["lse"])  # [B, T, N]
    vis = visibility(ex)  # [B, N, T, S]
    mask = dense_mask(ex, arrays)
    if mask is not None:
        vis = vis & mask
    struct_empty = ~vis.any(-1).transpose(0, 2, 1)  # [B, T, N]
    if not np.all(lse64[struct_empty] == -np.inf):
        _fail(ex, f"reference: a row that sees no key has lse {lse64[struct_empty][lse64[struct_empty] != -np.inf][0]}")
    empty = lse64 == -np.inf
    out, lse, dq = _np(got["out"]), _np(got["lse"]), _np(got["dq"])
    for name, x in (("out", out), ("dq", dq)):
        bad = empty[..., None] & (x != 0)
        if bad.any():
            i = _first(bad)
            _fail(ex, f"{name} of a row that sees no key is {x[i]} at {i}, not 0")
    if not np.all(lse[empty] == -np.inf):
        i = _first(empty & (lse != -np.inf))
        _fail(ex, f"lse of a row that sees no key is {lse[i]} at {i}, not -inf")
    g = ex.n // ex.kh
    seen = vis.reshape(ex.b, ex.kh, g, ex.t, ex.s).any(axis=(2, 3))  # [B, K, S]
    unseen = ~seen.transpose(0, 2, 1)  # [B, S, K]
    for name in ("dk", "dv"):
        for source, x in (("", _np(got[name])), ("reference: ", _np(ref[name]))):
            bad = unseen[..., None] & (x != 0)
            if bad.any():
                i = _first(bad)
                _fail(ex, f"{source}{name} of a key no query sees is {x[i]} at {i}, not 0")
    if ex.bias_shape == (ex.b, ex.n, ex.t, ex.s):
        db = _np(got["dbias"])
        bad = ~vis & (db != 0)
        if bad.any():
            i = _first(bad)
            _fail(ex, f"dbias of a masked logit is {db[i]} at {i}, not 0")


def _expect_value_error(ex, call, what):
    try:
        call()
    except ValueError as e:
        return str(e)
    except Exception as e:  # any other exception is the failure
        _fail(ex, f"{what} raised {type(e).__name__} instead of ValueError: {str(e).splitlines()[0][:300]}")
    _fail(ex, f"{what} did not raise")


def _check_zero_size(ex, arrays, args):
    """An empty B, T, S or N: the same outcome in this implementation as in xla, either an
    empty result (S = 0: rows that see no key, out 0, lse -inf, zero gradients) or a
    ValueError."""
    outcomes = []
    for name in (ex.impl, "xla"):
        try:
            res = _flatten(jax.jit(_step(jax_flash.attention, ex, arrays, implementation=name))(*args))
        except ValueError as e:
            outcomes.append(("ValueError", str(e).splitlines()[0][:200]))
            continue
        except Exception as e:  # any other exception is the failure
            _fail(ex, f"an empty axis on {name} raised {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        outcomes.append({key: None if x is None else (tuple(x.shape), str(x.dtype)) for key, x in res.items()})
        for key, x in res.items():
            want = -np.inf if key == "lse" else 0
            if x is not None and not np.all(_np(x) == want):
                _fail(ex, f"an empty axis on {name}: {key} is not all {want}")
    if type(outcomes[0]) is not type(outcomes[1]) or (isinstance(outcomes[0], dict) and outcomes[0] != outcomes[1]):
        _fail(ex, f"an empty axis: {ex.impl} gives {outcomes[0]}, xla {outcomes[1]}")


def check_example(ex) -> str:
    """Runs one example; returns 'ran', 'refused' (a ValueError with the reason, as
    claimed) or 'error' (an invalid argument, rejected as such). Raises Failure."""
    arrays = ex.arrays()
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    bias, mask = arrays.get("bias"), arrays.get("mask")
    kw = ex.kwargs()
    impl = ex.impl
    call = lambda: jax_flash.attention(q, k, v, bias, mask, implementation=impl, **kw)
    if ex.expect_error is not None:
        for what, fn in (
            ("explain", lambda: jax_flash.explain(q, k, v, bias, mask, implementation=impl, **kw)),
            ("attention", call),
        ):
            msg = _expect_value_error(ex, fn, f"{what} with an invalid {ex.expect_error}")
            if ex.expect_error not in msg:
                _fail(ex, f"{what}'s ValueError does not name {ex.expect_error}: {msg}")
        return "error"
    why = jax_flash.explain(q, k, v, bias, mask, implementation=impl, **kw).reasons[impl]
    if why is not None:
        msg = _expect_value_error(ex, call, f"a call {impl} refuses ({why})")
        if why not in msg or impl not in msg:
            _fail(ex, f"the refusal does not say why ({why!r}): {msg}")
        return "refused"

    step = _step(jax_flash.attention, ex, arrays, implementation=impl)
    args = _args(arrays)
    if 0 in (ex.b, ex.t, ex.s, ex.n):
        _check_zero_size(ex, arrays, args)
        return "ran"

    got = _flatten(jax.jit(step)(*args))

    rounds_ds = jnp.finfo(ex.dtype).eps > np.finfo(np.float32).eps

    def refs(*a):
        # The float64 reference gets float64 copies of the inputs (the same values), so that its
        # gradients are not rounded to the input dtype: the ground truth, unrounded.
        wide = [None if x is None else x.astype(jnp.float64) for x in a[:4]] + list(a[4:])
        f64 = _step(attention_reference, ex, arrays, compute_dtype=jnp.float64)
        r64 = f64(*wide)
        rlo = _step(attention_reference, ex, arrays)(*a)
        ds = None
        if rounds_ds:
            # dS: the gradient of a full-size bias (the given one broadcast, or zeros).
            full = jnp.zeros((ex.b, ex.n, ex.t, ex.s), jnp.float64)
            if wide[3] is not None:
                full = full + wide[3]
            ds = f64(*wide[:3], full, *wide[4:])[2][3]
        return r64, rlo, ds

    r64, rlo, ds = _compile(refs, *args)(*args)
    r64, rlo = _flatten(r64), _flatten(rlo)

    cache = {}

    def fallback():
        if not cache:
            f = _step(attention_reference, ex, arrays, compute_dtype=jnp.float32)
            res = _flatten(_compile(f, *args)(*args))
            for key, x in res.items():
                if x is not None:
                    cache[key] = x.astype(rlo[key].dtype)
        return cache

    # dtypes: out and gradients like their inputs, lse like the reference's.
    for name, want in (
        ("out", q.dtype),
        ("lse", rlo["lse"].dtype),
        ("dq", q.dtype),
        ("dk", k.dtype),
        ("dv", v.dtype),
        ("dbias", None if bias is None else bias.dtype),
    ):
        have = None if got[name] is None else got[name].dtype
        if have != want:
            _fail(ex, f"{name} has dtype {have}, expected {want}")
    slack = _one_hot_slack(ex, arrays)
    for name, extra in _rounded_ds_slack(ex, arrays, ds).items():
        slack[name] = slack.get(name, 0.0) + extra
    for name in ("out", "lse", "dq", "dk", "dv", "dbias"):
        if got[name] is not None:
            _compare(ex, name, got[name], r64[name], rlo[name], fallback, slack.get(name, 0.0))
    _exact_checks(ex, arrays, got, r64)
    return "ran"


def _log(line: str):
    """Long runs: JAX_FLASH_PROPERTY_LOG=<file> collects one line per failure as it happens."""
    path = os.environ.get("JAX_FLASH_PROPERTY_LOG")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def test_property(example_id, request):
    impl, _, index = example_id.rpartition("-")
    if impl not in IMPLS or not index.isdigit():
        raise pytest.UsageError(f"--property-example: expected <implementation>-<index>, got {example_id!r}")
    why = availability(impl)
    if why is not None:
        pytest.skip(f"{impl} unavailable here: {why}")
    seed = _seed(request.config)
    outcomes = []
    for attempt in range(MAX_ATTEMPTS):
        ex = draw(impl, int(index), seed, tiny=slow_impl(impl), gates=GATES, attempt=attempt)
        try:
            outcome = check_example(ex)
        except Failure as e:
            _log(str(e))
            raise
        except Exception as e:  # a crash of the call: the same one line first
            message = f"{_reproduce(ex)}  # raised {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''} | drawn: {ex.describe()}"
            _log(message)
            raise Failure(message) from e
        outcomes.append(outcome)
        if outcome == "ran":
            break
    request.node.user_properties.append(("property_outcomes", outcomes))


def test_generator_is_seeded():
    """The same (seed, implementation, index) draws the same call; others differ."""
    a = draw("cuda", 17, 0, tiny=True, gates=Gates())
    b = draw("cuda", 17, 0, tiny=True, gates=Gates())
    assert a == b and a.describe() == b.describe()
    assert np.array_equal(
        np.asarray(a.arrays()["q"], np.float32), np.asarray(b.arrays()["q"], np.float32), equal_nan=True
    )
    others = {draw("cuda", i, 0, tiny=True, gates=Gates()).describe() for i in range(20)}
    assert len(others) == 20


def test_failure_message_reproduces():
    """A failure is one line that names the command rerunning that very example."""
    ex = draw("xla", 3, 5, tiny=False, gates=GATES)
    with pytest.raises(Failure) as info:
        _fail(ex, "out error 1 > tolerance 0")
    text = str(info.value)
    assert "\n" not in text
    assert re.search(r"JAX_FLASH_PROPERTY_SEED=5 .*--property-example=xla-3\b", text)
