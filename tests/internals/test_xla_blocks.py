"""The blockwise XLA path with small tiles, so that several query and key blocks exist:
online rescaling across key blocks, dQ accumulation across query blocks, and the skipping
of key blocks outside a causal/window band all take part."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jax_flash import xla
from jax_flash._normalize import canonicalize
from jax_flash.reference import reference_canonical

from cases import OFFSET_KINDS, Shape, make_qkv, mask_kwargs, max_err

SHAPE = Shape(2, 45, 70, 4, 2, 16)


@pytest.mark.parametrize("kind", ["none", "causal", "window", "window_causal", "lengths",
                                  "segments", "softcap", "bias", "mask", "combo", "all_masked",
                                  *OFFSET_KINDS])
@pytest.mark.parametrize("blocks", [(8, 16), (16, 8)])
def test_small_blocks(kind, blocks):
    bq, bk = blocks
    q, k, v = make_qkv(SHAPE, jnp.float64)
    c = canonicalize(q, k, v, **mask_kwargs(kind, SHAPE))
    out, lse = xla.forward(c.spec, c.q, c.k, c.v, c.masks, block_q=bq, block_k=bk)
    ref, ref_lse = reference_canonical(c.spec, c.q, c.k, c.v, c.masks)
    assert max_err(out, ref) < 1e-12
    assert max_err(lse, ref_lse) < 1e-12

    dout = jax.random.normal(jax.random.PRNGKey(1), out.shape, out.dtype)
    dlse = jax.random.normal(jax.random.PRNGKey(2), lse.shape, lse.dtype)
    dq, dk, dv, dbias = xla.backward(c.spec, c.q, c.k, c.v, c.masks, out, lse, dout, dlse,
                                     block_q=bq, block_k=bk)

    def ref_loss(q, k, v, bias):
        o, l = reference_canonical(c.spec, q, k, v, c.masks._replace(bias=bias))
        return jnp.sum(o * dout) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0) * dlse)

    g = jax.grad(ref_loss, (0, 1, 2, 3) if c.masks.bias is not None else (0, 1, 2))(
        c.q, c.k, c.v, c.masks.bias)
    for got, want in zip((dq, dk, dv, dbias), g):
        assert max_err(got, want) < 1e-10


def test_band_skips_key_blocks():
    """Causal at T == S visits about half the key blocks (the inner loops are bounded)."""
    q = jax.ShapeDtypeStruct((1, 4096, 1, 64), jnp.float32)

    def cost(is_causal):
        c = canonicalize(jnp.zeros((1, 8, 1, 64)), jnp.zeros((1, 8, 1, 64)), jnp.zeros((1, 8, 1, 64)),
                         is_causal=is_causal)
        spec = c.spec.__class__(**{**c.spec.__dict__, "q_len": 4096, "kv_len": 4096})
        nblocks = 4096 // 512
        visits = 0
        for i in range(nblocks):
            lo, hi = spec.key_block_range(i * 512, (i + 1) * 512, 512, nblocks)
            visits += max(0, hi - lo)
        return visits

    assert cost(False) == 64
    assert cost(True) == 36  # 8·9/2: the diagonal blocks plus those below it


@pytest.mark.parametrize("window", [(None, 0), (5, 0), (3, 7), (None, 4), (6, None), (0, 0)])
def test_block_ranges_follow_the_offset(window):
    """key_block_range / query_block_range with query offsets (Python ints, and a [B] array
    giving the union over rows) are exactly the blocks that hold a visible (query, key)."""
    import numpy as np

    from jax_flash._spec import AttentionSpec

    t, s, bq, bk = 23, 41, 4, 8
    nq, nk = -(-t // bq), -(-s // bk)
    spec = AttentionSpec(batch=3, q_len=t, kv_len=s, num_heads=1, num_kv_heads=1, head_dim=8,
                         dtype="float32", scale=1.0, window_left=window[0],
                         window_right=window[1], has_q_offset=True)
    left = np.inf if window[0] is None else window[0]
    right = np.inf if window[1] is None else window[1]
    rows, cols = np.arange(t)[:, None], np.arange(s)[None, :]

    def visible(offsets):
        pos = np.asarray(offsets)[:, None, None] + rows
        return ((cols >= pos - left) & (cols <= pos + right)).any(0)  # union over rows

    def blocks(lo, hi):
        return set(range(int(lo), int(hi)))

    for offsets in ([0], [s - t], [-9], [s + 2], [-30], [3, 3, 3], [3, s - t, -5], [-t - 10, s + 1]):
        vis = visible(offsets)
        arg = offsets[0] if len(offsets) == 1 else jnp.asarray(offsets, jnp.int32)
        # One offset: exactly the blocks with a visible pair. Several: one loop serves all
        # rows, so it may visit more (the hull of their bands), never fewer.
        exact = len(set(offsets)) == 1
        for i in range(nq):
            want = {j for j in range(nk) if vis[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any()}
            got = blocks(*spec.key_block_range(i * bq, (i + 1) * bq, bk, nk, arg))
            assert got == want if exact else got >= want, (offsets, i)
        for j in range(nk):
            want = {i for i in range(nq) if vis[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any()}
            got = blocks(*spec.query_block_range(j * bk, (j + 1) * bk, bq, nq, arg))
            assert got == want if exact else got >= want, (offsets, j)
