"""jax_flash.flax.attention_fn in flax linen/nnx modules and jax_flash.haiku.MultiHeadAttention
against the frameworks' own attention: same outputs, same gradients, same parameters."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
hk = pytest.importorskip("haiku")

import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jax_flash.flax  # noqa: E402
import jax_flash.haiku  # noqa: E402

B, T, D, HEADS = 2, 24, 16, 2
XLA_FN = functools.partial(jax_flash.flax.attention_fn, implementation="xla")
TOL = dict(rtol=2e-5, atol=2e-5)


def _x(seed=0, shape=(B, T, D)):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _padding_mask(x):
    """Float 0/1 [B, 1, T, T] hiding the last keys of the second sequence (every row sees
    at least one key)."""
    lengths = jnp.array([T, T - 7])
    valid = (jnp.arange(T)[None, :] < lengths[:, None]).astype(jnp.float32)  # [B, T]
    return nn.make_attention_mask(jnp.ones(x.shape[:2]), valid)


MASKS = {
    "none": lambda x: None,
    "causal": lambda x: nn.make_causal_mask(x[..., 0]),
    "padding": _padding_mask,
    "causal_and_padding": lambda x: nn.combine_masks(nn.make_causal_mask(x[..., 0]), _padding_mask(x)),
}


def _assert_trees_close(a, b, **tol):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, **tol), a, b)


# --------------------------------------------------------------------------- linen


@pytest.mark.parametrize("mask_kind", list(MASKS))
def test_linen_matches_flax_attention(mask_kind):
    x = _x()
    mask = MASKS[mask_kind](x)
    assert mask is None or mask.dtype == jnp.float32  # flax masks are float 0/1
    ours = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D, attention_fn=XLA_FN)
    theirs = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D)
    params = theirs.init(jax.random.key(1), x, x, mask=mask)
    assert jax.tree.structure(ours.init(jax.random.key(1), x, x, mask=mask)) == jax.tree.structure(
        params
    )

    def loss(module, params, x):
        y = module.apply(params, x, x, mask=mask)
        return jnp.sum(jnp.sin(y)), y

    (l1, y1), g1 = jax.value_and_grad(functools.partial(loss, ours), argnums=(0, 1), has_aux=True)(
        params, x
    )
    (l2, y2), g2 = jax.value_and_grad(
        functools.partial(loss, theirs), argnums=(0, 1), has_aux=True
    )(params, x)
    np.testing.assert_allclose(y1, y2, **TOL)
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    _assert_trees_close(g1, g2, rtol=1e-4, atol=1e-5)


def test_linen_causal_option_via_partial_and_jit():
    x = _x(2)
    causal_fn = functools.partial(XLA_FN, is_causal=True)
    ours = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D, attention_fn=causal_fn)
    theirs = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D)
    params = theirs.init(jax.random.key(0), x)
    y1 = jax.jit(lambda p, x: ours.apply(p, x))(params, x)
    y2 = theirs.apply(params, x, mask=nn.make_causal_mask(x[..., 0]))
    np.testing.assert_allclose(y1, y2, **TOL)


def test_linen_decoder_self_attention_default_implementation():
    """implementation=None (auto) in a small causal block under jit."""
    x = _x(3)
    ours = nn.SelfAttention(num_heads=HEADS, attention_fn=jax_flash.flax.attention_fn)
    theirs = nn.SelfAttention(num_heads=HEADS)
    mask = nn.make_causal_mask(x[..., 0])
    params = theirs.init(jax.random.key(0), x, mask=mask)
    y1 = jax.jit(lambda p, x: ours.apply(p, x, mask=mask))(params, x)
    y2 = theirs.apply(params, x, mask=mask)
    np.testing.assert_allclose(y1, y2, rtol=1e-4, atol=1e-4)


def test_linen_dropout():
    x = _x()
    mha = nn.MultiHeadDotProductAttention(
        num_heads=HEADS, qkv_features=D, dropout_rate=0.25, attention_fn=XLA_FN
    )
    params = mha.init(jax.random.key(0), x, deterministic=True)
    # Deterministic: dropout is off, exactly the module without dropout.
    y0 = mha.apply(params, x, deterministic=True)
    plain = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D, attention_fn=XLA_FN)
    np.testing.assert_array_equal(y0, plain.apply(params, x))
    # flax's default broadcast_dropout=True shares one mask over batch and heads: refused.
    with pytest.raises(ValueError, match="broadcast_dropout"):
        mha.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
    mha = nn.MultiHeadDotProductAttention(
        num_heads=HEADS, qkv_features=D, dropout_rate=0.25, broadcast_dropout=False,
        attention_fn=XLA_FN,
    )
    y1 = mha.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
    y1b = mha.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
    y2 = mha.apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(2)})
    np.testing.assert_array_equal(y1, y1b)  # the module's dropout rng decides the mask
    assert np.all(np.isfinite(y1)) and not np.allclose(y1, y0) and not np.allclose(y1, y2)


def test_linen_sow_weights_raises():
    x = _x()
    mha = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D, attention_fn=XLA_FN)
    params = mha.init(jax.random.key(0), x)
    with pytest.raises(NotImplementedError, match="sow"):
        mha.apply(params, x, sow_weights=True, mutable=["intermediates"])


def test_attention_fn_bool_mask_and_extra_batch_axes():
    q, k, v = (_x(i, (2, 3, T, HEADS, 8)) for i in range(3))
    mask = jnp.tril(jnp.ones((T, T), bool))[None, None, None]
    ours = XLA_FN(q, k, v, mask=mask)
    theirs = nn.dot_product_attention(q, k, v, mask=mask)
    np.testing.assert_allclose(ours, theirs, **TOL)
    # A float mask gives the same as a bool one.
    np.testing.assert_allclose(XLA_FN(q, k, v, mask=mask.astype(jnp.float32)), ours, atol=0)


def test_attention_fn_dtype_promotion():
    q = _x(0, (B, T, HEADS, 8))
    out = XLA_FN(q, q, q, dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16


# --------------------------------------------------------------------------- nnx


def _nnx_pair(attention_fn, **kw):
    ours = nnx.MultiHeadAttention(
        HEADS, D, qkv_features=D, decode=False, attention_fn=attention_fn, rngs=nnx.Rngs(0), **kw
    )
    theirs = nnx.MultiHeadAttention(HEADS, D, qkv_features=D, decode=False, rngs=nnx.Rngs(0), **kw)
    return ours, theirs


def _nnx_value_and_grad(model, x, **call_kw):
    graphdef, state = nnx.split(model)

    def loss(state, x):
        y = nnx.merge(graphdef, state)(x, **call_kw)
        return jnp.sum(jnp.sin(y)), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(state, x)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "causal_and_padding"])
def test_nnx_matches_flax_attention(mask_kind):
    x = _x(4)
    mask = MASKS[mask_kind](x)
    ours, theirs = _nnx_pair(XLA_FN)
    (l1, y1), g1 = _nnx_value_and_grad(ours, x, mask=mask)
    (l2, y2), g2 = _nnx_value_and_grad(theirs, x, mask=mask)
    np.testing.assert_allclose(y1, y2, **TOL)
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    _assert_trees_close(g1, g2, rtol=1e-4, atol=1e-5)


def test_nnx_is_causal_call_argument():
    x = _x(5)
    ours, theirs = _nnx_pair(XLA_FN)
    y1 = ours(x, is_causal=True)
    y2 = theirs(x, mask=nn.make_causal_mask(x[..., 0]))
    np.testing.assert_allclose(y1, y2, **TOL)


def test_nnx_make_attention_fn_stays_causal():
    """nnx passes is_causal=False explicitly; a causal make_attention_fn still masks."""
    x = _x(6)
    ours, theirs = _nnx_pair(jax_flash.flax.make_attention_fn(implementation="xla", is_causal=True))
    np.testing.assert_allclose(ours(x), theirs(x, mask=nn.make_causal_mask(x[..., 0])), **TOL)


def test_nnx_dropout():
    x = _x()
    ours, _ = _nnx_pair(XLA_FN, dropout_rate=0.2)
    y0 = ours(x, deterministic=True)
    with pytest.raises(ValueError, match="broadcast_dropout"):
        ours(x, deterministic=False)
    ours, _ = _nnx_pair(XLA_FN, dropout_rate=0.2, broadcast_dropout=False)
    y1 = ours(x, deterministic=False)
    y2 = ours(x, deterministic=False)  # the module's rng stream advances: another mask
    assert np.all(np.isfinite(y1)) and not np.allclose(y1, y0) and not np.allclose(y1, y2)


# --------------------------------------------------------------------------- haiku


def _haiku_fns(value_size=None, mask=None, **extra):
    init_kw = dict(num_heads=HEADS, key_size=8, w_init=hk.initializers.VarianceScaling(1.0))
    if value_size is not None:
        init_kw["value_size"] = value_size

    def ours(x):
        return jax_flash.haiku.MultiHeadAttention(**init_kw, **extra)(x, x, x, mask=mask)

    def theirs(x):
        return hk.MultiHeadAttention(**init_kw)(x, x, x, mask=mask)

    return hk.transform(ours), hk.transform(theirs)


@pytest.mark.parametrize("value_size", [None, 4, 12])
@pytest.mark.parametrize("masked", [False, True])
def test_haiku_matches_haiku_attention(value_size, masked):
    x = _x(7)
    mask = jnp.tril(jnp.ones((T, T), bool))[None, None] if masked else None  # [B|1, H|1, T, T]
    ours, theirs = _haiku_fns(value_size, mask, implementation="xla")
    params = theirs.init(jax.random.key(0), x)
    ours_params = ours.init(jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, ours_params) == jax.tree.map(jnp.shape, params)
    assert "multi_head_attention/query" in params

    def loss(fn, params, x):
        return jnp.sum(jnp.sin(fn.apply(params, None, x)))

    y1 = jax.jit(ours.apply)(params, None, x)
    y2 = theirs.apply(params, None, x)
    np.testing.assert_allclose(y1, y2, **TOL)
    g1 = jax.grad(functools.partial(loss, ours), argnums=(0, 1))(params, x)
    g2 = jax.grad(functools.partial(loss, theirs), argnums=(0, 1))(params, x)
    _assert_trees_close(g1, g2, rtol=1e-4, atol=1e-5)


def test_haiku_is_causal_option():
    x = _x(8)
    causal = jnp.tril(jnp.ones((T, T), bool))[None, None]
    ours, _ = _haiku_fns(implementation="xla", is_causal=True)
    _, theirs = _haiku_fns(mask=causal)
    params = theirs.init(jax.random.key(0), x)
    np.testing.assert_allclose(ours.apply(params, None, x), theirs.apply(params, None, x), **TOL)


def test_haiku_mask_rank_checked():
    x = _x(9)
    ours, _ = _haiku_fns(mask=jnp.ones((T, T), bool), implementation="xla")
    with pytest.raises(ValueError, match="mask"):
        ours.init(jax.random.key(0), x)


def test_import_jax_flash_needs_neither_flax_nor_haiku():
    import subprocess
    import sys

    code = (
        "import sys, jax_flash, jax_flash.flax; "
        "assert 'flax' not in sys.modules and 'haiku' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_haiku_with_sinks():
    """with_sinks adds a parameter "sinks" [num_heads] that reaches jax_flash.attention and
    gets a gradient; zeros by default (not haiku's result: each row gains e^0 in its sum)."""
    x = _x(10)
    ours, theirs = _haiku_fns(implementation="xla", with_sinks=True,
                              sinks_init=hk.initializers.Constant(1.5))
    params = ours.init(jax.random.key(0), x)
    assert params["multi_head_attention"]["sinks"].shape == (HEADS,)
    plain = theirs.init(jax.random.key(0), x)
    # -inf sinks are no sinks: haiku's own result.
    no_sink = jax.tree.map(lambda a: a, params)
    no_sink["multi_head_attention"]["sinks"] = jnp.full((HEADS,), -jnp.inf)
    np.testing.assert_allclose(jax.jit(ours.apply)(no_sink, None, x), jax.jit(theirs.apply)(plain, None, x), **TOL)
    g = jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(ours.apply(p, None, x)))))(params)
    assert np.all(np.asarray(g["multi_head_attention"]["sinks"]) != 0)


def test_flax_attention_fn_sinks():
    q = _x(11).reshape(2, -1, HEADS, 8)[:, :8]
    sinks = jnp.linspace(-1.0, 2.0, HEADS, dtype=jnp.float32)
    got = jax.jit(lambda q, s: jax_flash.flax.attention_fn(q, q, q, sinks=s, implementation="xla"))(q, sinks)
    want = jax.jit(lambda q, s: jax_flash.reference(q, q, q, sinks=s))(q, sinks)
    np.testing.assert_allclose(got, want, **TOL)
