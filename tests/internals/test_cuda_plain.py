"""The cuda forward's plain kernel (cuda/kernels/fwd.h, attention_forward_plain_kernel).

A call without optional features whose raw scores are finite (jax_flash/cuda.py tests that on
every call) runs the plain kernel: masked tiles peeled off an interior loop that masks nothing,
tests nothing and poisons nothing, its softmax in base 2 on the raw scores. It computes what the
general kernel computes, tile by tile in the same order, within the rounding of one multiply;
these tests hold it to that, count which kernel ran and which tiles it masked (the host
emulation's tile counter), and check the routing: a poison, an overflowing score, a scale the
raw-score softmax cannot take or an optional feature sends the call to the general kernel.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from cases import Shape, cuda_forward_target, emulator_or_skip, make_qkv
from jax_flash import cuda

pytestmark = pytest.mark.skipif(
    not jax_flash.current_config().emulate_cuda, reason="counts tiles on the host emulation of the cuda kernels"
)

BLOCK_Q = 128  # the forward's query rows per CTA (kernels/tile.h)


def _forward(q, k, v, *, plain_kernel, **settings):
    """The emulated forward target called directly, with the plain_kernel attribute given:
    (out, lse, the tiles counted)."""
    with cuda.count_tiles() as counts:
        out, lse = jax.block_until_ready(
            cuda_forward_target("jax_flash_emu_fwd", q, k, v, plain_kernel=plain_kernel, **settings)
        )
    return np.asarray(out), np.asarray(lse), counts


def _plain_block_kv(h: int) -> int:
    """The plain kernel's key tile (kernels/tile.h PlainForwardShape)."""
    return 32 if h > 128 else 64


def _block_kv(h: int, layout: str) -> int:
    """The general kernel's key tile (kernels/tile.h TileShapeFor)."""
    if layout == "warp32" and h <= 96:
        return 64 if h <= 32 else 32
    return 16 if h > 192 else 32 if h > 128 else 64


