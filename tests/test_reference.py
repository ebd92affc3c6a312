"""The reference itself, checked against a plain loop over (b, n, t) written from the
specification's words alone (DESIGN §1), sharing no code with the library."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jax_flash.reference import attention_reference

from cases import Shape, make_qkv, mask_kwargs


def loop_attention(q, k, v, *, scale, bias=None, mask=None, is_causal=False,
                   query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                   segment_ids=None, logits_soft_cap=None):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b_, t_, n_, h_ = q.shape
    s_, kh = k.shape[1], k.shape[2]
    out = np.zeros_like(q)
    lse = np.full((b_, t_, n_), -np.inf)
    if isinstance(local_window_size, int):
        local_window_size = (local_window_size, local_window_size)
    if segment_ids is not None and not isinstance(segment_ids, tuple):
        segment_ids = (segment_ids, segment_ids)
    for b in range(b_):
        for n in range(n_):
            kvh = n // (n_ // kh)
            for t in range(t_):
                logits, vals = [], []
                for s in range(s_):
                    if is_causal and s > t:
                        continue
                    if local_window_size is not None and not (t - local_window_size[0] <= s <= t + local_window_size[1]):
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
                                  "segments", "softcap", "bias", "mask", "combo", "all_masked"])
def test_reference_matches_loop(kind):
    shape = Shape(2, 9, 13, 4, 2, 8)
    q, k, v = make_qkv(shape, jnp.float64)
    kw = mask_kwargs(kind, shape)
    out, lse = attention_reference(q, k, v, return_residual=True, compute_dtype=jnp.float64, **kw)
    scale = kw.pop("scale", 1 / math.sqrt(shape.h))
    want, want_lse = loop_attention(q, k, v, scale=scale, **kw)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-12)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.isfinite(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[fin], want_lse[fin], atol=1e-12)
