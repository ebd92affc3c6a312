"""Context parallelism: ring attention over one mesh axis, inside `jax.shard_map`.

Each of the P devices of mesh axis `axis_name` holds a chunk of the query sequence and a
chunk of the key/value sequence. K/V chunks travel around the ring with `lax.ppermute`
(device j sends to j + 1), so at step s device i holds the chunk of device (i - s) mod P.
Every step computes one (query chunk, key chunk) block with an ordinary implementation of
the registry (`forward(spec, q, k, v, masks)` -> out, lse) and merges it into a running
(out, lse) exactly, by log-sum-exp: the online-softmax identity of FlashAttention applied to
whole blocks (as in Liu et al., "Ring Attention with Blockwise Transformers"). The next
chunk's transfer is issued before the current block's compute, so XLA can overlap them.
Steps 1 .. P-2 run in one `lax.fori_loop`, so each device holds two K/V chunks at a time
(the one computed and the one arriving); an unrolled ring lets XLA's scheduler issue every
transfer up front and keep all P chunks alive.

Backward is one `custom_vjp` for the whole ring. It saves only the local q, k, v, out and
lse. The backward ring rotates each K/V chunk together with its dK/dV accumulators; each
step calls the implementation's backward on one block with the *final* out and lse, which
is exactly the FlashAttention-2 backward restricted to that block (P = exp(S - lse) with the
global lse, D = rowsum(dO ∘ O) with the global O). After P steps the accumulators take one
more hop, home to the device that owns the chunk. No device ever holds more than two K/V
chunks (the current one and the one arriving) and its own queries: O(T/P) memory.

Positions. Causal and window masks only need the relative offset of a block: queries that
start at global position qs against keys that start at ks are called with
`q_offset = qs - ks` (`MaskInputs.q_offset`), lengths are made chunk-local
(`clip(len - start, 0, chunk)`) and segment ids travel with their chunk.

Skipping. Where a block lies is static: for every (step, device) the schedule classifies
each block as SKIP (entirely outside the causal/window band: no compute at all), FULL
(entirely inside: no positional mask) or BAND (partly visible: the mask with its offset).
A step whose class is the same on every device runs that branch directly; otherwise the
class is read from the static table at `lax.axis_index` and `lax.switch` runs only its
branch (SPMD programs are one program, so a per-device static choice becomes a switch on
the device index). Data can also empty a block — every row past its length, or the query
and key segment-id ranges disjoint — which is checked at run time and skips the compute too.

Layouts. "contiguous": device i holds chunk i of P. "zigzag": the sequence is cut into 2P
chunks and device i holds chunks i and 2P - 1 - i (concatenated), which gives every device
the same causal work (`block_counts`); `zigzag` / `unzigzag` reorder global arrays.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any, Literal, NamedTuple, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from jax_flash import _registry
from jax_flash._merge import merge_partials
from jax_flash._normalize import canonicalize, restore, window
from jax_flash._numerics import acc_dtype
from jax_flash._spec import AttentionSpec, MaskInputs
from jax_flash._types import OutAndLse, SegmentIds, Window
from jax_flash._vjp import SECOND_ORDER_MESSAGE, is_empty

__all__ = [
    "LAYOUTS",
    "RingConfig",
    "block_counts",
    "block_specs",
    "ring_attention",
    "ring_backward",
    "ring_flash_attention",
    "ring_forward",
    "unzigzag",
    "zigzag",
]

LAYOUTS = ("contiguous", "zigzag")

# Block classes of the static schedule.
SKIP, FULL, BAND = 0, 1, 2


# ----------------------------------------------------------------------------- layouts


def _check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _zigzag_order(axis_size: int) -> list[int]:
    """Chunks of the zigzag layout in storage order: 0, 2P-1, 1, 2P-2, ..."""
    return [c for i in range(axis_size) for c in (i, 2 * axis_size - 1 - i)]


def _reorder(x, axis_size, axis, order, name):
    if not isinstance(axis_size, int) or isinstance(axis_size, bool) or axis_size < 1:
        raise ValueError(f"axis_size must be a positive int, got {axis_size!r}")
    x = jnp.asarray(x)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for an array of rank {x.ndim}")
    axis = axis % x.ndim
    n = x.shape[axis]
    if n % (2 * axis_size):
        raise ValueError(
            f"{name}: the length {n} of axis {axis} must be a multiple of 2 * axis_size = "
            f"{2 * axis_size} (shape {tuple(x.shape)})"
        )
    chunks = x.reshape(*x.shape[:axis], 2 * axis_size, n // (2 * axis_size), *x.shape[axis + 1 :])
    chunks = jnp.take(chunks, jnp.asarray(order, jnp.int32), axis=axis)
    return chunks.reshape(x.shape)


def zigzag(x: ArrayLike, axis_size: int, axis: int = 1) -> jax.Array:
    """Reorder a global array along `axis` (the sequence; default 1 = BTNH's T) into the
    zigzag layout: cut into 2·axis_size chunks, device i's shard is chunks (i, 2P-1-i).

    Sharding the result over `axis` in equal contiguous pieces (e.g. `P(None, "seq")`) gives
    device i exactly its zigzag chunks. Apply it to everything indexed by the sequence:
    q, k, v, segment ids, position ids, targets. The inverse is `unzigzag`.

    Example:

    >>> import jax.numpy as jnp
    >>> import jax_flash
    >>> x = jnp.arange(8).reshape(1, 8)  # 8 positions for 2 devices: 4 chunks of 2
    >>> jax_flash.zigzag(x, 2).tolist()  # device 0 holds chunks 0 and 3, device 1 chunks 1 and 2
    [[0, 1, 6, 7, 2, 3, 4, 5]]
    """
    return _reorder(x, axis_size, axis, _zigzag_order(axis_size), "zigzag")


def unzigzag(x: ArrayLike, axis_size: int, axis: int = 1) -> jax.Array:
    """Inverse of `zigzag`: back from the zigzag layout to sequence order along `axis`.

    Example:

    >>> import jax.numpy as jnp
    >>> import jax_flash
    >>> x = jnp.arange(8).reshape(1, 8)
    >>> bool((jax_flash.unzigzag(jax_flash.zigzag(x, 2), 2) == x).all())
    True
    """
    order = np.argsort(_zigzag_order(axis_size))
    return _reorder(x, axis_size, axis, [int(c) for c in order], "unzigzag")


# ----------------------------------------------------------------------------- schedule


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """Static description of one ring: which implementation computes each block, over which
    mesh axis of how many devices, and how the sequences are laid out on them."""

    implementation: str
    axis_name: str | tuple[str, ...]  # a tuple: the ring over those axes, major to minor
    axis_size: int
    layout: str = "contiguous"
    # A static global query offset (query t sits at key position query_offset + t): folded
    # into the static schedule. A run-time one comes as MaskInputs.q_offset instead.
    query_offset: int = 0

    @property
    def pieces(self) -> int:
        """Contiguous pieces of the sequence per device (2 for zigzag)."""
        return 2 if self.layout == "zigzag" else 1


def _piece_starts(layout: str, axis_size: int, length: int) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """(piece length, starts[piece][device]): global positions of each device's pieces of a
    sequence of global `length`."""
    if layout == "zigzag":
        c = length // (2 * axis_size)
        return c, (
            tuple(i * c for i in range(axis_size)),
            tuple((2 * axis_size - 1 - i) * c for i in range(axis_size)),
        )
    c = length // axis_size
    return c, (tuple(i * c for i in range(axis_size)),)


def _classify(spec: AttentionSpec, offset: int, tq: int, tk: int) -> int:
    """SKIP, FULL or BAND for a block of tq queries at relative offset `offset` (query t sits
    at key position offset + t) against tk keys, under the spec's window."""
    left, right = spec.window_left, spec.window_right
    # Query t sees key s iff offset - left <= s - t <= offset + right; s - t spans
    # [-(tq - 1), tk - 1] over the block.
    lo = -np.inf if left is None else offset - left
    hi = np.inf if right is None else offset + right
    if lo > tk - 1 or hi < -(tq - 1):
        return SKIP
    if lo <= -(tq - 1) and hi >= tk - 1:
        return FULL
    return BAND


class _Block(NamedTuple):
    """One (query piece, key piece) pair: its class and positions at every (step, device)."""

    q_piece: int
    k_piece: int
    kinds: np.ndarray  # [step, device] SKIP / FULL / BAND
    offsets: np.ndarray  # [step, device] q_start - k_start (relative query offset)
    q_starts: np.ndarray  # [step, device] global position of the query piece
    k_starts: np.ndarray  # [step, device] global position of the key piece


def _schedule(spec: AttentionSpec, cfg: RingConfig, dynamic_offset: bool) -> list[_Block]:
    """The static classification of every block at every ring step on every device.

    `spec` is the global (gathered) spec. At step s device i holds the key chunk of device
    (i - s) mod P. With a run-time query offset the band's place is unknown: blocks are FULL
    without a window, BAND with one.
    """
    p = cfg.axis_size
    tq, q_starts = _piece_starts(cfg.layout, p, spec.q_len)
    tk, k_starts = _piece_starts(cfg.layout, p, spec.kv_len)
    source = (np.arange(p)[None, :] - np.arange(p)[:, None]) % p  # [step, device]
    blocks = []
    for qp in range(cfg.pieces):
        for kp in range(cfg.pieces):
            qs = np.broadcast_to(np.asarray(q_starts[qp]), (p, p))
            ks = np.asarray(k_starts[kp])[source]
            offsets = qs - ks + cfg.query_offset
            if dynamic_offset:
                kinds = np.full((p, p), BAND if spec.is_windowed else FULL)
            else:
                kinds = np.vectorize(lambda d: _classify(spec, int(d), tq, tk))(offsets)
            blocks.append(_Block(qp, kp, kinds, offsets, qs, ks))
    return blocks


def block_counts(
    axis_size: int,
    *,
    layout: str = "contiguous",
    is_causal: bool = False,
    local_window_size=None,
    q_len: int | None = None,
    kv_len: int | None = None,
) -> list[int]:
    """Per device, how much attention the ring computes, in units of one
    (T / 2P) × (S / 2P) block: a contiguous block is 4 units, a zigzag piece pair 1.

    From the same static schedule `ring_attention` runs (blocks it skips are not counted;
    a partly visible block counts whole). Causal on 4 devices: contiguous [4, 8, 12, 16],
    zigzag [9, 9, 9, 9]. q_len / kv_len: global lengths (default 2P·16).
    """
    _check_layout(layout)
    p = axis_size
    q_len = 2 * p * 16 if q_len is None else q_len
    kv_len = q_len if kv_len is None else kv_len
    for name, n in (("q_len", q_len), ("kv_len", kv_len)):
        if n % (2 * p):
            raise ValueError(f"{name} must be a multiple of 2 * axis_size = {2 * p}, got {n}")
    left, right = window(local_window_size, is_causal)
    spec = AttentionSpec(
        batch=1,
        q_len=q_len,
        kv_len=kv_len,
        num_heads=1,
        num_kv_heads=1,
        head_dim=1,
        dtype="float32",
        scale=1.0,
        window_left=left,
        window_right=right,
    )
    cfg = RingConfig("xla", "_", p, layout)
    units = 4 if layout == "contiguous" else 1
    counts = np.zeros(p, np.int64)
    for blk in _schedule(spec, cfg, dynamic_offset=False):
        counts += units * np.sum(blk.kinds != SKIP, axis=0)
    return [int(c) for c in counts]


# ----------------------------------------------------------------------------- one block


class _At(NamedTuple):
    """Where in the schedule a block is computed: the steps [lo, hi) one piece of code
    serves (one step, or the steps of a loop) and the step itself (int or traced)."""

    lo: int
    hi: int
    step: Any  # an int or a traced int (None where only rows() is asked for)
    device: Any  # lax.axis_index (None there too)

    def rows(self, table: np.ndarray) -> np.ndarray:
        return table[self.lo : self.hi]

    def value(self, table: np.ndarray):
        """table[step, device]: a Python int when it is the same everywhere in [lo, hi)."""
        rows = self.rows(table)
        if (rows == rows.flat[0]).all():
            return int(rows.flat[0])
        if self.hi - self.lo == 1:
            return jnp.asarray(rows[0], jnp.int32)[self.device]
        return jnp.asarray(rows, jnp.int32)[self.step - self.lo, self.device]


def _piece(x, piece: int, size: int, axis: int = 1):
    if x is None:
        return None
    return lax.slice_in_dim(x, piece * size, (piece + 1) * size, axis=axis)


class _BlockCall(NamedTuple):
    """What an implementation needs for one block, and whether the data empties it."""

    specs: dict  # kind -> AttentionSpec of the block
    masks: dict  # kind -> MaskInputs of the block
    kind: object  # int (static) or traced int32: the class at this (step, device)
    empty: jax.Array | None  # None or a traced bool: the data makes every logit invisible


def _band_spec(local: AttentionSpec, blk: _Block, at: _At, dynamic_offset: bool):
    """The spec of the BAND blocks at `at`, and whether they need a query offset: not when
    every one of them is a diagonal block of equal chunks (offset 0)."""
    kinds, offsets = at.rows(blk.kinds), at.rows(blk.offsets)
    if not dynamic_offset and set(offsets[kinds == BAND].tolist()) <= {0}:
        return local, False
    return dataclasses.replace(local, has_q_offset=True), True


def _block_call(spec, blk: _Block, at: _At, masks: MaskInputs, q_seg, kv_seg, tq, tk):
    """The per-block specs and masks (chunk-local lengths, relative offset) of block `blk`."""
    global_offset = masks.q_offset
    q_len = kv_len = None
    empty = []
    if masks.q_lengths is not None:
        q_len = jnp.clip(masks.q_lengths - at.value(blk.q_starts), 0, tq).astype(jnp.int32)
        empty.append(jnp.all(q_len == 0))
    if masks.kv_lengths is not None:
        kv_len = jnp.clip(masks.kv_lengths - at.value(blk.k_starts), 0, tk).astype(jnp.int32)
        empty.append(jnp.all(kv_len == 0))
    if q_seg is not None:
        # Disjoint id ranges share no id: no query sees any key of the block.
        disjoint = (jnp.max(q_seg, axis=1) < jnp.min(kv_seg, axis=1)) | (
            jnp.min(q_seg, axis=1) > jnp.max(kv_seg, axis=1)
        )
        empty.append(jnp.all(disjoint))
    local = dataclasses.replace(spec, q_len=tq, kv_len=tk, has_q_offset=False)
    base = _without_offset(masks)._replace(
        q_lengths=q_len, kv_lengths=kv_len, q_segment_ids=q_seg, kv_segment_ids=kv_seg
    )
    specs, block_masks = {}, {}
    for kind in sorted(set(at.rows(blk.kinds).flat) - {SKIP}):
        if kind == FULL:
            specs[kind] = dataclasses.replace(local, window_left=None, window_right=None)
            block_masks[kind] = base
            continue
        specs[kind], needs_offset = _band_spec(local, blk, at, global_offset is not None)
        block_masks[kind] = base
        if needs_offset:
            offset = jnp.asarray(at.value(blk.offsets), jnp.int32)
            offset = jnp.broadcast_to(offset, (spec.batch,))
            if global_offset is not None:
                offset = offset + global_offset
            block_masks[kind] = base._replace(q_offset=offset)
    any_empty = None
    for e in empty:
        any_empty = e if any_empty is None else any_empty | e
    return _BlockCall(specs, block_masks, at.value(blk.kinds), any_empty)


def _without_offset(masks: MaskInputs) -> MaskInputs:
    return masks._replace(q_offset=None)


def _dispatch(call: _BlockCall, compute, skip, operands):
    """Run `compute(kind, *operands)` for this device's block class, `skip(*operands)` when
    the block is invisible: directly when the class is static, else by `lax.switch`."""
    kinds = sorted(call.specs)
    if not kinds:
        return skip(*operands)
    if isinstance(call.kind, int) and call.empty is None:
        return skip(*operands) if call.kind == SKIP else compute(call.kind, *operands)
    # Branch 0 skips; branch 1 + n computes kinds[n].
    if isinstance(call.kind, int):
        index = jnp.asarray(0 if call.kind == SKIP else 1 + kinds.index(call.kind), jnp.int32)
    else:
        table = np.zeros(BAND + 1, np.int32)
        for n, kind in enumerate(kinds):
            table[kind] = 1 + n
        index = jnp.asarray(table)[call.kind]
    if call.empty is not None:
        index = jnp.where(call.empty, 0, index)
    branches = [skip] + [functools.partial(compute, kind) for kind in kinds]
    return lax.switch(index, branches, *operands)


def _merge(o_acc, lse_acc, o, lse):
    """Exact merge of two partial softmax results over disjoint key sets (by lse).

    o [B, T, N, H], lse [B, N, T]; rows that saw nothing have lse = -inf in either part,
    and keep output 0 / lse -inf when both did (no NaN). The library's one merge
    (`_merge.merge_partials`) on the two parts, running accumulator first.
    """
    return merge_partials((o_acc, o.astype(o_acc.dtype)), (lse_acc, lse.astype(lse_acc.dtype)))


# ----------------------------------------------------------------------------- the ring


def _rotate(xs, cfg: RingConfig):
    """Send every array to the next device of the ring (j -> j + 1)."""
    p = cfg.axis_size
    perm = [(j, (j + 1) % p) for j in range(p)]
    return jax.tree.map(lambda x: lax.ppermute(x, cfg.axis_name, perm), xs)


def _sizes(spec: AttentionSpec, cfg: RingConfig) -> tuple[int, int]:
    """Query and key piece lengths of one device."""
    return spec.q_len // (cfg.axis_size * cfg.pieces), spec.kv_len // (cfg.axis_size * cfg.pieces)


def _ring_loop(cfg: RingConfig, step, kv, state, rotate_after=None):
    """Run `state = step(at, kv, state)` for the P ring steps while K/V rotate.

    The next chunk's transfer is issued before each step's compute. Step 0 and step P - 1
    are traced on their own (their block classes are usually uniform: the diagonal, the
    farthest chunk); the steps in between run in one `lax.fori_loop`, which also bounds the
    memory: each iteration holds its chunk and the one arriving, never more (an unrolled
    ring lets the scheduler issue every transfer up front and keep all P chunks alive).
    `rotate_after(state)` moves part of the state along the ring after every step (the
    backward's dK/dV accumulators).
    """
    p = cfg.axis_size
    device = lax.axis_index(cfg.axis_name)
    after = rotate_after or (lambda state: state)

    def one(lo, hi, s, kv, state, last):
        arriving = None if last else _rotate(kv, cfg)
        state = after(step(_At(lo, hi, s, device), kv, state))
        return arriving, state

    for lo, hi in _step_ranges(p):
        if hi - lo == 1:
            kv, state = one(lo, hi, lo, kv, state, last=hi == p)
        else:
            body = lambda s, carry, lo=lo, hi=hi: one(lo, hi, s, carry[0], carry[1], last=False)
            kv, state = lax.fori_loop(lo, hi, body, (kv, state))
    return state


def _pieces(x, n: int, size: int, axis: int = 1) -> tuple:
    """A device's chunk as its n contiguous pieces (None stays None)."""
    if x is None:
        return (None,) * n
    return tuple(_piece(x, i, size, axis) for i in range(n))


def ring_forward(cfg: RingConfig, spec: AttentionSpec, q, k, v, masks: MaskInputs):
    """The ring's forward on canonical local chunks (arguments as `ring_flash_attention`):
    out [B, T/P, N, Hv], lse [B, N, T/P]. Not differentiable by itself: for a partitioned
    body that pairs it with `ring_backward` in its own custom_vjp."""
    impl = _registry.get(cfg.implementation)
    tq, tk = _sizes(spec, cfg)
    acc_dt = acc_dtype(q.dtype)
    schedule = _schedule(spec, cfg, masks.q_offset is not None)
    b, _, n, _ = q.shape
    hv = v.shape[-1]  # out has the value head dim
    # Pieces are cut once: the ring moves and computes them as they are (no copies per step).
    q_p = _pieces(q, cfg.pieces, tq)
    q_seg = _pieces(masks.q_segment_ids, cfg.pieces, tq)
    kv = tuple(_pieces(x, cfg.pieces, tk) for x in (k, v, masks.kv_segment_ids))
    # Accumulators made from q keep its varying-over-the-mesh type (shard_map's check_vma).
    init = (
        tuple(jnp.zeros_like(q, acc_dt, (b, tq, n, hv)) for _ in range(cfg.pieces)),
        tuple(jnp.full_like(q, -jnp.inf, acc_dt, (b, n, tq)) for _ in range(cfg.pieces)),
    )

    def step(at, kv, state):
        o_acc, lse_acc = map(list, state)
        k_cur, v_cur, seg_cur = kv
        for blk in schedule:
            qp, kp = blk.q_piece, blk.k_piece
            call = _block_call(spec, blk, at, masks, q_seg[qp], seg_cur[kp], tq, tk)

            def compute(kind, o, lse, q_blk, k_blk, v_blk, call=call):
                ob, lb = impl.forward(call.specs[kind], q_blk, k_blk, v_blk, call.masks[kind])
                return _merge(o, lse, ob, lb)

            o_acc[qp], lse_acc[qp] = _dispatch(
                call,
                compute,
                lambda o, lse, *_: (o, lse),
                (o_acc[qp], lse_acc[qp], q_p[qp], k_cur[kp], v_cur[kp]),
            )
        return tuple(o_acc), tuple(lse_acc)

    o_acc, lse_acc = _ring_loop(cfg, step, kv, init)
    out = jnp.concatenate(o_acc, axis=1).astype(q.dtype)
    lse = jnp.concatenate(lse_acc, axis=2)
    return out, lse


def ring_backward(cfg: RingConfig, spec: AttentionSpec, q, k, v, masks, out, lse, dout, dlse):
    """The ring's backward: dq, dk, dv of this device's chunks, from the saved local q, k,
    v, out, lse and the cotangents dout [B, T/P, N, Hv], dlse [B, N, T/P]."""
    impl = _registry.get(cfg.implementation)
    tq, tk = _sizes(spec, cfg)
    acc_dt = acc_dtype(q.dtype)
    schedule = _schedule(spec, cfg, masks.q_offset is not None)
    n_p = cfg.pieces
    rows = tuple(
        zip(
            _pieces(q, n_p, tq),
            _pieces(masks.q_segment_ids, n_p, tq),
            _pieces(out, n_p, tq),
            _pieces(lse, n_p, tq, axis=2),
            _pieces(dout.astype(out.dtype), n_p, tq),
            _pieces(dlse.astype(lse.dtype), n_p, tq, axis=2),
        )
    )
    kv = tuple(_pieces(x, n_p, tk) for x in (k, v, masks.kv_segment_ids))
    zeros = lambda x, size: tuple(jnp.zeros_like(x, acc_dt, (x.shape[0], size, *x.shape[2:])) for _ in range(n_p))
    # dQ of this device's queries; dK, dV of the chunk currently held (they travel with it).
    init = (zeros(q, tq), zeros(k, tk), zeros(v, tk))

    def step(at, kv, state):
        dq_acc, dk_acc, dv_acc = map(list, state)
        k_cur, v_cur, seg_cur = kv
        for blk in schedule:
            qp, kp = blk.q_piece, blk.k_piece
            q_blk, q_seg, o_blk, l_blk, do_blk, dl_blk = rows[qp]
            call = _block_call(spec, blk, at, masks, q_seg, seg_cur[kp], tq, tk)

            def compute(kind, dq, dk, dv, q_blk, k_blk, v_blk, o_blk, l_blk, do_blk, dl_blk, call=call):
                gq, gk, gv, _ = impl.backward(
                    call.specs[kind], q_blk, k_blk, v_blk, call.masks[kind], o_blk, l_blk, do_blk, dl_blk
                )
                return dq + gq.astype(acc_dt), dk + gk.astype(acc_dt), dv + gv.astype(acc_dt)

            dq_acc[qp], dk_acc[kp], dv_acc[kp] = _dispatch(
                call,
                compute,
                lambda dq, dk, dv, *_: (dq, dk, dv),
                (dq_acc[qp], dk_acc[kp], dv_acc[kp], q_blk, k_cur[kp], v_cur[kp], o_blk, l_blk, do_blk, dl_blk),
            )
        return tuple(dq_acc), tuple(dk_acc), tuple(dv_acc)

    def carry_home(state):
        # The accumulators follow their chunk; after the last step this hop takes them home.
        dq, dk, dv = state
        return (dq, *_rotate((dk, dv), cfg))

    dq, dk, dv = _ring_loop(cfg, step, kv, init, carry_home)
    cat = lambda xs, dtype: jnp.concatenate(xs, axis=1).astype(dtype)
    return cat(dq, q.dtype), cat(dk, k.dtype), cat(dv, v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def ring_flash_attention(cfg: RingConfig, spec: AttentionSpec, q, k, v, masks: MaskInputs):
    """Ring attention on canonical local chunks, differentiable in q, k, v.

    For callers that already hold the canonical form (the sequence-sharding rule of
    `jax_flash.parallel.partitioning`): run inside a `shard_map` (or a partitioned body)
    whose mesh has axis `cfg.axis_name` of size `cfg.axis_size`.

    Args:
      cfg: the implementation, the mesh axis, the layout and a static query offset.
      spec: the canonical spec of the *gathered* call (global T and S; no bias or dense
        mask). Its window is the global one.
      q: [B, T/P, N, H], k: [B, S/P, K, H], v: [B, S/P, K, Hv]: this device's chunks in `cfg.layout`.
      masks: q_lengths / kv_lengths [B] global lengths (the same on every device),
        q_segment_ids [B, T/P] / kv_segment_ids [B, S/P] this device's chunks, and
        optionally q_offset [B], a run-time global query offset (added to
        cfg.query_offset; blocks are then classified by the window alone). spec.has_q_offset
        says whether it is there.

    Returns:
      out [B, T/P, N, Hv] (dtype of q) and lse [B, N, T/P] (float32; float64 for float64).
    """
    return _first_order_forward(cfg, spec, q, k, v, masks)


def _vjp_forward(cfg, spec, q, k, v, masks):
    out, lse = _first_order_forward(cfg, spec, q, k, v, masks)
    return (out, lse), (q, k, v, masks, out, lse)


def _vjp_backward(cfg, spec, residuals, cotangents):
    q, k, v, masks, out, lse = residuals
    dout, dlse = cotangents
    dq, dk, dv = _first_order_backward(cfg, spec, q, k, v, masks, out, lse, dout, dlse)
    return dq, dk, dv, MaskInputs()  # lengths, segment ids and offsets: no cotangent


ring_flash_attention.defvjp(_vjp_forward, _vjp_backward)


# Second derivatives, as in jax_flash._vjp: each rule's ring is a custom_jvp that refuses,
# so grad of grad, jax.hessian and jacfwd of a gradient raise the message of
# jax_flash.attention at trace time (not an FFI call's or a dynamic loop's own error).
RING_SECOND_ORDER_MESSAGE = "jax_flash.ring_attention: " + SECOND_ORDER_MESSAGE


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _first_order_forward(cfg, spec, q, k, v, masks):
    if is_empty(spec):
        # The result of jax_flash.attention for an empty call (_vjp._empty_forward), on
        # this device's chunk: out 0 and lse -inf (S = 0: no key), or empty arrays.
        stat_dt = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
        return jnp.zeros_like(q), jnp.full_like(q, -jnp.inf, stat_dt, (q.shape[0], q.shape[2], q.shape[1]))
    return ring_forward(cfg, spec, q, k, v, masks)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _first_order_backward(cfg, spec, q, k, v, masks, out, lse, dout, dlse):
    if is_empty(spec):
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
    return ring_backward(cfg, spec, q, k, v, masks, out, lse, dout, dlse)


def _second_order(cfg, spec, primals, tangents):
    raise NotImplementedError(RING_SECOND_ORDER_MESSAGE)


_first_order_forward.defjvp(_second_order)
_first_order_backward.defjvp(_second_order)


def _step_ranges(p: int) -> list[tuple[int, int]]:
    """The step ranges `_ring_loop` traces as one piece of code each."""
    ranges = [(0, 1)]
    if p > 2:
        ranges.append((1, p - 1))
    if p > 1:
        ranges.append((p - 1, p))
    return ranges


def block_specs(spec: AttentionSpec, cfg: RingConfig, dynamic_offset: bool = False):
    """The distinct per-block specs the ring hands to its implementation (for checking that
    the implementation can serve every one of them)."""
    tq, tk = _sizes(spec, cfg)
    local = dataclasses.replace(spec, q_len=tq, kv_len=tk, has_q_offset=False)
    out = []
    for blk in _schedule(spec, cfg, dynamic_offset):
        for lo, hi in _step_ranges(cfg.axis_size):
            at = _At(lo, hi, None, None)
            for kind in set(at.rows(blk.kinds).flat) - {SKIP}:
                if kind == FULL:
                    s = dataclasses.replace(local, window_left=None, window_right=None)
                else:
                    s = _band_spec(local, blk, at, dynamic_offset)[0]
                if s not in out:
                    out.append(s)
    return out


# ----------------------------------------------------------------------------- public


def _axis_size(axis_name) -> int:
    if not isinstance(axis_name, str):
        raise TypeError(f"axis_name must be the name (str) of a mesh axis, got {axis_name!r}")
    try:
        return int(lax.axis_size(axis_name))
    except (NameError, KeyError) as e:  # an axis name that is not bound here
        raise ValueError(
            f"axis_name {axis_name!r} is not an axis of the enclosing shard_map: call "
            "ring_attention inside jax.shard_map over a mesh with that axis"
        ) from e


@overload
def ring_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    axis_name: str,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: Window | None = None,
    segment_ids: SegmentIds | None = None,
    logits_soft_cap: float | None = None,
    scale: float | None = None,
    layout: str = "contiguous",
    query_offset: ArrayLike | None = None,
    return_residual: Literal[False] = False,
    implementation: str | None = None,
) -> jax.Array: ...


@overload
def ring_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    axis_name: str,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: Window | None = None,
    segment_ids: SegmentIds | None = None,
    logits_soft_cap: float | None = None,
    scale: float | None = None,
    layout: str = "contiguous",
    query_offset: ArrayLike | None = None,
    return_residual: Literal[True],
    implementation: str | None = None,
) -> OutAndLse: ...