def _tiles(t, s, block_kv, *, band=(None, None)):
    """(tiles, masked tiles) the plain kernel runs over a [t, s] problem, from the dense
    visibility matrix: the key tiles each 128-row query block sees (from the first to the last
    tile holding a visible key of its rows), and of them those where some existing row of the
    block does not see every key."""
    rows, cols = np.arange(t)[:, None], np.arange(s)[None, :]
    visible = np.ones((t, s), bool)
    if band[0] is not None:
        visible &= cols - rows >= band[0]
    if band[1] is not None:
        visible &= cols - rows <= band[1]
    tiles = masked = 0
    for t0 in range(0, t, BLOCK_Q):
        block = visible[t0 : t0 + BLOCK_Q]
        seen = np.flatnonzero(block.any(axis=0))
        if seen.size == 0:
            continue
        for j in range(seen[0] // block_kv, seen[-1] // block_kv + 1):
            tiles += 1
            tile = block[:, j * block_kv : (j + 1) * block_kv]
            masked += int(not tile.all() or tile.shape[1] < block_kv)
    return tiles, masked


CASES = {
    # name: (shape, settings for _forward, the band (lo, hi) of visible s - t; None: lengths)
    "plain": (Shape(1, 129, 200, 2, 1, 64), {}, (None, None)),
    "causal": (Shape(1, 257, 257, 2, 2, 64), dict(window=(-1, 0)), (None, 0)),
    "causal_offset": (Shape(1, 130, 300, 2, 1, 128), dict(window=(-1, 0), q_offset=[170]), (None, 170)),
    "window": (Shape(1, 200, 320, 1, 1, 32), dict(window=(70, 3)), (-70, 3)),
    "lengths": (Shape(2, 140, 191, 2, 1, 64), dict(q_lengths=[140, 100], kv_lengths=[191, 65]), None),
    "sinks": (Shape(1, 64, 100, 2, 1, 96), dict(sinks=[0.5, -jnp.inf]), (None, None)),
    "h256": (Shape(1, 40, 35, 1, 1, 256), dict(window=(-1, 0)), (None, 0)),
    "h192_hv128": (Shape(1, 37, 70, 2, 1, 192, hv=128), {}, (None, None)),
    "h128_hv64": (Shape(1, 70, 150, 2, 1, 128, hv=64), dict(window=(-1, 0)), (None, 0)),
}


# The dtype's machine epsilon: the two kernels' P differ in the last float32 bits, which may round
# one element of P (and so of out) the other way.
_EPS = {jnp.bfloat16: 2.0**-7, jnp.float16: 2.0**-10}


@pytest.mark.parametrize("name", sorted(CASES))
def test_plain_kernel_agrees_with_general(name):
    """plain_kernel=True runs the plain kernel (every forward tile counted as plain), False the
    general one (none). The plain kernel takes the softmax on raw scores, exp2((s − m)·scale·log2 e),
    the general one on logits, exp2((scale·s − m)·log2 e): at a scale that is not a power of two
    the two P differ in their last float32 bits, so out agrees within the dtype's epsilon and lse
    within 8 float32 ulps (measured: 1 bfloat16 ulp of out, 4 float32 ulps of lse), rows never
    stored (past q_lengths) the same poison. At H = 256 (32-key tiles against 16) the
    summation order differs too: within bfloat16 rounding of the sums. The plain kernel has one
    shape whatever the layout attribute (the same bits under both), and masks exactly the tiles
    where some row of the query block does not see every key."""
    emulator_or_skip()
    shape, settings, band = CASES[name]
    dtype = jnp.bfloat16 if shape.h != 96 else jnp.float16
    q, k, v = make_qkv(shape, dtype, seed=3)
    settings = dict(settings, scale=0.3)
    out_g, lse_g, general = _forward(q, k, v, plain_kernel=False, **settings)
    out_p, lse_p, plain = _forward(q, k, v, plain_kernel=True, **settings)
    out_w, lse_w, _ = _forward(q, k, v, plain_kernel=True, layout="warp32", **settings)
    assert general.forward > 0 and general.forward_plain == 0
    assert plain.forward_plain == plain.forward > 0
    np.testing.assert_array_equal(out_w.view(np.uint16), out_p.view(np.uint16))
    np.testing.assert_array_equal(lse_w.view(np.uint32), lse_p.view(np.uint32))
    out_p, out_g = out_p.astype(np.float32), out_g.astype(np.float32)
    if _block_kv(shape.h, "warp16") == _plain_block_kv(shape.h):
        assert plain.forward == general.forward
        eps = _EPS[dtype]
        np.testing.assert_allclose(out_p, out_g, rtol=eps, atol=eps)
        np.testing.assert_allclose(lse_p, lse_g, rtol=2.0**-20, atol=2.0**-20)
    else:
        np.testing.assert_allclose(out_p, out_g, rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(lse_p, lse_g, rtol=1e-5, atol=1e-5)
    if band is not None:
        want = _tiles(shape.t, shape.s, _plain_block_kv(shape.h), band=band)
        heads = shape.b * shape.n
        assert (plain.forward_plain // heads, plain.forward_plain_masked // heads) == want


def test_plain_kernel_interior_runs_unmasked():
    """A causal call over many key tiles masks only the diagonal ones: of 4 query blocks x up to
    8 key tiles, the interior loop runs every tile left of each block's diagonal unmasked."""
    emulator_or_skip()
    shape = Shape(1, 512, 512, 1, 1, 32)
    q, k, v = make_qkv(shape, jnp.bfloat16, seed=4)
    _, _, counts = _forward(q, k, v, plain_kernel=True, window=(-1, 0))
    tiles, masked = _tiles(512, 512, 64, band=(None, 0))
    assert (counts.forward_plain, counts.forward_plain_masked) == (tiles, masked)
    assert masked == 8 and tiles == 20  # 2 diagonal tiles per 128-row block


def _run(q, k, v, **kwargs):
    with cuda.count_tiles() as counts:
        out = jax.block_until_ready(jax_flash.attention(q, k, v, implementation="cuda", **kwargs))
    return np.asarray(out.astype(jnp.float32)), counts


def test_calls_route_to_the_plain_kernel_only_when_they_may():
    """Through jax_flash.attention: finite inputs without optional features run the plain
    kernel; a NaN or inf in q or k, a finite score that would overflow, a soft cap, segment
    ids or a scale outside [2**-126, 2**127) run the general kernel, which keeps the numerical
    contract (a poisoned row is NaN); either kernel matches the reference."""
    emulator_or_skip()
    shape = Shape(1, 70, 90, 2, 1, 64)
    q, k, v = make_qkv(shape, jnp.bfloat16, seed=5)
    out, counts = _run(q, k, v, is_causal=True)
    assert counts.forward_plain == counts.forward > 0
    for name, (qq, kk) in {
        "nan_q": (q.at[0, 5, 1, 3].set(jnp.nan), k),
        "inf_k": (q, k.at[0, 7, 0, 0].set(-jnp.inf)),
        "overflow": (q.at[0, 9, 0, :].set(3e19), k.at[0, 2, 0, :].set(-3e19)),
    }.items():
        out, counts = _run(qq, kk, v, is_causal=True)
        assert counts.forward > 0 and counts.forward_plain == 0, name
        assert np.isnan(out).any(), name  # the contract: the poisoned / overflowing row is NaN
    _, counts = _run(q, k, v, logits_soft_cap=30.0)
    assert counts.forward > 0 and counts.forward_plain == 0
    # The raw-score softmax takes the scale inside the exponent: a positive normal one only.
    # (At 2**127 the logits leave float32's range: outside the contract, routed only.)
    for scale in (-0.3, 0.0, -0.0, 1e-39, 2.0**127, 2.0**-126, 0.7, 1e30):
        out, counts = _run(q, k, v, is_causal=True, scale=scale)
        if 2.0**-126 <= scale < 2.0**127:
            assert counts.forward_plain == counts.forward > 0, scale
        else:
            assert counts.forward > 0 and counts.forward_plain == 0, scale
        if scale < 2.0**127:
            ref = jax_flash.reference(q, k, v, is_causal=True, scale=scale, compute_dtype=jnp.float32)
            np.testing.assert_allclose(out, np.asarray(ref), atol=1e-2, rtol=1e-2, err_msg=str(scale))
    ids = jnp.zeros((1, 70), jnp.int32), jnp.zeros((1, 90), jnp.int32)
    _, counts = _run(q, k, v, segment_ids=ids)
    assert counts.forward > 0 and counts.forward_plain == 0


@pytest.mark.parametrize(
    "q_value, k_value, finite",
    [
        (1.0, 1.0, True),
        (jnp.nan, 1.0, False),
        (1.0, jnp.inf, False),
        (-jnp.inf, 1.0, False),
        (2.0**40, 2.0**40, True),  # 64 · 2**80: far below float32's range
        (2.0**60, 2.0**60, False),  # 64 · 2**120 >= 2**126: a score could overflow
    ],
)
def test_scores_are_finite(q_value, k_value, finite):
    """The per-call test behind plain_kernel: q and k finite and H·max|q|·max|k| < 2**126,
    under jit too."""
    q = jnp.ones((1, 4, 2, 64), jnp.bfloat16).at[0, 1, 1, 5].set(q_value)
    k = jnp.ones((1, 6, 1, 64), jnp.bfloat16).at[0, 3, 0, 7].set(k_value)
    assert bool(cuda.scores_are_finite(q, k)) is finite
    assert bool(jax.jit(cuda.scores_are_finite)(q, k)) is finite


def test_plain_forward_rule_matches_the_kernels():
    """cuda.plain_forward_blocker (the Python side's rule, which decides whether the per-call test
    runs, and what explain says) and the kernels' AttentionParams::plain_forward agree: each
    optional feature alone sends a call whose scores are finite to the general kernel."""
    emulator_or_skip()
    shape = Shape(1, 40, 50, 2, 2, 32)
    q, k, v = make_qkv(shape, jnp.bfloat16, seed=6)
    features = {
        "soft_cap": dict(logits_soft_cap=10.0),
        "bias": dict(bias=jnp.zeros((1, 2, 40, 50), jnp.float32)),
        "mask": dict(mask=jnp.ones((1, 2, 40, 50), jnp.bool_)),
        "segments": dict(segment_ids=(jnp.zeros((1, 40), jnp.int32), jnp.zeros((1, 50), jnp.int32))),
    }
    for name, kwargs in itertools.chain([("none", {})], features.items()):
        _, counts = _run(q, k, v, **kwargs)
        assert counts.forward > 0, name
        assert (counts.forward_plain > 0) == (name == "none"), name
        text = str(jax_flash.explain(q, k, v, implementation="cuda", verbose=True, **kwargs))
        want = "forward: the plain kernel" if name == "none" else "forward: the general kernel (the call has"
        assert want in text, (name, text)


def test_routed_call_runs_one_kernel():
    """A routed call (the route operand, cuda/kernels/params.h) launches the general kernel and,
    with plain_kernel, the plain kernel beside it; each returns unless the route is its own.
    Route 1 gives the plain kernel's bits, route 2 the general kernel's, route 0 the general
    kernel scanning V itself: a NaN value poisons exactly the rows that see its key, the others
    keep the general kernel's bits on a finite V. Without plain_kernel the general kernel
    serves every route: some kernel always writes the results (poisoned before it runs)."""
    emulator_or_skip()
    shape = Shape(1, 150, 130, 2, 1, 64)
    q, k, v = make_qkv(shape, jnp.bfloat16, seed=8)
    causal = dict(window=(-1, 0))
    plain = _forward(q, k, v, plain_kernel=True, **causal)
    general = _forward(q, k, v, plain_kernel=False, **causal)

    def same(a, b):
        for x, y in zip(a[:2], b[:2]):
            np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))

    routed = _forward(q, k, v, plain_kernel=True, route=1, **causal)
    same(routed, plain)
    assert routed[2].forward_plain == routed[2].forward > 0
    for plain_kernel, route in ((True, 2), (True, 0), (False, 2), (False, 1), (False, 0)):
        routed = _forward(q, k, v, plain_kernel=plain_kernel, route=route, **causal)
        same(routed, general)
        assert routed[2].forward_plain == 0 and routed[2].forward == general[2].forward, (plain_kernel, route)

    bad_key = 40
    bad_v = v.at[0, bad_key, 0, 3].set(jnp.nan)
    finite = _forward(q, k, v.at[0, bad_key, 0, 3].set(0), plain_kernel=False, **causal)
    for plain_kernel in (True, False):
        out, lse, _ = _forward(q, k, bad_v, plain_kernel=plain_kernel, route=0, **causal)
        out = out.astype(np.float32)
        assert np.isnan(out[0, bad_key:]).all(), plain_kernel  # causal: rows t >= 40 see key 40
        assert not np.isnan(out[0, :bad_key]).any(), plain_kernel
        np.testing.assert_array_equal(out[0, :bad_key], finite[0].astype(np.float32)[0, :bad_key])
        np.testing.assert_array_equal(lse, finite[1])


def _conditionals(fn, *args) -> int:
    text = jax.jit(fn).lower(*args).as_text()
    return text.count("stablehlo.case") + text.count("stablehlo.if")


def test_forward_chooses_its_kernel_without_a_conditional():
    """XLA's GPU conditional copies its predicate to the host and waits for the device: the
    forward routes on the device instead, so its lowering holds no conditional, with or without
    optional features, decoding included. A call with a dense bias keeps one (cuda/README.md: a
    -inf bias is not a mask), taken only when v holds a non-finite value."""
    emulator_or_skip()
    shape = Shape(1, 40, 50, 2, 1, 32)
    q, k, v = make_qkv(shape, jnp.bfloat16, seed=9)
    features = {
        "none": {},
        "causal": dict(is_causal=True),
        "soft_cap": dict(logits_soft_cap=10.0),
        "mask": dict(mask=jnp.ones((1, 2, 40, 50), jnp.bool_)),
        "segments": dict(segment_ids=(jnp.zeros((1, 40), jnp.int32), jnp.zeros((1, 50), jnp.int32))),
    }
    for name, kwargs in features.items():
        fn = lambda q, k, v, kwargs=kwargs: jax_flash.attention(q, k, v, implementation="cuda", **kwargs)
        assert _conditionals(fn, q, k, v) == 0, name
        grad = jax.grad(lambda q, k, v, fn=fn: fn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
        assert _conditionals(grad, q, k, v) == 0, name
    decode = lambda q, k, v: jax_flash.attention(q[:, :1], k, v, implementation="cuda")
    assert _conditionals(decode, q, k, v) == 0
    bias = jnp.zeros((1, 2, 40, 50), jnp.float32)
    assert _conditionals(lambda q, k, v: jax_flash.attention(q, k, v, bias=bias, implementation="cuda"), q, k, v) == 1
