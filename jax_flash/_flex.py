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

The compiled kernels (`cpu`, `cuda`) cannot run a user function: for them the mask_mod of the partly visible
blocks is evaluated by XLA beforehand, one bit per position (`block_operands`), for at most
`partial_capacity` blocks (a static number: the shape of the bits).
"""

from __future__ import annotations

import dataclasses
import math
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
    # The block mask's partial_capacity (BlockMask): the partly visible blocks whose mask_mod
    # bits the compiled kernels (cpu, cuda) get.
    partial_capacity: int | None = None

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

    `partial_capacity` (static) bounds the number of partly visible blocks over all [B|1, N|1]
    rows: the `cpu` and `cuda` kernels receive mask_mod's bits for that many blocks (block_q·block_k/8
    bytes each; at most every block, B|1·N|1·T·S/8 bytes). None: every block. A call on `cpu` or `cuda`
    whose block mask has more partly visible blocks than its capacity gives NaN (out and lse)
    in the rows of the query blocks of the blocks past it (in (b, h, query block, key block)
    order); the other implementations do not read it.
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
    partial_capacity: int | None = dataclasses.field(metadata=dict(static=True), default=None)

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

    def num_partial(self) -> jax.Array:
        """The number of partly visible (b, h, query block, key block) (int32): at most
        `capacity` for the cpu and cuda kernels to see them all."""
        return jnp.sum(self.kv_num_blocks)

    @property
    def capacity(self) -> int:
        """partial_capacity, None read as every block: B|1·N|1·nq·nk."""
        if self.partial_capacity is None:
            return math.prod(self.shape)
        return int(self.partial_capacity)


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


def _capacity(x: object, name: str = "partial_capacity") -> int | None:
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or int(x) < 0:
        raise ValueError(f"{name} must be None (every block) or an int >= 0, got {x!r}")
    return int(x)


def from_dense(
    state, seq_lengths: tuple[int, int], block_size: tuple[int, int], partial_capacity: int | None = None
) -> BlockMask:
    """A BlockMask from its int [B|1, N|1, nq, nk] states (0 empty, 1 partial, 2 full).

    partial_capacity None: the exact number of partly visible blocks when the states are
    concrete (not traced), else every block (B|1·N|1·nq·nk)."""
    state = jnp.asarray(state)
    partial, full = state == PARTIAL, state == FULL
    capacity = _capacity(partial_capacity)
    if capacity is None:
        concrete = not isinstance(state, jax.core.Tracer)
        capacity = int(jnp.sum(partial)) if concrete else math.prod(state.shape)
    kv_n, kv_i = ordered(partial)
    fkv_n, fkv_i = ordered(full)
    q_n, q_i = ordered(jnp.swapaxes(partial, -1, -2))
    fq_n, fq_i = ordered(jnp.swapaxes(full, -1, -2))
    t, s = seq_lengths
    bq, bk = block_size
    return BlockMask(kv_n, kv_i, fkv_n, fkv_i, q_n, q_i, fq_n, fq_i, (int(t), int(s)), (int(bq), int(bk)), capacity)


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
    partial_capacity: int | None = None,
) -> BlockMask:
    """The `BlockMask` of `mask_mod(b, h, q_idx, kv_idx) -> bool` for B batch rows, N query
    heads, T queries and S keys (B or N None: one row / head shared by all, mask_mod then
    called with b = 0 / h = 0), in blocks of `block_size` (an int, or (block_q, block_k)).

    `partial_capacity`: how many partly visible blocks the `cpu` and `cuda` kernels get mask_mod's bits
    for (static, it sizes their input: block_q·block_k/8 bytes a block). None: the exact
    count where the mask is computed eagerly, else (under jit, where the count is traced)
    every block, B|1·N|1·nq·nk: T·S/8 bytes per [B|1, N|1] row; give a bound to spend less.
    A cpu or cuda call with more partly visible blocks than that gives NaN in their query blocks'
    rows (never a silently wrong result).

    Evaluated by XLA one query block at a time, a bounded number of key blocks per step
    (never the whole T×S); jit-able (B, N, T, S, block_size and partial_capacity static)."""
    capacity = _capacity(partial_capacity)
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
    return from_dense(jnp.transpose(state, (2, 3, 0, 1)), (t, s), (bq, bk), capacity)


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
    _capacity(block_mask.partial_capacity, "block_mask.partial_capacity")
    return block_mask


# ---------------------------------------------------------------------------------------
# The compiled kernels' operands (cpu, cuda; cuda/ffi/boundary.h MaskOperands: block_states,
# block_slots, block_bits; attributes block_q, block_k)


def uses_index(fn: ClosedFunction, position: int) -> bool:
    """Whether the mask_mod reads its argument `position` (0: b, 1: h) at all: a mask the same
    for every batch row (head) needs its bits once, not once per row (head)."""
    var = fn.jaxpr.invars[position]
    for eqn in fn.jaxpr.eqns:
        if any(v is var for v in eqn.invars):
            return True
    return any(v is var for v in fn.jaxpr.outvars)


def kernel_blocks(spec) -> tuple[tuple[int, int], tuple[int, int], int]:
    """((block_q, block_k), (Bm, Nm), P) of the bits the compiled kernels get for a flex call with a
    mask_mod: the block mask's blocks, its [B|1, N|1] rows widened to B (N) where the
    mask_mod reads b (h) (its bits then differ per row), and its capacity times that widening.
    Without a block mask: DEFAULT_BLOCK_SIZE blocks (the kernels' tiles; at most T x S), every
    one partly visible, so P = Bm·Nm·nq·nk and the bits are about Bm·Nm·T·S/8 bytes."""
    flex = spec.flex
    assert flex is not None and flex.mask_mod is not None
    bm = spec.batch if uses_index(flex.mask_mod, 0) else 1
    nm = spec.num_heads if uses_index(flex.mask_mod, 1) else 1
    if flex.block_size is None:
        bq, bk = min(DEFAULT_BLOCK_SIZE, spec.q_len), min(DEFAULT_BLOCK_SIZE, spec.kv_len)
        nq, nk = -(-spec.q_len // bq), -(-spec.kv_len // bk)
        return (bq, bk), (bm, nm), bm * nm * nq * nk
    mb, mn = flex.block_batch_heads or (1, 1)
    rows_b, rows_n = max(mb, bm), max(mn, nm)
    widening = (rows_b // mb) * (rows_n // mn)
    nq, nk = -(-spec.q_len // flex.block_size[0]), -(-spec.kv_len // flex.block_size[1])
    capacity = mb * mn * nq * nk if flex.partial_capacity is None else flex.partial_capacity
    return flex.block_size, (rows_b, rows_n), capacity * widening


def score_mod_reason(name: str) -> str:
    """Why a flex_attention call with a score_mod is not the compiled kernels' (cpu, cuda)."""
    return (
        f"{name} serves flex_attention's mask_mod and block masks; a score_mod needs the user function "
        "inside the tile: implementation='xla' or 'pallas' run it"
    )


def kernel_description(spec, tiles: str, unmasked: str, verbose: bool) -> str:
    """`explain`'s words for a flex_attention call with a mask_mod on the compiled kernels (cpu,
    cuda), whose tiles are `tiles` and which run `unmasked` what full blocks cover: the blocks
    they read and (verbose) the capacity and bytes of mask_mod's bits."""
    (bq, bk), (bm, nm), capacity = kernel_blocks(spec)
    flex = spec.flex
    assert flex is not None
    if flex.block_size is None:
        text = (
            f"flex: no block_mask, every {bq}x{bk} block partly visible (mask_mod's bits at every "
            "position, T·S/8 bytes per batch row and head it reads; create_block_mask skips the empty blocks)"
        )
    else:
        text = (
            f"flex: the block mask's {bq}x{bk} blocks decide which {tiles} run (skipped where all empty, "
            f"{unmasked}), mask_mod's bits elsewhere"
        )
    if verbose:
        text += (
            f"; bits of up to {capacity} partly visible blocks ([{bm}, {nm}] rows of blocks, partial_capacity), "
            f"{bits_bytes(spec)} bytes, evaluated by XLA before the kernels"
        )
    return text


def bits_bytes(spec) -> int:
    """The bytes of the compiled kernels' packed bits for a flex call with a mask_mod."""
    (bq, bk), _, capacity = kernel_blocks(spec)
    return capacity * bq * (-(-bk // 32)) * 4


def block_operands(spec, masks) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(block_states s8 [Bm, Nm, nq, nk], block_slots s32 [Bm, Nm, nq, nk], block_bits u32 [P,
    block_q, ceil(block_k / 32)]) of a flex call with a mask_mod (`kernel_blocks`).

    The bits are mask_mod evaluated by XLA at the positions of the partly visible blocks only,
    a bounded number of blocks per step (`lax.map`), never the whole T×S; positions past T or
    S are 0. The first P partly visible blocks in (b, h, i, j) order get slots 0..P-1; any past
    P keep their state with slot -1, which the kernels turn into NaN rows."""
    flex = spec.flex
    (bq, bk), (bm, nm), capacity = kernel_blocks(spec)
    t, s = spec.q_len, spec.kv_len
    nq, nk = -(-t // bq), -(-s // bk)
    if masks.block_mask is None:
        states = jnp.full((bm, nm, nq, nk), PARTIAL, jnp.int8)
    else:
        states = jnp.broadcast_to(masks.block_mask.to_dense(), (bm, nm, nq, nk)).astype(jnp.int8)
    partial = (states == PARTIAL).reshape(-1)
    rank = jnp.cumsum(partial, dtype=jnp.int32) - 1
    slots = jnp.where(partial & (rank < capacity), rank, -1).reshape(states.shape).astype(jnp.int32)
    words = -(-bk // 32)
    if capacity == 0:
        return states, slots, jnp.zeros((0, bq, words), jnp.uint32)
    (flat,) = jnp.nonzero(partial, size=capacity, fill_value=0)
    b_i, h_i, q_i, k_i = (x.astype(jnp.int32) for x in jnp.unravel_index(flat, states.shape))
    consts = masks.mask_consts or ()
    rows = jnp.arange(bq, dtype=jnp.int32)[:, None]
    cols = jnp.arange(words * 32, dtype=jnp.int32)[None, :]
    shifts = jnp.arange(32, dtype=jnp.uint32)

    def block_bits(index):  # u32 [bq, words]
        b, h, i, j = index
        q_idx, kv_idx = i * bq + rows, j * bk + cols
        vis = apply_mask_mod(flex.mask_mod, consts, b, h, q_idx, kv_idx)
        vis = vis & (q_idx < t) & (kv_idx < s) & (cols < bk)
        return jnp.sum(vis.reshape(bq, words, 32).astype(jnp.uint32) << shifts, axis=-1, dtype=jnp.uint32)

    chunk = max(1, min(capacity, _POSITIONS_PER_STEP // (bq * words * 32)))
    bits = lax.map(block_bits, (b_i, h_i, q_i, k_i), batch_size=chunk)
    return states, slots, bits
