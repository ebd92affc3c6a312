"""The canonical form of one attention call, shared by every implementation.

`jax_flash.attention` accepts the flexible public arguments (extra batch axes, 3-D inputs,
`is_causal` and a window, segment ids as one array or a pair, ...) and reduces them to:

* `AttentionSpec`: everything static (shapes, scale, window, soft cap, which optional
  inputs exist). Frozen and hashable, so it is a `nondiff_argnums` of the custom_vjp and
  a key of jit caches.
* `MaskInputs`: the optional array inputs, already folded to one batch axis, or None.

Every implementation receives q [B, T, N, H], k and v [B, S, K, H] plus these two, and
returns out [B, T, N, H] and lse [B, N, T] (float32, natural log).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax


class MaskInputs(NamedTuple):
    """Optional array inputs of one call, batch already folded to one axis `B`."""

    bias: Optional[jax.Array] = None  # [B|1, N|1, T|1, S|1], any float dtype
    mask: Optional[jax.Array] = None  # [B|1, N|1, T|1, S|1], bool
    q_lengths: Optional[jax.Array] = None  # [B] int32
    kv_lengths: Optional[jax.Array] = None  # [B] int32
    q_segment_ids: Optional[jax.Array] = None  # [B, T] int32
    kv_segment_ids: Optional[jax.Array] = None  # [B, S] int32


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
    # Visible keys of query t: t - window_left <= s <= t + window_right; None = unbounded.
    # Causal attention is the window (None, 0).
    window_left: Optional[int] = None
    window_right: Optional[int] = None
    soft_cap: Optional[float] = None
    bias_shape: Optional[tuple[int, ...]] = None
    mask_shape: Optional[tuple[int, ...]] = None
    has_q_lengths: bool = False
    has_kv_lengths: bool = False
    has_segment_ids: bool = False

    @property
    def group_size(self) -> int:
        """G = N // K query heads share one kv head."""
        return self.num_heads // self.num_kv_heads

    @property
    def is_windowed(self) -> bool:
        return self.window_left is not None or self.window_right is not None

    def key_block_range(self, q_start, q_stop, block_k: int, num_k_blocks: int):
        """Key blocks [lo, hi) that queries [q_start, q_stop) can see through the window.

        Works on Python ints and on traced int32 scalars alike (floor division).
        """
        lo = 0
        hi = num_k_blocks
        if self.window_left is not None:
            lo = _maximum(0, (q_start - self.window_left) // block_k)
        if self.window_right is not None:
            hi = _minimum(num_k_blocks, (q_stop - 1 + self.window_right) // block_k + 1)
        return lo, hi

    def query_block_range(self, k_start, k_stop, block_q: int, num_q_blocks: int):
        """Query blocks [lo, hi) that can see any key of [k_start, k_stop)."""
        lo = 0
        hi = num_q_blocks
        if self.window_right is not None:
            lo = _maximum(0, (k_start - self.window_right) // block_q)
        if self.window_left is not None:
            hi = _minimum(num_q_blocks, (k_stop - 1 + self.window_left) // block_q + 1)
        return lo, hi

    def flops(self, backward: bool = False) -> float:
        """Model FLOPs: forward 4·B·N·T·S·H, halved for causal at T == S; backward 2.5×."""
        f = 4.0 * self.batch * self.num_heads * self.q_len * self.kv_len * self.head_dim
        if self.window_left is None and self.window_right == 0 and self.q_len == self.kv_len:
            f /= 2
        return f * 2.5 if backward else f


def _maximum(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    return jax.numpy.maximum(a, b)


def _minimum(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return jax.numpy.minimum(a, b)
