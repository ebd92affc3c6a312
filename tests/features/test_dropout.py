"""Attention dropout (docs/attention.md, "Dropout"): one Philox-4x32-10 keep-mask in every
implementation, bit for bit; statistics, gradients against the float64 reference drawing
the same mask, rate 0 identical to no dropout, argument errors, flax training."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _dropout
from jax_flash._normalize import canonicalize
from jax_flash.reference import attention_reference, dropout_keep

KEY = jax.random.key(7)


def _impls():
    out = []
    for name in ("xla", "cpu", "pallas", "cuda"):
        c = canonicalize(
            jnp.zeros((1, 8, 2, 32), jnp.float16),
            jnp.zeros((1, 8, 2, 32), jnp.float16),
            jnp.zeros((1, 8, 2, 32), jnp.float16),
            dropout_rate=0.5,
            dropout_rng=KEY,
        )
        from jax_flash import _registry

        why = _registry.reason(name, c.spec)
        out.append(pytest.param(name, marks=pytest.mark.skipif(why is not None, reason=str(why))))
    return out


def _inputs(b, t, s, n, k, h, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(dtype)
    kk = jax.random.normal(ks[1], (b, s, k, h), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, s, k, h), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (b, t, n, h), jnp.float32).astype(dtype)
    return q, kk, v, do


# ------------------------------------------------------------------------- the generator


def test_philox_known_answers():
    """Random123's philox4x32_10 known-answer vectors."""
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for counter, key, want in cases:
        got = _dropout.philox4x32([np.uint32(c) for c in counter], [np.uint32(x) for x in key])
        assert tuple(int(w) for w in got) == want


def test_grouped_and_elementwise_bits_agree():
    seed = _dropout.seed_from_key(KEY)
    b, n, t = np.meshgrid(np.arange(2), np.arange(3), np.arange(5), indexing="ij")
    grouped = jax.jit(lambda s: _dropout.keep_mask_groups(s, 0.4, b, n, t, 8, 12))(seed)
    cols = 8 + np.arange(12)
    single = jax.jit(lambda s: _dropout.keep_mask(s, 0.4, b[..., None], n[..., None], t[..., None], cols))(seed)
    np.testing.assert_array_equal(grouped, single)


def test_keep_fraction_within_binomial_bound():
    rate = 0.3
    spec = canonicalize(
        jnp.zeros((2, 64, 4, 8)), jnp.zeros((2, 96, 4, 8)), jnp.zeros((2, 96, 4, 8)), dropout_rate=rate, dropout_rng=KEY
    ).spec
    keep = np.asarray(jax.jit(lambda s: dropout_keep(spec, s))(_dropout.seed_from_key(KEY)))
    m = keep.size
    p = 1 - _dropout.threshold(rate) / 2**32
    # 5 standard deviations of Binomial(m, p): fails by chance with probability ~6e-7.
    assert abs(keep.sum() - m * p) < 5 * np.sqrt(m * p * (1 - p)), keep.mean()
    # Not one mask repeated: rows, heads and batch rows differ.
    assert (keep[0, 0, 0] != keep[0, 0, 1]).any() and (keep[0, 0] != keep[0, 1]).any()
    assert (keep[0] != keep[1]).any()


def test_key_forms_and_threshold():
    """A typed key and the legacy uint32[2] key with the same bits give the same seed."""
    typed = jax.random.key(11)
    legacy = jax.random.key_data(typed)
    np.testing.assert_array_equal(_dropout.seed_from_key(typed), _dropout.seed_from_key(legacy))
    assert _dropout.threshold(0.5) == 2**31
    assert _dropout.threshold(0.0) == 0


# -------------------------------------------------------------- agreement across implementations


def _mask_through_outputs(impl, spec_args, rate, dt=None):
    """The keep-mask [B, N, T, S] recovered from outputs: v = one-hot columns (value row s is
    e_s) and a zero query (P uniform 1/S), so out[b, t, n, s] = keep · 1 / (S (1 - rate))."""
    b, t, s, n, h = spec_args
    q = jnp.zeros((b, t, n, h), jnp.float32)
    k = jnp.zeros((b, s, n, h), jnp.float32)
    v = jnp.broadcast_to(jnp.eye(s, h, dtype=jnp.float32)[None, :, None, :], (b, s, n, h))
    dt = dt or (jnp.float16 if impl == "cuda" else jnp.float32)
    out = jax.jit(
        lambda q, k, v: jax_flash.attention(q, k, v, dropout_rate=rate, dropout_rng=KEY, implementation=impl)
    )(q.astype(dt), k.astype(dt), v.astype(dt))
    out = np.asarray(out, np.float32)[..., :s]  # [B, T, N, S]
    return np.transpose(out > 0.5 / (s * (1 - rate)), (0, 2, 1, 3))


