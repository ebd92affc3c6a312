"""The exact merge of partial softmax results by log-sum-exp.

Attention over a key set that is split into disjoint parts (ring attention's K/V chunks,
split-KV decoding's key chunks) is computed part by part, each part giving a normalised
partial output o_c and its lse_c; the whole is

    lse = log sum_c exp(lse_c),    out = sum_c exp(lse_c - lse) · o_c,

which is the online-softmax identity of FlashAttention applied to whole parts. One function
serves every caller, so there is one rule for rows that saw nothing and one summation order.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax.numpy as jnp


def merge_partials(outs: Sequence, lses: Sequence):
    """Merge partial results over disjoint key sets, summed left to right in the given order.

    outs: C arrays [B, T, N, Hv] (normalised partial outputs, the accumulator dtype); lses: C
    arrays [B, N, T] (natural log, -inf for a row that saw no key of that part). Returns out
    [B, T, N, Hv] and lse [B, N, T]; a row that saw nothing in every part gets out 0 and lse
    -inf (no NaN); a row poisoned in a part (NaN lse or out) stays NaN. Deterministic: one fixed order of sums, no atomics; the parts are never
    stacked into one array (a ring step merges two without copying them).
    """
    m = functools.reduce(jnp.maximum, lses)
    m_safe = jnp.where(m == -jnp.inf, 0, m)
    ws = [jnp.exp(lse - m_safe) for lse in lses]  # 0 for the parts a row saw nothing of
    total = functools.reduce(jnp.add, ws)
    # Empty: no part saw a key (total 0). A NaN total (a poisoned row) is not: it stays NaN.
    empty = total == 0
    total_safe = jnp.where(empty, 1, total)
    merged_lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(total_safe))
    rows = lambda x: jnp.swapaxes(x, 1, 2)[..., None]  # [B, N, T] -> [B, T, N, 1]
    merged = functools.reduce(jnp.add, [rows(w) * o for w, o in zip(ws, outs)])
    return merged / rows(total_safe), merged_lse
