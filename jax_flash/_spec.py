"""The canonical form of one attention call, shared by every implementation.

`jax_flash.attention` accepts the flexible public arguments (extra batch axes, 3-D inputs,
`is_causal` and a window, segment ids as one array or a pair, ...) and reduces them to:

* `AttentionSpec`: everything static (shapes, scale, window, soft cap, which optional
  inputs exist). Frozen and hashable, so it is a `nondiff_argnums` of the custom_vjp and
  a key of jit caches.
* `MaskInputs`: the optional array inputs, already folded to one batch axis, or None.

The spec also carries the call's settings (`config`, a resolved `jax_flash.Config`: cpu ISA,
split-KV counts, warp layout, ...), fixed when the call is traced: as part of the spec they
key every cache that the spec keys, and the implementations read them from there (as
`spec.settings`), never from the environment.

Every implementation receives q [B, T, N, H], k [B, S, K, H] and v [B, S, K, Hv] plus these
two, and returns out [B, T, N, Hv] and lse [B, N, T] (float32, natural log; with sinks, lse
includes the sink's exp(sinks[n]) and a row that sees no key has lse = sinks[n]). The value
head dim Hv may differ from the query/key head dim H (MLA: H = 192, Hv = 128).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from jax_flash import _config
from jax_flash._flex import BlockMask, FlexSpec


class MaskInputs(NamedTuple):
    """Optional array inputs of one call, batch already folded to one axis `B`."""

    bias: jax.Array | None = None  # [B|1, N|1, T|1, S|1], any float dtype
    mask: jax.Array | None = None  # [B|1, N|1, T|1, S|1], bool
    q_lengths: jax.Array | None = None  # [B] int32
    kv_lengths: jax.Array | None = None  # [B] int32
    q_segment_ids: jax.Array | None = None  # [B, T] int32
    kv_segment_ids: jax.Array | None = None  # [B, S] int32
    # [B] int32: query t of row b sits at key position q_offset[b] + t (causal/window only).
    q_offset: jax.Array | None = None
    # [N] float32 (float64 for float64 inputs): one logit per query head that joins every
    # row's softmax denominator with a zero value (attention sinks). Differentiable.
    sinks: jax.Array | None = None
    # uint32 [2]: the bits of the dropout_rng key (Philox's key, `_dropout`); not
    # differentiable. Present exactly when AttentionSpec.dropout_rate > 0.
    dropout_seed: jax.Array | None = None
    # flex_attention (AttentionSpec.flex): the arrays its score_mod and mask_mod close over,
    # hoisted into inputs (`_flex.close`); a score_mod's floating ones are differentiable.
    score_consts: tuple[jax.Array, ...] | None = None
    mask_consts: tuple[jax.Array, ...] | None = None
    # Which key blocks each query block sees (`_flex.BlockMask`); None: every block.
    block_mask: BlockMask | None = None


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Static description of one attention call (canonical BTNH layout)."""

    batch: int  # B: all leading batch axes folded into one
    q_len: int  # T
    kv_len: int  # S
    num_heads: int  # N
    num_kv_heads: int  # K (N % K == 0)
    head_dim: int  # H
    dtype: str  # numpy name of q/k/v's dtype
    scale: float
    # Visible keys of query t at position p = q_offset + t: p - window_left <= s <= p +
    # window_right; None = unbounded. Causal attention is the window (None, 0).
    window_left: int | None = None
    window_right: int | None = None
    soft_cap: float | None = None
    bias_shape: tuple[int, ...] | None = None
    mask_shape: tuple[int, ...] | None = None
    has_q_lengths: bool = False
    has_kv_lengths: bool = False
    has_segment_ids: bool = False
    has_q_offset: bool = False  # MaskInputs.q_offset is given (else the offset is 0)
    value_head_dim: int | None = None  # Hv of v and out; None means Hv = H
    has_sinks: bool = False  # MaskInputs.sinks is given
    # Attention dropout (float32 value, in [0, 1)); > 0 means MaskInputs.dropout_seed is
    # given and the keep-mask of `_dropout` applies to P after the softmax statistics.
    dropout_rate: float = 0.0
    # The call's settings, resolved when it was traced (`jax_flash._config.resolve`). None
    # only in a spec built by hand (tests, benchmarks): `settings` then resolves them when used.
    config: _config.Config | None = None
    # A flex_attention call: its score_mod, mask_mod and block mask's layout (`_flex`).
    flex: FlexSpec | None = None

    @property
    def settings(self) -> _config.Config:
        """The call's resolved settings: `config`, or those in force now if it is None."""
        return self.config if self.config is not None else _config.resolve()

    @property
    def has_dropout(self) -> bool:
        return self.dropout_rate > 0.0

    @property
    def v_head_dim(self) -> int:
        """Hv: the head dim of v and out (the query/key head dim H unless set)."""
        return self.head_dim if self.value_head_dim is None else self.value_head_dim

    @property
    def group_size(self) -> int:
        """G = N // K query heads share one kv head."""
        return self.num_heads // self.num_kv_heads

    @property
    def is_windowed(self) -> bool:
        return self.window_left is not None or self.window_right is not None

    def band(self, q_offset=0):
        """(lo, hi): query t sees key s through the window iff lo <= s - t <= hi.

        lo = q_offset - window_left and hi = q_offset + window_right, clipped to [-T, S]
        (which changes nothing, since -T < s - t < S) and computed without int32
        wrap-around for any window size; None for an unbounded side. q_offset: a Python
        int (the result is then Python ints), or an int32 array or traced scalar
        (elementwise).
        """
        lo = hi = None
        if self.window_left is not None:
            lo = offset_clip(q_offset, -self.window_left, -self.q_len, self.kv_len)
        if self.window_right is not None:
            hi = offset_clip(q_offset, self.window_right, -self.q_len, self.kv_len)
        return lo, hi

    def _widest_band(self, q_offset):
        """`band` of the union over a [B] array of offsets (an empty batch: no key)."""
        lo, hi = self.band(q_offset)
        if lo is not None and getattr(lo, "ndim", 0) > 0:
            lo = jax.numpy.min(lo, initial=self.kv_len)
        if hi is not None and getattr(hi, "ndim", 0) > 0:
            hi = jax.numpy.max(hi, initial=-self.q_len)
        return lo, hi

    def key_block_range(self, q_start, q_stop, block_k: int, num_k_blocks: int, q_offset=0):
        """Key blocks [lo, hi) holding a key that one of the queries [q_start, q_stop) sees
        through the window (exactly those: rows >= T and keys >= S do not count).

        q_offset: as for `band`; a [B] array gives the blocks any of the B rows can see.
        Works on Python ints and on traced int32 scalars alike (floor division).
        """
        band_lo, band_hi = self._widest_band(q_offset)
        lo = 0
        hi = num_k_blocks
        if band_lo is not None:  # the first visible key, q_start + band_lo
            first = q_start + band_lo
            lo = _select(first >= self.kv_len, num_k_blocks, _maximum(0, first // block_k))
        if band_hi is not None:  # the last visible key
            last = _minimum(q_stop, self.q_len) - 1 + band_hi
            hi = _minimum(num_k_blocks, last // block_k + 1)
        return lo, hi

    def query_block_range(self, k_start, k_stop, block_q: int, num_q_blocks: int, q_offset=0):
        """Query blocks [lo, hi) holding a query that sees one of the keys [k_start, k_stop)
        (exactly those; q_offset as for `key_block_range`)."""
        band_lo, band_hi = self._widest_band(q_offset)
        lo = 0
        hi = num_q_blocks
        if band_hi is not None:  # the first query that sees k_start
            first = k_start - band_hi
            lo = _select(first >= self.q_len, num_q_blocks, _maximum(0, first // block_q))
        if band_lo is not None:  # the last query that sees the last key
            last = _minimum(k_stop, self.kv_len) - 1 - band_lo
            hi = _minimum(num_q_blocks, last // block_q + 1)
        return lo, hi

    def flops(self, forward_backward: bool = False) -> float:
        """Model FLOPs: forward 2·B·N·T·S·(H + Hv) (two products: Q·Kᵀ over H, P·V over Hv;
        4·B·N·T·S·H when Hv = H), halved for causal at T == S; forward+backward 3.5× that
        (the backward's five products are 2.5× the forward's two; score recomputations an
        implementation adds are not credited)."""
        f = 2.0 * self.batch * self.num_heads * self.q_len * self.kv_len * (self.head_dim + self.v_head_dim)
        if self.window_left is None and self.window_right == 0 and self.q_len == self.kv_len:
            f /= 2
        return f * 3.5 if forward_backward else f


_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def offset_clip(offset, delta: int, lo: int, hi: int):
    """clip(offset + delta, lo, hi), exact for an int32 `offset` and any Python int `delta`
    (int32 sums saturate instead of wrapping around; lo, hi are int32)."""
    if isinstance(offset, int):
        return min(max(offset + delta, lo), hi)
    x = jax.numpy.asarray(offset, jax.numpy.int32)
    if abs(delta) >= 2**32:  # offset + delta lies outside int32, so outside [lo, hi]
        return jax.numpy.full(x.shape, lo if delta < 0 else hi, jax.numpy.int32)
    while delta != 0:  # at most three saturating steps of less than 2**31
        step = max(min(delta, _INT32_MAX), -_INT32_MAX)
        if step > 0:
            x = jax.numpy.where(x > _INT32_MAX - step, _INT32_MAX, x + step)
        else:
            x = jax.numpy.where(x < _INT32_MIN - step, _INT32_MIN, x + step)
        delta -= step
    return jax.numpy.clip(x, lo, hi).astype(jax.numpy.int32)


def _maximum(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    return jax.numpy.maximum(a, b)


def _select(cond, a, b):
    if isinstance(cond, bool):
        return a if cond else b
    return jax.numpy.where(cond, a, b)


def _minimum(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return jax.numpy.minimum(a, b)
