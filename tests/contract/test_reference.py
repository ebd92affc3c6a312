"""The reference itself, checked against a plain loop over (b, n, t) written from the
specification's words alone (docs/design.md, "The call" and "Masks"), sharing no code
with the library."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jax_flash.reference import attention_reference

from cases import OFFSET_KINDS, Shape, make_qkv, mask_kwargs


def loop_attention(q, k, v, *, scale, bias=None, mask=None, is_causal=False,
                   query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                   segment_ids=None, logits_soft_cap=None, query_offset=None):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b_, t_, n_, h_ = q.shape
    s_, kh = k.shape[1], k.shape[2]
    out = np.zeros_like(q)
    lse = np.full((b_, t_, n_), -np.inf)
    if isinstance(local_window_size, int):
        local_window_size = (local_window_size, local_window_size)
    if segment_ids is not None and not isinstance(segment_ids, tuple):
        segment_ids = (segment_ids, segment_ids)
    offsets = np.broadcast_to(np.asarray(0 if query_offset is None else query_offset, object), (b_,))
    for b in range(b_):
        for n in range(n_):
            kvh = n // (n_ // kh)
            for t in range(t_):
                logits, vals = [], []
                pos = int(offsets[b]) + t  # the key position query t sits at
                for s in range(s_):
                    if is_causal and s > pos:
                        continue
                    if local_window_size is not None and not (pos - local_window_size[0] <= s <= pos + local_window_size[1]):
                        continue
                    if query_seq_lengths is not None and t >= int(query_seq_lengths[b]):
                        continue
                    if key_value_seq_lengths is not None and s >= int(key_value_seq_lengths[b]):
                        continue
                    if segment_ids is not None and int(segment_ids[0][b, t]) != int(segment_ids[1][b, s]):
                        continue
                    if mask is not None and not bool(np.broadcast_to(mask, (b_, n_, t_, s_))[b, n, t, s]):
                        continue
                    x = scale * float(q[b, t, n] @ k[b, s, kvh])
                    if bias is not None:
                        x += float(np.broadcast_to(bias, (b_, n_, t_, s_))[b, n, t, s])
                    if logits_soft_cap is not None:
                        x = logits_soft_cap * math.tanh(x / logits_soft_cap)
                    logits.append(x)
                    vals.append(v[b, s, kvh])
                if logits:
                    m = max(logits)
                    w = np.exp(np.asarray(logits) - m)
                    out[b, t, n] = (w[:, None] * np.asarray(vals)).sum(0) / w.sum()
                    lse[b, t, n] = m + math.log(w.sum())
    return out, lse


@pytest.mark.parametrize("kind", ["none", "causal", "window", "window_causal", "lengths",
                                  "segments", "softcap", "bias", "mask", "combo", "all_masked",
                                  *OFFSET_KINDS])
@pytest.mark.parametrize("shape", [Shape(2, 9, 13, 4, 2, 8), Shape(2, 13, 9, 2, 1, 8)], ids=str)
def test_reference_matches_loop(kind, shape):
    q, k, v = make_qkv(shape, jnp.float64)
    kw = mask_kwargs(kind, shape)
    out, lse = attention_reference(q, k, v, return_residual=True, compute_dtype=jnp.float64, **kw)
    scale = kw.pop("scale", 1 / math.sqrt(shape.h))
    want, want_lse = loop_attention(q, k, v, scale=scale, **kw)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-12)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.isfinite(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[fin], want_lse[fin], atol=1e-12)


@pytest.mark.parametrize(
    "window, offsets",
    [
        ((2**31 - 1, 0), [2**31 - 1, -(2**31)]),
        ((0, 2**31 - 1), [2**31 - 1, -(2**31)]),
        ((2**40, 3), [-(2**31), 5]),
        ((4, 2**33 + 1), [2**31 - 2, -(2**31) + 7]),
        ((2**31 - 5, 2**31 - 5), [2**31 - 10, -(2**31) + 10]),
    ],
)
def test_offset_window_extremes(window, offsets):
    """Offsets at the ends of int32 with huge windows: no int32 wrap-around in the band."""
    shape = Shape(2, 5, 7, 2, 1, 8)
    q, k, v = make_qkv(shape, jnp.float64)
    kw = dict(local_window_size=window, query_offset=jnp.asarray(offsets, jnp.int32))
    out, lse = attention_reference(q, k, v, return_residual=True, compute_dtype=jnp.float64, **kw)
    kw["query_offset"] = offsets
    want, want_lse = loop_attention(q, k, v, scale=1 / math.sqrt(shape.h), **kw)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-12)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.isfinite(want_lse))
