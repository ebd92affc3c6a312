"""The numerics every implementation shares: the accumulator dtype, padding, the NaN/±inf
rules of docs/numerical-contract.md, and the online softmax's running state.

Below the implementations: `xla`, split-KV, the paged forward and both Pallas kernels
(`pallas._triton_kernels`, `pallas/_decode`) compute with these functions, in plain JAX
and inside Pallas kernel bodies alike (every function here lowers on the Triton backend
and in interpret mode), so one rule has one definition.
"""

from __future__ import annotations

import jax.numpy as jnp


def round_up(x: int, m: int) -> int:
    """x rounded up to a multiple of m."""
    return -(-x // m) * m


def acc_dtype(dtype) -> jnp.dtype:
    """Statistics and accumulators: float32, or float64 for float64 inputs."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def pad_axis(x, axis: int, size: int, value=0):
    """x padded with `value` at the end of `axis` to `size` (x itself when it has that size)."""
    if x.shape[axis] == size:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def full(shape, value, dtype, *like):
    """jnp.full whose result varies over the same mesh axes as `like` (inside shard_map a
    loop carry must start as varying as what the loop makes of it: check_vma)."""
    x = jnp.full_like(like[0], value, dtype, shape)
    for y in like[1:]:
        x = x + jnp.zeros_like(y, dtype, ())
    return x


def poison_infinite(scores):
    """A raw score q·k that is ±inf comes from a non-finite q or k: make it NaN, like the
    NaN one would give, so that it poisons its row whatever its sign and the scale."""
    return jnp.where(jnp.isinf(scores), jnp.nan, scores)


def clamp_exponent(d):
    """min(d, 0) that keeps NaN (a select: jnp.minimum may drop it in a fused reduction)."""
    return jnp.where(d > 0, jnp.zeros((), d.dtype), d)


def finite_part(x):
    """x with NaN/±inf replaced by 0: the operand of a product that meets masked weights."""
    return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


# |q·k| <= H·max|q|·max|k| (each of the H products, and every partial sum of them in float32,
# is bounded by it): below 2**126 no score of the call can overflow float32 (max 2**128).
_FINITE_SCORE_BOUND = 2.0**126


def scores_are_finite(q, k):
    """Bool scalar: every raw score q·k of the call is finite, so that a plain kernel (the cuda
    and pallas ones), which does not make ±inf scores NaN, has none to make: q and k finite,
    and H·max|q|·max|k| below float32's range. One reduction over each of q and k."""

    def max_abs(x):  # +inf when x holds a NaN or ±inf (whatever a max does with NaN); exact in x's dtype
        return jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), jnp.inf), initial=0).astype(jnp.float32)

    return max_abs(q) * max_abs(k) * q.shape[-1] < _FINITE_SCORE_BOUND


def nonfinite_rows(x):
    """[B, L, N, H] -> bool [B, L, N]: the row holds a NaN or ±inf."""
    return ~jnp.all(jnp.isfinite(x), axis=-1)


def online_softmax_init(rows: tuple, head_dim: int, acc_dt, *like, sink=None):
    """The running (m, l, acc, bad) of FlashAttention-2 Alg. 1 for `rows` query rows: m =
    -inf, l = 0, acc = 0 [*rows, head_dim], bad = False (the row saw a non-finite v),
    varying like `like` (see `full`).

    sink: None, or the rows' sink logit, broadcastable to `rows`: the state after one key
    with that logit and value 0 was seen, m = sink and l = 1 (`sink_state`)."""
    m = full(rows, -jnp.inf, acc_dt, *like)
    l = full(rows, 0, acc_dt, *like)
    if sink is not None:
        m0, l0 = sink_state(sink.astype(acc_dt))
        m, l = m0 + jnp.zeros_like(m), l0 + jnp.zeros_like(l)
    return m, l, full((*rows, head_dim), 0, acc_dt, *like), full(rows, False, jnp.bool_, *like)


def sink_state(sink):
    """(m, l) of the online softmax after the sink alone: m = sink, l = 1. A -inf sink is no
    sink (its l is scaled to 0 by the first visible key, and a row that sees none keeps lse
    = -inf + log 1); a NaN or +inf sink gets l = NaN, which poisons every row of its head."""
    return sink, jnp.where(sink < jnp.inf, jnp.ones_like(sink), jnp.nan)


def online_softmax_step(carry, logits, vis, v_blk, bad_v_blk, pv=None, keep=None):
    """One key tile of the online softmax (FlashAttention-2 Alg. 1, inner loop).

    carry: (m, l, acc, bad) [..., q] x2, [..., q, Hv], bool [..., q] (running max, running
    sum, unnormalised output in the accumulator dtype, saw a non-finite v); logits
    [B, K, G, q, s] (scaled, biased, capped); vis: bool broadcastable to logits, or None;
    v_blk [B, s, K, Hv], finite (`finite_part`); bad_v_blk: bool broadcastable to logits,
    the keys whose v row is non-finite, or None. pv: optional P·V for other layouts,
    pv(p, v_blk) -> [..., q, Hv] in the accumulator dtype (a kernel's 2-D tiles). keep:
    dropout's keep bits (bool like logits) or None: the statistics see every p, the
    accumulator only the kept ones (the 1 / (1 - rate) scaling is the caller's, at the end)."""
    m, l, acc, bad = carry
    if vis is not None:
        logits = jnp.where(vis, logits, -jnp.inf)
        bad_v_blk = None if bad_v_blk is None else bad_v_blk & vis
    # A NaN logit may be dropped by the max, never by p = exp(NaN): l and acc carry it.
    m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
    # A row that has seen nothing yet keeps m = -inf; exponentiate against 0 so
    # exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN.
    m_safe = jnp.where(m_new == -jnp.inf, 0, m_new)
    p = jnp.exp(clamp_exponent(logits - m_safe[..., None]))
    alpha = jnp.exp(m - m_safe)
    l = alpha * l + jnp.sum(p, axis=-1)
    if pv is None:
        pv = lambda p, v: jnp.einsum("bkgqs,bskh->bkgqh", p.astype(v.dtype), v, preferred_element_type=acc.dtype)
    if bad_v_blk is not None:
        bad = bad | jnp.any(jnp.broadcast_to(bad_v_blk, logits.shape), axis=-1)
    p_kept = p if keep is None else jnp.where(keep, p, 0)
    return m_new, l, alpha[..., None] * acc + pv(p_kept, v_blk), bad


def online_softmax_finish(carry):
    """(out, lse) from the running (m, l, acc, bad): out = acc / l (accumulator dtype), lse =
    m + log l; a row that saw no key (l == 0) gets out 0 and lse -inf; a poisoned row (NaN
    l, or a visible non-finite v) is NaN."""
    m, l, acc, bad = carry
    # Empty: saw no key, or only -inf logits (l = 0). A NaN l (a poisoned row) is not.
    empty = l == 0
    l_safe = jnp.where(empty, 1, l)
    out = jnp.where(bad[..., None], jnp.nan, acc / l_safe[..., None])
    out = jnp.where(empty[..., None], 0, out)
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))
    return out, lse