@overload
def ring_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    axis_name: str,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: Window | None = None,
    segment_ids: SegmentIds | None = None,
    logits_soft_cap: float | None = None,
    scale: float | None = None,
    layout: str = "contiguous",
    query_offset: ArrayLike | None = None,
    return_residual: bool = False,
    implementation: str | None = None,
) -> jax.Array | OutAndLse: ...


def ring_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    axis_name: str,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: Window | None = None,
    segment_ids: SegmentIds | None = None,
    logits_soft_cap: float | None = None,
    scale: float | None = None,
    layout: str = "contiguous",
    query_offset: ArrayLike | None = None,
    return_residual: bool = False,
    implementation: str | None = None,
) -> jax.Array | OutAndLse:
    """Context-parallel attention inside `jax.shard_map`: the sequences are sharded over the
    mesh axis `axis_name` (P devices) and K/V chunks rotate around the ring.

    The result is exactly `jax_flash.attention` on the gathered arrays, sharded like the
    queries; masks use global positions (top-left causal alignment, also for T != S).

    Args:
      query: this device's chunk `[*B, T/P, N, H]` of the queries.
      key, value: this device's chunks `[*B, S/P, K, H]` and `[*B, S/P, K, Hv]` (N % K == 0;
        the value head dim Hv may differ from H).
      axis_name: the mesh axis the sequences are sharded over.
      is_causal, local_window_size, logits_soft_cap, scale: as in `jax_flash.attention`,
        in global positions.
      query_seq_lengths, key_value_seq_lengths: `[*B]` int32 *global* lengths (replicated
        over the axis, as `P()` or batch-sharded only).
      segment_ids: this device's chunk `[*B, T/P]` (self-attention) or a pair
        (q_ids `[*B, T/P]`, kv_ids `[*B, S/P]`); ids travel with their K/V chunk.
      layout: "contiguous" (device i holds chunk i of P) or "zigzag" (device i holds chunks
        i and 2P-1-i of 2P, concatenated; balances causal work — reorder global arrays with
        `jax_flash.zigzag` / `jax_flash.unzigzag`).
      query_offset: as in `jax_flash.attention`, global: query t of the gathered sequence
        sits at key position query_offset + t. A Python int keeps the static block skipping;
        an array `[*B]` is a run-time value (every block in the window is then computed).
      return_residual: also return this device's lse `[*B, T/P, N]`.
      implementation: the implementation of each block (as in `jax_flash.attention`).

    Differentiable in query, key and value by reverse mode (one custom_vjp for the ring);
    second derivatives raise NotImplementedError, as for `jax_flash.attention`. Empty inputs
    (B, T or N = 0, or S = 0) give what `jax_flash.attention` gives on the gathered arrays:
    empty arrays, or (S = 0) out 0, lse -inf and zero gradients.
    """
    _check_layout(layout)
    p = _axis_size(axis_name)
    c = canonicalize(
        query,
        key,
        value,
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        segment_ids=segment_ids,
        logits_soft_cap=logits_soft_cap,
        query_offset=query_offset,
        implementation=implementation,
        # The lengths count the global sequence: a wide length array is clipped to it.
        length_bounds=(jnp.shape(query)[-3] * p, jnp.shape(key)[-3] * p),
    )
    masks, static_offset = c.masks, 0
    if isinstance(query_offset, numbers.Integral):  # validated by canonicalize
        masks, static_offset = masks._replace(q_offset=None), int(query_offset)
    if layout == "zigzag" and (c.spec.q_len % 2 or c.spec.kv_len % 2):
        raise ValueError(
            'layout="zigzag" needs even local sequence lengths (two chunks per device), got '
            f"query {tuple(c.q.shape)} and key {tuple(c.k.shape)}"
        )
    spec = dataclasses.replace(
        c.spec,
        q_len=c.spec.q_len * p,
        kv_len=c.spec.kv_len * p,
        has_q_offset=masks.q_offset is not None,
    )
    cfg = RingConfig("xla", axis_name, p, layout, static_offset)
    if not is_empty(spec):  # (empty: no block to run, the result is computed directly)
        cfg = dataclasses.replace(cfg, implementation=_select(spec, cfg, implementation))
    elif implementation is not None:  # still a call that implementation must be able to make
        why = _registry.reason(implementation, c.spec)
        if why is not None:
            raise ValueError(f'implementation="{implementation}" cannot run this ring: {why}')
    out, lse = ring_flash_attention(cfg, spec, c.q, c.k, c.v, masks)
    out, lse = restore(c, out, lse)
    return (out, lse) if return_residual else out


def _select(spec: AttentionSpec, cfg: RingConfig, requested: str | None) -> str:
    """The implementation that can serve every block spec of the ring: the requested one
    (or ValueError saying why not), else the first of this platform's preference order."""
    specs = block_specs(spec, cfg, spec.has_q_offset) or [
        dataclasses.replace(spec, q_len=_sizes(spec, cfg)[0], kv_len=_sizes(spec, cfg)[1])
    ]  # nothing visible at all: no block is computed, any implementation will do

    def why_not(name):
        for s in specs:
            why = _registry.reason(name, s)
            if why is not None:
                return why
        return None

    if requested is not None:
        why = why_not(requested)
        if why is not None:
            raise ValueError(f'implementation="{requested}" cannot run a block of this ring: {why}')
        return requested
    reasons = {}
    for name in _registry.preference():
        reasons[name] = why_not(name)
        if reasons[name] is None:
            return name
    raise ValueError(f"no implementation can run the blocks of this ring: {reasons}")
