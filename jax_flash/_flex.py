"""FlexAttention's pieces shared by the front end, the reference and the implementations:
user functions made static, their element-wise application to a tile, and block masks.

A `score_mod(score, b, h, q_idx, kv_idx) -> score` and a `mask_mod(b, h, q_idx, kv_idx) ->
bool` are written on scalars (int32 indices, a float32 score; float64 for float64 inputs)
and close over arrays (document ids, slopes, a bias table). Every array a function closes
over is hoisted into an explicit input (`close`): the function that remains is closed over
nothing, hashable and static (part of the `AttentionSpec`), and the hoisted constants travel
as inputs of the one custom_vjp, so that a float constant of a score_mod is differentiated
like `bias` and no tracer is captured by the static part.

A `BlockMask` says, per (batch row, head, query block), which key blocks are partly visible
(mask_mod must be evaluated there) and which are fully visible (it need not be); the other
key blocks are empty and are skipped. `create_block_mask` computes one from a mask_mod with
XLA, one query block at a time and a bounded number of key blocks per step, so that the
T×S matrix of a long sequence never exists.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
from jax import lax

# States of one (query block, key block) pair of a block mask.
EMPTY, PARTIAL, FULL = 0, 1, 2

DEFAULT_BLOCK_SIZE = 128  # PyTorch's default; tiles of the implementations follow it

# create_block_mask evaluates at most this many (b, h, q, kv) positions per step.
_POSITIONS_PER_STEP = 1 << 22


class ClosedFunction:
    """A user function with every array it closes over hoisted out: `self(consts, *args)`.

    Hashable by identity (a static argument); `consts` are passed at every call."""

    def __init__(self, jaxpr: Any, name: str, num_consts: int):
        self._jaxpr = jaxpr
        self.name = name
        self.num_consts = num_consts

    @property
    def jaxpr(self) -> Any:
        """The function's jaxpr: its constvars are the closed-over arrays, in order."""
        return self._jaxpr

    def __call__(self, consts, *args):
        closed = jax.extend.core.ClosedJaxpr(self._jaxpr, list(consts))
        (out,) = jax.extend.core.jaxpr_as_fun(closed)(*args)
        return out

    def __repr__(self) -> str:
        return f"<{self.name}, {self.num_consts} closed-over array(s)>"


def _fn_name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def close(fn, what: str, example_args: tuple) -> tuple[ClosedFunction, tuple[jax.Array, ...]]:
    """(static function, its closed-over arrays) of a user function, checked on scalars:
    `what` is "score_mod" or "mask_mod"; the result must be one scalar, bool for a mask_mod
    and floating for a score_mod."""
    if not callable(fn):
        raise TypeError(f"{what} must be a function, got {type(fn).__name__} {fn!r}")
    closed = jax.make_jaxpr(fn)(*example_args)
    outs = closed.out_avals
    signature = (
        "mask_mod(b, h, q_idx, kv_idx) -> bool"
        if what == "mask_mod"
        else "score_mod(score, b, h, q_idx, kv_idx) -> score"
    )
    if len(outs) != 1 or outs[0].shape != ():
        got = ", ".join(f"{a.dtype}{list(a.shape)}" for a in outs) or "nothing"
        raise TypeError(f"{what} must return one scalar ({signature}, on scalars), got {got}")
    dtype = outs[0].dtype
    if what == "mask_mod" and dtype != jnp.bool_:
        raise TypeError(f"mask_mod must return a bool scalar ({signature}), got {dtype}")
    if what == "score_mod" and not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"score_mod must return a floating-point scalar ({signature}), got {dtype}")
    consts = tuple(jnp.asarray(c) for c in closed.consts)
    return ClosedFunction(closed.jaxpr, f"{what} {_fn_name(fn)}", len(consts)), consts


def index_args() -> tuple[jax.Array, ...]:
    """Example (b, h, q_idx, kv_idx): int32 scalars."""
    return tuple(jnp.zeros((), jnp.int32) for _ in range(4))


@dataclasses.dataclass(frozen=True)
class FlexSpec:
    """The static part of a flex_attention call (a field of `AttentionSpec`)."""

    score_mod: ClosedFunction | None = None
    mask_mod: ClosedFunction | None = None
    # The block mask's (block_q, block_k) and its [B|1, N|1] broadcast shape; None: no block
    # mask was given, so every block is partly visible (with a mask_mod) or fully visible.
    block_size: tuple[int, int] | None = None
    block_batch_heads: tuple[int, int] | None = None

    @property
    def has_block_mask(self) -> bool:
        return self.block_size is not None


def elementwise(fn: ClosedFunction, consts, *args):
    """fn(consts, *scalars) at every position of the broadcast of `args` (vmap over the
    flattened positions: the user wrote it on scalars)."""
    full = jnp.broadcast_arrays(*args)
    shape = full[0].shape
    flat = [a.reshape(-1) for a in full]
    out = jax.vmap(lambda *xs: fn(consts, *xs))(*flat)
    return out.reshape(shape)


