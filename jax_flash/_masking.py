"""The one definition of "query t may see key s", and of the logit transform.

Shared by the reference, the blockwise XLA path and the Pallas kernels so that every
implementation written in JAX agrees by construction. (The C++ and CUDA kernels implement
the same rules in `cuda/`; the shared test suite holds them to these.)

All functions broadcast: `rows` is an int32 array of query positions shaped [..., tq, 1],
`cols` of key positions shaped [..., 1, tk]; per-batch inputs come already indexed for the
batch element(s) at hand and shaped to broadcast against [..., tq, tk]. Rows and columns
index the arrays; the query offset only moves the causal/window band (`AttentionSpec.band`).
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_flash._spec import AttentionSpec


def visible(
    spec: AttentionSpec,
    rows,
    cols,
    *,
    q_lengths=None,
    kv_lengths=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    kv_limit=None,
    band=None,
):
    """Boolean visibility of keys `cols` to queries `rows`; masks combine by AND.

    kv_limit: keys >= kv_limit do not exist (the ragged tail of a padded key block).
    band: `spec.band(q_offset)` (shaped like the per-batch inputs); required when the spec
    has a query offset, else it defaults to `spec.band()` (offset 0).
    Returns None when nothing is masked.
    """
    if band is None:
        if spec.has_q_offset:
            raise ValueError("visible: the spec has a query offset but no band was given")
        band = spec.band()
    band_lo, band_hi = band
    conds = []
    if kv_limit is not None:
        conds.append(cols < kv_limit)
    if band_lo is not None or band_hi is not None:
        diagonal = cols - rows  # s - t: the window is a band of diagonals
    if band_lo is not None:
        conds.append(diagonal >= band_lo)
    if band_hi is not None:
        conds.append(diagonal <= band_hi)
    if q_lengths is not None:
        conds.append(rows < q_lengths)
    if kv_lengths is not None:
        conds.append(cols < kv_lengths)
    if q_segment_ids is not None:
        conds.append(q_segment_ids == kv_segment_ids)
    if not conds:
        return None
    out = conds[0]
    for c in conds[1:]:
        out = out & c
    return out


def transform_logits(spec: AttentionSpec, logits, bias=None):
    """logits (already scaled) + bias, then the soft cap c·tanh(x/c). Float32 in and out."""
    if bias is not None:
        logits = logits + bias.astype(logits.dtype)
    if spec.soft_cap is not None:
        cap = jnp.asarray(spec.soft_cap, logits.dtype)
        logits = cap * jnp.tanh(logits / cap)
    return logits


def soft_cap_grad(spec: AttentionSpec, capped_logits):
    """d capped / d uncapped = 1 - tanh² = 1 - (capped / c)², from the capped value."""
    cap = jnp.asarray(spec.soft_cap, capped_logits.dtype)
    t = capped_logits / cap
    return 1 - t * t