@pytest.mark.parametrize("impl", _impls())
def test_same_mask_in_every_implementation(impl):
    shape = (2, 19, 13, 3, 32)  # ragged T and S: tiles and column groups do not line up
    rate = 0.5
    b, t, s, n, h = shape
    spec = canonicalize(
        jnp.zeros((b, t, n, h)), jnp.zeros((b, s, n, h)), jnp.zeros((b, s, n, h)), dropout_rate=rate, dropout_rng=KEY
    ).spec
    want = np.asarray(jax.jit(lambda s: dropout_keep(spec, s))(_dropout.seed_from_key(KEY)))
    got = _mask_through_outputs(impl, shape, rate)
    np.testing.assert_array_equal(got, want)
    if impl == "cpu":  # the bf16 products' path
        np.testing.assert_array_equal(_mask_through_outputs(impl, shape, rate, jnp.bfloat16), want)


@pytest.mark.parametrize("impl", _impls())
def test_gradients_match_reference_with_the_same_mask(impl, monkeypatch):
    _check_gradients(impl)


@pytest.mark.parametrize("impl", [p for p in _impls() if p.values[0] == "cuda"])
def test_cuda_deterministic_warp32_gradients_with_the_same_mask(impl, monkeypatch):
    """The other kernels: the deterministic dQ kernel and the 32-row-per-warp layout."""
    monkeypatch.setenv("JAX_FLASH_DETERMINISTIC", "1")
    monkeypatch.setenv("JAX_FLASH_CUDA_LAYOUT", "warp32")
    _check_gradients(impl)


def _check_gradients(impl):
    dtype = jnp.float16 if impl == "cuda" else jnp.float32
    q, k, v, do = _inputs(2, 13, 19, 2, 1, 16 if impl != "cuda" else 32, dtype, seed=1)
    kw = dict(is_causal=True, dropout_rate=0.25, dropout_rng=KEY, return_residual=True)

    def ours(q, k, v):
        return jax_flash.attention(q, k, v, implementation=impl, **kw)

    def ref(q, k, v):
        return attention_reference(q, k, v, compute_dtype=jnp.float64, **kw)

    f64 = lambda x: x.astype(jnp.float64)

    @jax.jit
    def both(q, k, v, do):
        (o, lse), vjp = jax.vjp(ours, q, k, v)
        (o_r, lse_r), vjp_r = jax.vjp(ref, f64(q), f64(k), f64(v))
        dlse = 0.3 * jnp.ones_like(lse)
        return o, lse, vjp((do, dlse)), o_r, lse_r, vjp_r((f64(do), f64(dlse)))

    o, lse, grads, o_r, lse_r, grads_r = both(q, k, v, do)
    tol = 2e-2 if dtype == jnp.float16 else 2e-5
    np.testing.assert_allclose(np.asarray(o, np.float64), o_r, atol=tol, rtol=tol)
    np.testing.assert_allclose(lse, lse_r, atol=1e-5, rtol=1e-5)  # lse: before dropout
    for g, g_r in zip(grads, grads_r):
        np.testing.assert_allclose(np.asarray(g, np.float64), g_r, atol=5 * tol, rtol=5 * tol)


def test_rate_zero_is_no_dropout():
    """Rate 0 with a key is the very call without dropout in every implementation: the same
    static spec and mask inputs (no seed) reach them; and in values and gradients (xla)."""
    q, k, v, do = _inputs(1, 11, 13, 2, 1, 32, jnp.float32, seed=2)
    plain = canonicalize(q, k, v, is_causal=True)
    zero = canonicalize(q, k, v, is_causal=True, dropout_rate=0.0, dropout_rng=KEY)
    assert zero.spec == plain.spec and zero.masks.dropout_seed is None

    def loss(q, k, v, **kw):
        return jnp.sum(jax_flash.attention(q, k, v, is_causal=True, implementation="xla", **kw) * do)

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
    with_key = jax.jit(lambda q, k, v: grad(q, k, v, dropout_rate=0.0, dropout_rng=KEY))(q, k, v)
    jax.tree.map(np.testing.assert_array_equal, jax.jit(grad)(q, k, v), with_key)


