"""The cuda forward's decoding tile (cuda/kernels/tile.h DecodeForwardShape, the decode_tile
attribute): a call of at most 16 query rows per tile runs the general kernel on one warp of 16
rows instead of 8 warps of 16.

It is the general kernel's code on another tile, so where the two tiles have the same key tile
(H <= 64: 64 keys) every row sees the same arithmetic in the same order and the results are the
same bits; where the key tiles differ (H >= 96: 32 or 16 keys against 64, 32 or 16) they agree
within the rounding of the online softmax's rescaling. The host emulation's tile counter tells
which tile ran (it counts key tiles per CTA). The routing: a call of at most 16 rows per tile
(T, or G packed) asks for it, a longer one does not, and `explain` says which.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from cases import Shape, cuda_forward_target, emulator_or_skip, make_qkv
from jax_flash import _heuristics, cuda
from jax_flash._normalize import canonicalize

pytestmark = pytest.mark.skipif(
    not jax_flash.current_config().emulate_cuda, reason="counts tiles on the host emulation of the cuda kernels"
)


def _forward(q, k, v, *, decode_tile, **settings):
    """The emulated forward target called directly (results poisoned first): (out, lse, tiles)."""
    with cuda.count_tiles() as counts:
        out, lse = jax.block_until_ready(
            cuda_forward_target("jax_flash_emu_fwd", q, k, v, decode_tile=decode_tile, **settings)
        )
    return np.asarray(out), np.asarray(lse), counts


def _key_tiles(s: int, h: int, decode: bool) -> int:
    """Key tiles of a query block that sees every key: the decoding tile's 64 / 32 / 16 keys
    (H <= 64 / <= 128 / above), the warp16 tile's 64 / 64 / 32 (H = 192) / 16 (H = 256)."""
    decode_kv = 16 if h > 128 else 32 if h > 64 else 64
    warp16_kv = 16 if h > 192 else 32 if h > 128 else 64
    return -(-s // (decode_kv if decode else warp16_kv))


# name: (shape (B, T, S, N, K, H[, Hv]), settings): T <= 16, ragged key counts (tile sizes ± 1).
CASES = {
    "h32_t1": (Shape(2, 1, 129, 2, 1, 32), {}),
    "h64_t16": (Shape(1, 16, 65, 2, 2, 64), dict(sinks=[0.5, -jnp.inf])),
    "h64_t5_window": (Shape(1, 5, 200, 2, 1, 64), dict(window=(70, 0), q_offset=[150])),
    "h64_lengths": (Shape(2, 9, 130, 1, 1, 64), dict(q_lengths=[9, 3], kv_lengths=[130, 63])),
    "h128_t1": (Shape(1, 1, 97, 2, 1, 128), dict(sinks=[1.0, 0.0])),
    "h128_t16_window": (Shape(1, 16, 160, 2, 2, 128), dict(window=(-1, 0), q_offset=[144])),
    "h128_hv64": (Shape(1, 3, 70, 2, 1, 128, hv=64), {}),
    "h192_hv128": (Shape(1, 2, 50, 1, 1, 192, hv=128), {}),
    "h256": (Shape(1, 4, 33, 1, 1, 256), {}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_decode_tile_agrees_with_the_128_row_tile(name):
    emulator_or_skip()
    shape, settings = CASES[name]
    q, k, v = make_qkv(shape, jnp.bfloat16, seed=5)
    settings = dict(settings, scale=0.3)
    out_g, lse_g, general = _forward(q, k, v, decode_tile=False, **settings)
    out_d, lse_d, decode = _forward(q, k, v, decode_tile=True, **settings)
    assert not np.isnan(out_d.astype(np.float32)).any() and not np.isnan(lse_d).any()
    if "window" not in settings and "kv_lengths" not in settings:  # every key tile of the one query block runs
        heads = shape.b * shape.n
        assert decode.forward == heads * _key_tiles(shape.s, shape.h, True), decode
        assert general.forward == heads * _key_tiles(shape.s, shape.h, False), general
    if _key_tiles(shape.s, shape.h, True) == _key_tiles(shape.s, shape.h, False):
        np.testing.assert_array_equal(out_d.view(np.uint16), out_g.view(np.uint16))
        np.testing.assert_array_equal(lse_d.view(np.uint32), lse_g.view(np.uint32))
    else:
        np.testing.assert_allclose(out_d.astype(np.float32), out_g.astype(np.float32), rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(lse_d, lse_g, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "t, n, k, decode",
    [(1, 8, 2, True), (1, 32, 2, True), (1, 34, 2, False), (16, 4, 4, True), (17, 4, 4, False)],
)
def test_calls_route_to_the_decoding_tile_by_their_rows(t, n, k, decode):
    """At most 16 rows per tile: T, or with GQA packing (T = 1) the G = N / K query heads; G = 17
    packs into the 128-row tile. The call gives the reference's result either way."""
    emulator_or_skip()
    q, kk, v = make_qkv(Shape(1, t, 70, n, k, 64), jnp.bfloat16, seed=1)
    spec = canonicalize(q, kk, v).spec
    assert _heuristics.cuda_decode_tile(spec) == decode
    note = jax_flash.explain(q, kk, v, implementation="cuda", verbose=True).notes["cuda"]
    assert ("the decoding tile (16x64 tiles, one warp of 16 rows" in note) == decode, note
    with cuda.count_tiles() as counts:
        out = jax.block_until_ready(jax_flash.attention(q, kk, v, implementation="cuda"))
    ref = jax_flash.reference(q.astype(jnp.float32), kk.astype(jnp.float32), v.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), rtol=2e-2, atol=2e-2)
    # Never the plain kernel on the decoding tile; the longer calls may run it.
    assert counts.forward > 0 and (counts.forward_plain == 0 or not decode)