def apply_mask_mod(fn: ClosedFunction, consts, b, h, q_idx, kv_idx):
    """Bool visibility at the broadcast of the int32 index arrays."""
    return elementwise(fn, consts, b, h, q_idx, kv_idx)


def apply_score_mod(fn: ClosedFunction, consts, score, b, h, q_idx, kv_idx):
    """The modified score at every position, in score's dtype."""
    return elementwise(fn, consts, score, b, h, q_idx, kv_idx).astype(score.dtype)


def split_float(consts) -> tuple[list[int], list[int]]:
    """Positions of the floating (differentiable) and of the other constants."""
    fl = [i for i, c in enumerate(consts) if jnp.issubdtype(c.dtype, jnp.floating)]
    other = [i for i in range(len(consts)) if i not in fl]
    return fl, other


# ---------------------------------------------------------------------------------------
# Block masks


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockMask:
    """Which key blocks each query block of each (batch row, head) sees: a pytree, made by
    `jax_flash.create_block_mask` (jit-able, cheap to rebuild every step).

    Blocks are `block_size = (block_q, block_k)` positions; nq = ceil(T / block_q) query
    blocks and nk = ceil(S / block_k) key blocks; the leading [B, N] axes may be 1 (the same
    for every batch row / head). For query block i of (b, h):

    * `kv_num_blocks[b, h, i]` key blocks are partly visible (mask_mod is evaluated there),
      the first entries of `kv_indices[b, h, i, :]`, ascending;
    * `full_kv_num_blocks[b, h, i]` are fully visible (mask_mod is not evaluated), the first
      entries of `full_kv_indices[b, h, i, :]`, ascending;
    * every other key block is empty: skipped.

    The `q_*` fields are the same for each key block (the query blocks that see it), which is
    the order a backward pass walks. Entries past a count are unspecified. All arrays int32.
    Positions past T or S (the last blocks' padding) do not count: a last block whose real
    positions are all visible is fully visible.
    """

    kv_num_blocks: jax.Array  # [B|1, N|1, nq]
    kv_indices: jax.Array  # [B|1, N|1, nq, nk]
    full_kv_num_blocks: jax.Array  # [B|1, N|1, nq]
    full_kv_indices: jax.Array  # [B|1, N|1, nq, nk]
    q_num_blocks: jax.Array  # [B|1, N|1, nk]
    q_indices: jax.Array  # [B|1, N|1, nk, nq]
    full_q_num_blocks: jax.Array  # [B|1, N|1, nk]
    full_q_indices: jax.Array  # [B|1, N|1, nk, nq]
    seq_lengths: tuple[int, int] = dataclasses.field(metadata=dict(static=True), default=(0, 0))  # (T, S)
    block_size: tuple[int, int] = dataclasses.field(
        metadata=dict(static=True), default=(DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE)
    )

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B|1, N|1, nq, nk)."""
        b, n, nq, nk = self.kv_indices.shape
        return b, n, nq, nk

    def to_dense(self) -> jax.Array:
        """int8 [B|1, N|1, nq, nk]: 0 empty, 1 partly visible, 2 fully visible block."""
        nk = self.kv_indices.shape[-1]
        return (
            _dense_of(self.kv_num_blocks, self.kv_indices, nk) * PARTIAL
            + _dense_of(self.full_kv_num_blocks, self.full_kv_indices, nk) * FULL
        ).astype(jnp.int8)

    def num_nonempty(self) -> jax.Array:
        """The number of (b, h, query block, key block) that are not empty (int32)."""
        return jnp.sum(self.kv_num_blocks) + jnp.sum(self.full_kv_num_blocks)


def _dense_of(counts, indices, n: int):
    """int32 [..., rows, n]: 1 where a column is among the first `counts` indices of its row."""
    slots = jnp.arange(indices.shape[-1], dtype=jnp.int32)
    used = slots < counts[..., None]  # [..., rows, slots]
    hit = (indices[..., :, None] == jnp.arange(n, dtype=jnp.int32)) & used[..., None]
    return jnp.any(hit, axis=-2).astype(jnp.int32)


def ordered(flag):
    """(count [...], indices [..., n]) of a bool [..., n]: the True positions ascending
    first (a stable sort of the flags)."""
    count = jnp.sum(flag, axis=-1, dtype=jnp.int32)
    order = jnp.argsort(~flag, axis=-1, stable=True).astype(jnp.int32)
    return count, order


def from_dense(state, seq_lengths: tuple[int, int], block_size: tuple[int, int]) -> BlockMask:
    """A BlockMask from its int [B|1, N|1, nq, nk] states (0 empty, 1 partial, 2 full)."""
    state = jnp.asarray(state)
    partial, full = state == PARTIAL, state == FULL
    kv_n, kv_i = ordered(partial)
    fkv_n, fkv_i = ordered(full)
    q_n, q_i = ordered(jnp.swapaxes(partial, -1, -2))
    fq_n, fq_i = ordered(jnp.swapaxes(full, -1, -2))
    t, s = seq_lengths
    bq, bk = block_size
    return BlockMask(kv_n, kv_i, fkv_n, fkv_i, q_n, q_i, fq_n, fq_i, (int(t), int(s)), (int(bq), int(bk)))


def _positive_int(x: object) -> bool:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        return False
    return int(x) >= 1


def _block_size(block_size: object) -> tuple[int, int]:
    pair: object = (block_size, block_size) if _positive_int(block_size) else block_size
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(_positive_int(x) for x in pair)):
        raise ValueError(f"block_size must be a positive int or a pair (block_q, block_k), got {block_size!r}")
    return int(pair[0]), int(pair[1])


def _size(name: str, x: object, allow_none: bool) -> int:
    if x is None and allow_none:
        return 1
    if not _positive_int(x):
        accepted = "a positive int or None (broadcast)" if allow_none else "a positive int"
        raise ValueError(f"{name} must be {accepted}, got {x!r}")
    assert isinstance(x, numbers.Integral)
    return int(x)


def create_block_mask(
    mask_mod: Callable[..., Any],
    B: int | None,
    N: int | None,
    T: int,
    S: int,
    *,
    block_size: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
) -> BlockMask:
    """The `BlockMask` of `mask_mod(b, h, q_idx, kv_idx) -> bool` for B batch rows, N query
    heads, T queries and S keys (B or N None: one row / head shared by all, mask_mod then
    called with b = 0 / h = 0), in blocks of `block_size` (an int, or (block_q, block_k)).

    Evaluated by XLA one query block at a time, a bounded number of key blocks per step
    (never the whole T×S); jit-able (B, N, T, S and block_size static)."""
    b_n, h_n = _size("B", B, True), _size("N", N, True)
    t, s = _size("T", T, False), _size("S", S, False)
    bq, bk = _block_size(block_size)
    fn, consts = close(mask_mod, "mask_mod", index_args())
    nq, nk = -(-t // bq), -(-s // bk)
    per_block = b_n * h_n * bq * bk
    chunk = max(1, min(nk, _POSITIONS_PER_STEP // per_block))
    b_idx = jnp.arange(b_n, dtype=jnp.int32)[:, None, None, None]
    h_idx = jnp.arange(h_n, dtype=jnp.int32)[None, :, None, None]

    def tile_state(i, j):  # int8 [B|1, N|1]
        rows = i * bq + jnp.arange(bq, dtype=jnp.int32)[:, None]
        cols = j * bk + jnp.arange(bk, dtype=jnp.int32)[None, :]
        vis = apply_mask_mod(fn, consts, b_idx, h_idx, rows, cols)  # [B|1, N|1, bq, bk]
        real = (rows < t) & (cols < s)
        seen = jnp.any(vis & real, axis=(-2, -1))
        every = jnp.all(vis | ~real, axis=(-2, -1))
        return jnp.where(seen, jnp.where(every, FULL, PARTIAL), EMPTY).astype(jnp.int8)

    def query_block(i):  # [nk, B|1, N|1]
        return lax.map(lambda j: tile_state(i, j), jnp.arange(nk, dtype=jnp.int32), batch_size=chunk)

    state = lax.map(query_block, jnp.arange(nq, dtype=jnp.int32))  # [nq, nk, B|1, N|1]
    return from_dense(jnp.transpose(state, (2, 3, 0, 1)), (t, s), (bq, bk))


def check_block_mask(block_mask, batch: int, heads: int, t: int, s: int) -> BlockMask:
    """The call's block mask, checked against its shapes (ValueError/TypeError saying what)."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"block_mask must be a jax_flash.BlockMask (from create_block_mask), got {type(block_mask).__name__}"
        )
    if tuple(block_mask.seq_lengths) != (t, s):
        raise ValueError(
            f"block_mask was made for (T, S) = {tuple(block_mask.seq_lengths)}, but the call has (T, S) = ({t}, {s})"
        )
    bq, bk = block_mask.block_size
    nq, nk = -(-t // bq), -(-s // bk)
    mb, mn = block_mask.kv_num_blocks.shape[:2] if block_mask.kv_num_blocks.ndim == 3 else (-1, -1)
    if mb not in (1, batch) or mn not in (1, heads):
        raise ValueError(
            f"block_mask must have leading axes [B|1, N|1] = [{batch}|1, {heads}|1], got kv_num_blocks of shape "
            f"{tuple(block_mask.kv_num_blocks.shape)}"
        )
    want = {
        "kv_num_blocks": (mb, mn, nq),
        "kv_indices": (mb, mn, nq, nk),
        "full_kv_num_blocks": (mb, mn, nq),
        "full_kv_indices": (mb, mn, nq, nk),
        "q_num_blocks": (mb, mn, nk),
        "q_indices": (mb, mn, nk, nq),
        "full_q_num_blocks": (mb, mn, nk),
        "full_q_indices": (mb, mn, nk, nq),
    }
    for name, shape in want.items():
        x = getattr(block_mask, name)
        if tuple(x.shape) != shape:
            raise ValueError(
                f"block_mask.{name} must have shape {shape} (block_size {bq}×{bk} over T={t}, S={s}), "
                f"got {tuple(x.shape)}"
            )
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"block_mask.{name} must be an integer array, got {x.dtype}")
    return block_mask