# ---------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(dropout_rate=0.1), ValueError, "dropout_rng"),
        (dict(dropout_rate=1.0, dropout_rng=KEY), ValueError, r"dropout_rate must be in \[0, 1\)"),
        (dict(dropout_rate=-0.1, dropout_rng=KEY), ValueError, "dropout_rate"),
        (dict(dropout_rate=float("nan"), dropout_rng=KEY), ValueError, "dropout_rate"),
        (dict(dropout_rate=0.99999999, dropout_rng=KEY), ValueError, "dropout_rate"),  # 1.0 in float32
        (dict(dropout_rate=True, dropout_rng=KEY), TypeError, "dropout_rate"),
        (dict(dropout_rate=0.1, dropout_rng=3), TypeError, "dropout_rng"),
        (dict(dropout_rate=0.1, dropout_rng=jnp.zeros((2,), jnp.float32)), TypeError, "dropout_rng"),
    ],
)
def test_bad_dropout_arguments(kwargs, error, match):
    x = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(error, match=match):
        jax_flash.attention(x, x, x, implementation="xla", **kwargs)
    with pytest.raises(error, match=match):
        jax_flash.explain(x, x, x, **kwargs)


def test_explain_serves_dropout():
    x = jnp.zeros((1, 8, 2, 32), jnp.float16)
    e = jax_flash.explain(x, x, x, dropout_rate=0.1, dropout_rng=KEY)
    assert e.reasons["xla"] is None and e.reasons["cpu"] is None
    assert not any("dropout" in (why or "") for why in e.reasons.values()), e.reasons


def test_vmap():
    """One key over mapped inputs runs everywhere; one key per mapped element only in xla."""
    x = jax.random.normal(jax.random.key(3), (3, 1, 8, 2, 16), jnp.float32)
    keys = jax.random.split(KEY, 3)
    f = lambda impl: lambda x, key: jax_flash.attention(x, x, x, dropout_rate=0.5, dropout_rng=key, implementation=impl)
    per_key = jax.vmap(f("xla"))(x, keys)
    np.testing.assert_array_equal(per_key[1], f("xla")(x[1], keys[1]))
    jax.vmap(f("cpu"), in_axes=(0, None))(x, KEY)
    with pytest.raises(ValueError, match=r"dropout_rng cannot be mapped by jax\.vmap"):
        jax.vmap(f("cpu"))(x, keys)


# -------------------------------------------------------------------------------- flax


def test_flax_model_trains_with_dropout():
    nn = pytest.importorskip("flax.linen")
    import functools

    import jax_flash.flax

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            x = nn.MultiHeadDotProductAttention(
                num_heads=2,
                qkv_features=16,
                dropout_rate=0.2,
                broadcast_dropout=False,
                deterministic=not train,
                attention_fn=functools.partial(jax_flash.flax.attention_fn, implementation="xla"),
            )(x)
            return nn.Dense(1)(x)

    x = jax.random.normal(jax.random.key(0), (4, 12, 8))
    y = jnp.sum(x, axis=-1, keepdims=True)
    model = Model()
    params = model.init(jax.random.key(1), x, False)

    @jax.jit
    def step(params, rng):
        def loss(p):
            return jnp.mean((model.apply(p, x, True, rngs={"dropout": rng}) - y) ** 2)

        value, g = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda a, b: a - 0.05 * b, params, g), value

    eval_loss = lambda p: float(jnp.mean((model.apply(p, x, False) - y) ** 2))
    before = eval_loss(params)
    rng = jax.random.key(2)
    for _ in range(20):
        rng, sub = jax.random.split(rng)
        params, value = step(params, sub)
        assert np.isfinite(value)
    assert eval_loss(params) < 0.7 * before


# ----------------------------------------------------------------------------- sharding

_SHARDED = r"""
import warnings
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jax_flash
from jax_flash.parallel import partitioning

mesh = Mesh(np.array(jax.devices()), ("b",))
ks = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(x, (4, 16, 2, 16), jnp.float32) for x in ks)
key = jax.random.key(5)
for impl in ("xla", "cpu"):
    f = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, dropout_rate=0.5, dropout_rng=key,
                                                    implementation=impl))
    want = f(q, k, v)
    shard = lambda x: jax.device_put(x, NamedSharding(mesh, P("b")))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = f(shard(q), shard(k), shard(v))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    fell_back = [x for x in w if issubclass(x.category, partitioning.ShardingFallbackWarning)]
    assert (impl == "cpu") == bool(fell_back), (impl, [str(x.message) for x in w])
    if fell_back:
        assert "dropout" in str(fell_back[0].message)
print("ok")
"""


def test_sharded_call_draws_the_unsharded_mask():
    """Batch-sharded under jit, 2 host devices: xla partitions with global positions, the
    compiled cpu call gathers (warned); both give the unsharded call's result exactly."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    r = subprocess.run(
        [sys.executable, "-c", _SHARDED],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
