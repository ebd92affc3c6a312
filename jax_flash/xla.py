"""The `xla` implementation: blockwise online-softmax attention in pure JAX.

Runs wherever XLA runs. Forward (FlashAttention-2, Alg. 1): for each query block, walk the
key blocks it can see, keeping the running row max m, running sum l and an unnormalised
float32 output accumulator; rescale by exp(m_old - m_new) when the max grows and divide by
l once at the end. Backward (Alg. 2): for each key block, walk the query blocks that can
see it, recompute P = exp(S - lse) tile by tile and accumulate dK, dV for the block while
dQ accumulates across key blocks. Memory is O(T·block); the T×S matrix never exists.

Non-finite inputs (docs/numerical-contract.md): a raw score q·k that is ±inf becomes
NaN; a NaN score reaches p = exp(NaN), l and the accumulator even where the row max drops
it (XLA's CPU reductions may), and a row is empty only when l == 0, so a poisoned row is
NaN, never 0. The products that meet masked (zero) weights run over finite
copies of the operands (V for the forward, Q and K for dK and dQ) so that a masked-out
poisoned key or query never reaches anything through 0·NaN; a row that sees a non-finite
v is made NaN by a per-key flag instead. Exponents are clamped to <= 0 (P <= 1): XLA may
evaluate the scaled logit once for the row max and again, fused into an FMA, for the exp;
at logits ~1e9 the two differ by more than 1 and exp(x - max) overflowed.

Key blocks entirely outside a causal/window band are never visited (the inner loop has
per-block bounds), so causal at T == S costs about half of full attention. With per-row
query offsets one loop serves the whole batch, so it visits the union of the rows' bands.

The forward's key blocks may come from a caller (`kv_blocks`: `paged_forward` reads them
through a paged cache's page table); its online-softmax step and NaN/±inf rules are the shared
ones of `jax_flash._numerics` (the Pallas kernels use them too). Few-query, long-key calls
may run split-KV (`jax_flash.inference.split_kv`, around `forward`), by a rule `explain`
states in this implementation's note.

flex_attention (`AttentionSpec.flex`): the tiles are the block mask's blocks, and each query
block walks only the key blocks that some (batch row, head) sees, in ascending order (the
backward: each key block the query blocks that see it). One tile serves every batch row and
head, so with a per-row or per-head block mask the tiles run are the union over rows and
heads of the non-empty blocks. A block fully visible to every row and head skips mask_mod
(a `lax.cond`); score_mod is traced into the tile, and the backward differentiates it there
(`jax.vjp` of the tile's score_mod: the score's and the closed-over floats' cotangents), so
nothing T×S is stored or formed. `count_tiles` counts the tiles run (a debug counter).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax import lax

from jax_flash import _dropout, _flex, _heuristics, _masking, _registry
from jax_flash._merge import merge_partials
from jax_flash._numerics import (
    acc_dtype,
    clamp_exponent,
    finite_part,
    full,
    nonfinite_rows,
    online_softmax_finish,
    online_softmax_init,
    online_softmax_step,
    pad_axis,
    poison_infinite,
    round_up,
)
from jax_flash._paged_spec import PagedSpec
from jax_flash._spec import AttentionSpec, MaskInputs
from jax_flash.inference import split_kv

# Tile sizes: large enough that each step is a few hundred MFLOPs of dense matmul.
BLOCK_Q = 512
BLOCK_K = 512


def _blocks(length: int, block: int) -> tuple[int, int]:
    """(block size, number of blocks): small inputs get one block rounded up to 8."""
    block = min(block, round_up(length, 8))
    return block, -(-length // block)


def _tile_sizes(spec: AttentionSpec, t: int, s: int, block_q: int, block_k: int) -> tuple[int, int, int, int]:
    """(bq, nq, bk, nk): a flex call with a block mask runs its blocks as tiles."""
    if spec.flex is not None and spec.flex.block_size is not None:
        bq, bk = spec.flex.block_size
        return bq, -(-t // bq), bk, -(-s // bk)
    return (*_blocks(t, block_q), *_blocks(s, block_k))


def _index(*xs):
    """Start indices of one dynamic_slice, all int32 (also when x64 is enabled)."""
    return tuple(jnp.asarray(x, jnp.int32) for x in xs)


class _Tiles:
    """Slices of the canonical inputs for tile (query block i, key block j)."""

    def __init__(self, spec: AttentionSpec, masks: MaskInputs, bq: int, nq: int, bk: int, nk: int):
        self.spec, self.bq, self.bk = spec, bq, bk
        self.t_pad, self.s_pad = bq * nq, bk * nk
        self.flex = None if spec.flex is None else _FlexTiles(spec, masks, bq, nq, bk, nk)
        self.masks = masks._replace(
            bias=self._pad_dense(masks.bias, 0),
            mask=self._pad_dense(masks.mask, False),
            q_segment_ids=None if masks.q_segment_ids is None else pad_axis(masks.q_segment_ids, 1, self.t_pad),
            kv_segment_ids=None if masks.kv_segment_ids is None else pad_axis(masks.kv_segment_ids, 1, self.s_pad),
        )
        # The causal/window band of every batch row, shaped [B|1, 1, 1, 1, 1] like a tile.
        q_offset = 0 if masks.q_offset is None else masks.q_offset[:, None, None, None, None]
        self.band = spec.band(q_offset)

    def _pad_dense(self, x, value):
        if x is None:
            return None
        if x.shape[2] != 1:
            x = pad_axis(x, 2, self.t_pad, value)
        if x.shape[3] != 1:
            x = pad_axis(x, 3, self.s_pad, value)
        return x

    def dense_tile(self, x, i, j):
        """[B|1, N|1, T|1, S|1] -> [B|1, K|1, G|1, bq|1, bk|1] for query block i, key block j."""
        if x is None:
            return None
        spec = self.spec
        rows = self.bq if x.shape[2] != 1 else 1
        cols = self.bk if x.shape[3] != 1 else 1
        tile = lax.dynamic_slice(
            x,
            _index(0, 0, i * self.bq if rows != 1 else 0, j * self.bk if cols != 1 else 0),
            (x.shape[0], x.shape[1], rows, cols),
        )
        if x.shape[1] == 1:
            return tile[:, :, None]
        return tile.reshape(x.shape[0], spec.num_kv_heads, spec.group_size, rows, cols)

    def visibility(self, i, j):
        """Bool [B|1, 1|K, 1|G, bq, bk] or None: which keys of block j queries of block i see."""
        if self.flex is not None:
            return self.flex.visibility(i, j)
        spec, m = self.spec, self.masks
        rows = (i * self.bq + jnp.arange(self.bq, dtype=jnp.int32))[:, None]
        cols = (j * self.bk + jnp.arange(self.bk, dtype=jnp.int32))[None, :]
        per_b = lambda x: None if x is None else x[:, None, None, None, None]
        q_seg = kv_seg = None
        if m.q_segment_ids is not None:
            assert m.kv_segment_ids is not None  # segment ids come in pairs
            q_seg = lax.dynamic_slice_in_dim(m.q_segment_ids, i * self.bq, self.bq, axis=1)
            kv_seg = lax.dynamic_slice_in_dim(m.kv_segment_ids, j * self.bk, self.bk, axis=1)
            q_seg = q_seg[:, None, None, :, None]
            kv_seg = kv_seg[:, None, None, None, :]
        vis = _masking.visible(
            spec,
            rows,
            cols,
            q_lengths=per_b(m.q_lengths),
            kv_lengths=per_b(m.kv_lengths),
            q_segment_ids=q_seg,
            kv_segment_ids=kv_seg,
            kv_limit=spec.kv_len if self.s_pad != spec.kv_len else None,
            band=self.band,
        )
        dense = self.dense_tile(m.mask, i, j)
        if dense is not None:
            vis = dense if vis is None else vis & dense
        return vis

    def dropout_keep(self, i, j):
        """Bool [B, K, G, bq, bk]: the dropout keep bits of tile (i, j) (`_dropout`: global
        batch, query head n = k·G + g, row and column; bk is a multiple of 8, so the tile
        holds whole groups of 4 columns), or None without dropout."""
        spec = self.spec
        if not spec.has_dropout:
            return None
        kh, g = spec.num_kv_heads, spec.group_size
        batch = jnp.arange(spec.batch, dtype=jnp.uint32)[:, None, None, None]
        head = jnp.arange(kh, dtype=jnp.uint32)[:, None] * g + jnp.arange(g, dtype=jnp.uint32)
        rows = jnp.asarray(i, jnp.uint32) * self.bq + jnp.arange(self.bq, dtype=jnp.uint32)
        return _dropout.keep_mask_groups(
            self.masks.dropout_seed,
            spec.dropout_rate,
            batch,
            head[None, :, :, None],
            rows,
            jnp.asarray(j, jnp.int32) * self.bk,
            self.bk,
        )

    def logits(self, q_blk, k_blk, i, j, acc_dt):
        """Scaled, biased, soft-capped logits [B, K, G, bq, bk] (before masking)."""
        s = jnp.einsum("bqkgh,bskh->bkgqs", q_blk, k_blk, preferred_element_type=acc_dt)
        s = poison_infinite(s) * jnp.asarray(self.spec.scale, acc_dt)
        return _masking.transform_logits(self.spec, s, self.dense_tile(self.masks.bias, i, j))


class _FlexTiles:
    """The block schedule and the user functions of a flex_attention call, tile by tile."""

    def __init__(self, spec: AttentionSpec, masks: MaskInputs, bq: int, nq: int, bk: int, nk: int):
        flex = spec.flex
        assert flex is not None
        self.spec, self.flex, self.bq, self.bk = spec, flex, bq, bk
        self.s_pad = bk * nk
        self.score_consts = masks.score_consts or ()
        self.mask_consts = masks.mask_consts or ()
        if masks.block_mask is not None:
            self.state = masks.block_mask.to_dense()  # [Bm, Nm, nq, nk]
        else:  # no block mask: every block partly visible (mask_mod) or fully visible
            every = _flex.PARTIAL if flex.mask_mod is not None else _flex.FULL
            self.state = jnp.full((1, 1, nq, nk), every, jnp.int8)
        # The one schedule of all rows and heads: a block runs when some (b, h) sees into it,
        # and evaluates mask_mod only when some (b, h) sees it partly.
        nonempty = jnp.any(self.state != _flex.EMPTY, axis=(0, 1))  # [nq, nk]
        self.any_partial = jnp.any(self.state == _flex.PARTIAL, axis=(0, 1))
        self.kv_count, self.kv_order = _flex.ordered(nonempty)  # per query block
        self.q_count, self.q_order = _flex.ordered(nonempty.T)  # per key block
        b, kh, g = spec.batch, spec.num_kv_heads, spec.group_size
        self.b_idx = jnp.arange(b, dtype=jnp.int32)[:, None, None, None, None]
        self.h_idx = (jnp.arange(kh, dtype=jnp.int32)[:, None] * g + jnp.arange(g, dtype=jnp.int32))[
            None, :, :, None, None
        ]

    def positions(self, i, j):
        rows = (i * self.bq + jnp.arange(self.bq, dtype=jnp.int32))[:, None]
        cols = (j * self.bk + jnp.arange(self.bk, dtype=jnp.int32))[None, :]
        return rows, cols

    def block_state(self, i, j):
        """int8 [Bm, K|1, G|1, 1, 1]: the block's state for each (b, h) of the block mask."""
        st = lax.dynamic_slice(self.state, _index(0, 0, i, j), (*self.state.shape[:2], 1, 1))
        bm, nm = self.state.shape[:2]
        spec = self.spec
        if nm == 1:
            return st[:, :, None]
        return st.reshape(bm, spec.num_kv_heads, spec.group_size, 1, 1)

    def visibility(self, i, j):
        """Bool [B|1, K|1, G|1, bq, bk] or None (everything visible)."""
        spec = self.spec
        rows, cols = self.positions(i, j)
        limit = cols < spec.kv_len if self.s_pad != spec.kv_len else None  # a ragged last key block
        mask_mod = self.flex.mask_mod
        if mask_mod is None:
            vis = None
        else:
            shape = (spec.batch, spec.num_kv_heads, spec.group_size, self.bq, self.bk)
            st = self.block_state(i, j)

            def evaluate():
                _record("mask_mod")
                vis = _flex.apply_mask_mod(mask_mod, self.mask_consts, self.b_idx, self.h_idx, rows, cols)
                return (st == _flex.FULL) | ((st == _flex.PARTIAL) & vis)

            # A block that every row and head sees whole or not at all skips mask_mod.
            vis = lax.cond(self.any_partial[i, j], evaluate, lambda: jnp.broadcast_to(st == _flex.FULL, shape))
        if limit is not None:
            vis = limit if vis is None else vis & limit
        return vis

    def score(self, raw, vis, i, j, consts=None):
        """score_mod of the scaled logits of tile (i, j) (masked ones enter as 0, so that a
        masked NaN never reaches a derivative); `consts`: the score_mod's closed-over arrays
        (default: the call's)."""
        score_mod = self.flex.score_mod
        if score_mod is None:
            return raw
        rows, cols = self.positions(i, j)
        if vis is not None:
            raw = jnp.where(vis, raw, jnp.zeros((), raw.dtype))
        consts = self.score_consts if consts is None else consts
        return _flex.apply_score_mod(score_mod, consts, raw, self.b_idx, self.h_idx, rows, cols)


class TileCounter:
    """Tiles run by the xla implementation while counting (`count_tiles`): `forward` and
    `backward` tiles of Q·Kᵀ, and `mask_mod` tiles (those that evaluated a flex mask_mod)."""

    def __init__(self) -> None:
        self.forward = 0
        self.backward = 0
        self.mask_mod = 0


_COUNTERS: list[TileCounter] = []


@contextlib.contextmanager
def count_tiles() -> Iterator[TileCounter]:
    """A debug counter of the tiles the xla implementation runs: calls traced inside this
    block count each tile they run (host callbacks, so it costs time: tests and debugging
    only). Calls traced outside it (a jit cache hit) count nothing."""
    counter = TileCounter()
    _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _COUNTERS.remove(counter)


def _bump(kind: str) -> None:
    for counter in _COUNTERS:
        setattr(counter, kind, getattr(counter, kind) + 1)


def _record(kind: str) -> None:
    """Counts one tile of `kind` at run time, when traced inside `count_tiles`."""
    if _COUNTERS:
        jax.debug.callback(functools.partial(_bump, kind))


def _split_heads(x, spec: AttentionSpec):
    """[B, L, N, H] -> [B, L, K, G, H]: query head n = k·G + g uses kv head k."""
    b, l, _, h = x.shape
    return x.reshape(b, l, spec.num_kv_heads, spec.group_size, h)


def forward(
    spec: AttentionSpec,
    q,
    k,
    v,
    masks: MaskInputs,
    block_q=BLOCK_Q,
    block_k=BLOCK_K,
    *,
    kv_blocks=None,
    out_dtype=None,
):
    """out [B, T, N, Hv] (dtype of q), lse [B, N, T] (float32; float64 for float64 inputs).
    masks.sinks, when given, is the online softmax's initial state (`sink_state`).

    kv_blocks: None (k [B, S, K, H] and v [B, S, K, Hv] arrays), or (bk, fetch) where fetch(j)
    returns (k_blk [B, bk, K, H], v_blk [B, bk, K, Hv] with v_blk finite, bad_v [B, K, 1, 1, bk] (the keys whose v
    row is non-finite), vis: bool broadcastable to [B, 1, 1, 1, bk] or None): key block j =
    keys [j·bk, (j+1)·bk) read by the caller (a paged cache reads them through its page
    table); k and v are then None. out_dtype: the dtype of out (default q's; the accumulator
    dtype keeps a partial result exact for a later merge by lse)."""
    b, t, n, _ = q.shape
    hv = spec.v_head_dim
    s = spec.kv_len
    kh, g = spec.num_kv_heads, spec.group_size
    acc_dt = acc_dtype(q.dtype)
    out_dtype = q.dtype if out_dtype is None else out_dtype
    bq, nq, bk, nk = _tile_sizes(spec, t, s, block_q, block_k)
    if kv_blocks is not None:
        bk, fetch = kv_blocks
        nk = -(-s // bk)
    tiles = _Tiles(spec, masks, bq, nq, bk, nk)
    qp = _split_heads(pad_axis(q, 1, tiles.t_pad), spec)
    if kv_blocks is None:
        kp = pad_axis(k, 1, tiles.s_pad)
        vp = pad_axis(finite_part(v), 1, tiles.s_pad)
        bad_v = pad_axis(nonfinite_rows(v), 1, tiles.s_pad, False)  # [B, S_pad, K]

        def fetch(j):
            k_blk = lax.dynamic_slice_in_dim(kp, j * bk, bk, axis=1)  # [B, bk, K, H]
            v_blk = lax.dynamic_slice_in_dim(vp, j * bk, bk, axis=1)
            bad_v_blk = lax.dynamic_slice_in_dim(bad_v, j * bk, bk, axis=1)  # [B, bk, K]
            return k_blk, v_blk, jnp.transpose(bad_v_blk, (0, 2, 1))[:, :, None, None, :], None

    like = tuple(x for x in (q, k, v) if x is not None)
    q_offset = 0 if masks.q_offset is None else masks.q_offset  # key blocks: union over B
    # Sinks: the online softmax starts from the sink's state (m = sink, l = 1), [1, K, G, 1].
    sink = None if masks.sinks is None else masks.sinks.reshape(1, kh, g, 1)

    def query_block(i):
        q_blk = lax.dynamic_slice_in_dim(qp, i * bq, bq, axis=1)  # [B, bq, K, G, H]

        def key_block(j, carry):
            k_blk, v_blk, bad_v_blk, fetched_vis = fetch(j)
            logits = tiles.logits(q_blk, k_blk, i, j, acc_dt)
            vis = tiles.visibility(i, j)
            if tiles.flex is not None:
                _record("forward")
                logits = tiles.flex.score(logits, vis, i, j)
            if fetched_vis is not None:
                vis = fetched_vis if vis is None else vis & fetched_vis
            keep = tiles.dropout_keep(i, j)
            return online_softmax_step(carry, logits, vis, v_blk, bad_v_blk, keep=keep)

        init = online_softmax_init((b, kh, g, bq), hv, acc_dt, *like, sink=sink)
        if tiles.flex is not None:  # the key blocks some row or head of query block i sees
            fx = tiles.flex
            carry = lax.fori_loop(0, fx.kv_count[i], lambda jj, c: key_block(fx.kv_order[i, jj], c), init)
        else:
            lo, hi = spec.key_block_range(i * bq, (i + 1) * bq, bk, nk, q_offset)
            carry = lax.fori_loop(lo, jnp.maximum(lo, hi), key_block, init)
        out, lse = online_softmax_finish(carry)
        if spec.has_dropout:
            out = out * _dropout.keep_scale(spec.dropout_rate, acc_dt)
        return out.astype(out_dtype), lse

    out, lse = lax.map(query_block, jnp.arange(nq, dtype=jnp.int32))
    # out: [nq, B, K, G, bq, Hv] -> [B, T, N, Hv];  lse: [nq, B, K, G, bq] -> [B, N, T]
    out = jnp.transpose(out, (1, 0, 4, 2, 3, 5)).reshape(b, tiles.t_pad, n, hv)[:, :t]
    lse = jnp.transpose(lse, (1, 2, 3, 0, 4)).reshape(b, n, tiles.t_pad)[:, :, :t]
    return out, lse


def backward(
    spec: AttentionSpec,
    q,
    k,
    v,
    masks: MaskInputs,
    out,
    lse,
    dout,
    dlse,
    block_q=BLOCK_Q,
    block_k=BLOCK_K,
):
    """dq, dk, dv (input dtypes) and dbias (shape of masks.bias, or None); a flex call adds
    a fifth result: the cotangents of its score_mod's closed-over arrays (None for those that
    are not floating)."""
    b, t, n, h = q.shape
    s, hv = k.shape[1], v.shape[-1]
    kh, g = spec.num_kv_heads, spec.group_size
    acc_dt = acc_dtype(q.dtype)
    bq, nq, bk, nk = _tile_sizes(spec, t, s, block_q, block_k)
    tiles = _Tiles(spec, masks, bq, nq, bk, nk)
    qp = _split_heads(pad_axis(q, 1, tiles.t_pad), spec)
    dop = _split_heads(pad_axis(dout, 1, tiles.t_pad), spec)
    kp = pad_axis(k, 1, tiles.s_pad)
    vp = pad_axis(v, 1, tiles.s_pad)
    # dQ = dS·K and dK = dSᵀ·Q also multiply masked (zero) dS: over finite copies, so that
    # a poisoned key/query reaches only what sees it (through dS, which is NaN there).
    qcp = _split_heads(pad_axis(finite_part(q), 1, tiles.t_pad), spec)
    kcp = pad_axis(finite_part(k), 1, tiles.s_pad)
    q_offset = 0 if masks.q_offset is None else masks.q_offset  # query blocks: union over B

    def per_row(x):  # [B, N, T] -> [B, K, G, T_pad]
        return pad_axis(x.astype(acc_dt), 2, tiles.t_pad).reshape(b, kh, g, tiles.t_pad)

    # D = rowsum(dO ∘ O) (FlashAttention-2 §3.2); the lse cotangent enters as
    # d lse / d logit = P, i.e. it shifts D by -dlse.
    delta = jnp.einsum("btnh,btnh->bnt", dout.astype(acc_dt), out.astype(acc_dt)) - dlse
    delta = per_row(delta)
    # Rows that see nothing have lse = -inf; their P is 0 via the mask below. A NaN lse (a
    # poisoned row) stays NaN.
    lse = per_row(lse)
    seen = lse != -jnp.inf
    lse_safe = jnp.where(seen, lse, 0)

    bias = tiles.masks.bias
    dbias0 = None if bias is None else full(bias.shape, 0, acc_dt, q, k, v, dout)
    cdt = q.dtype  # matmul operand dtype for P and dS, as the kernels use
    drop_scale = _dropout.keep_scale(spec.dropout_rate, acc_dt) if spec.has_dropout else None
    # flex: the score_mod's floating closed-over arrays are differentiated tile by tile.
    score_consts = list(masks.score_consts or ())
    diff, _ = _flex.split_float(score_consts)
    dconsts0 = tuple(full(score_consts[c].shape, 0, score_consts[c].dtype, q, k, v, dout) for c in diff)

    def score_with(raw, vis, i, j, diff_consts):
        assert tiles.flex is not None
        consts = list(score_consts)
        for c, x in zip(diff, diff_consts):
            consts[c] = x
        return tiles.flex.score(raw, vis, i, j, tuple(consts))

    def key_block(carry, j):
        dq_acc, dbias, dconsts = carry
        k_blk = lax.dynamic_slice_in_dim(kp, j * bk, bk, axis=1)  # [B, bk, K, H]
        kc_blk = lax.dynamic_slice_in_dim(kcp, j * bk, bk, axis=1)
        v_blk = lax.dynamic_slice_in_dim(vp, j * bk, bk, axis=1)

        def query_block(i, inner):
            dk, dv, dq_acc, dbias, dconsts = inner
            q_blk = lax.dynamic_slice_in_dim(qp, i * bq, bq, axis=1)  # [B, bq, K, G, H]
            qc_blk = lax.dynamic_slice_in_dim(qcp, i * bq, bq, axis=1)
            do_blk = lax.dynamic_slice_in_dim(dop, i * bq, bq, axis=1)
            row = lambda x: lax.dynamic_slice_in_dim(x, i * bq, bq, axis=3)[..., None]
            logits = tiles.logits(q_blk, k_blk, i, j, acc_dt)  # [B, K, G, bq, bk]
            vis = tiles.visibility(i, j)
            score_vjp = None
            if tiles.flex is not None:
                _record("backward")
                if spec.flex is not None and spec.flex.score_mod is not None:
                    # score_mod's derivative inside the tile: its vjp at this tile's scores.
                    logits, score_vjp = jax.vjp(
                        lambda raw, cs: score_with(raw, vis, i, j, cs), logits, tuple(score_consts[c] for c in diff)
                    )
            keep = row(seen) if vis is None else vis & row(seen)
            p = jnp.where(keep, jnp.exp(clamp_exponent(logits - row(lse_safe))), 0)
            drop = tiles.dropout_keep(i, j)
            # Dropout: out = (Z = keep ⊙ P / (1 - rate)) @ V, so dV = Zᵀ dO and the
            # cotangent of P is keep ⊙ dZ / (1 - rate); D = rowsum(dO ∘ O) is unchanged.
            z = p
            if drop is not None:
                assert drop_scale is not None  # both are set by spec.has_dropout
                z = jnp.where(drop, p * drop_scale, 0)
            dv = dv + jnp.einsum("bkgqs,bqkgh->bskh", z.astype(cdt), do_blk, preferred_element_type=acc_dt)
            dp = jnp.einsum("bqkgh,bskh->bkgqs", do_blk, v_blk, preferred_element_type=acc_dt)
            if drop is not None:
                assert drop_scale is not None
                dp = jnp.where(drop, dp * drop_scale, 0)
            # d loss / d (transformed logit); exactly 0 where masked, also when dP or D is NaN.
            ds = jnp.where(keep, p * (dp - row(delta)), 0)
            if spec.soft_cap is not None:
                ds = ds * _masking.soft_cap_grad(spec, jnp.where(keep, logits, 0))
            if score_vjp is not None:
                ds, d_cs = score_vjp(ds)
                ds = jnp.where(keep, ds, 0)
                dconsts = tuple(a + d.astype(a.dtype) for a, d in zip(dconsts, d_cs))
            if dbias is not None:
                dbias = _accumulate_dbias(dbias, ds, i * bq, j * bk, bq, bk)
            ds = (ds * jnp.asarray(spec.scale, acc_dt)).astype(cdt)
            dq_blk = jnp.einsum("bkgqs,bskh->bqkgh", ds, kc_blk, preferred_element_type=acc_dt)
            dq_acc = lax.dynamic_update_slice_in_dim(
                dq_acc, lax.dynamic_slice_in_dim(dq_acc, i * bq, bq, axis=1) + dq_blk, i * bq, axis=1
            )
            dk = dk + jnp.einsum("bkgqs,bqkgh->bskh", ds, qc_blk, preferred_element_type=acc_dt)
            return dk, dv, dq_acc, dbias, dconsts

        zeros_k = full((b, bk, kh, h), 0, acc_dt, q, k, v, dout)
        zeros_v = full((b, bk, kh, hv), 0, acc_dt, q, k, v, dout)
        init = (zeros_k, zeros_v, dq_acc, dbias, dconsts)
        if tiles.flex is not None:  # the query blocks some row or head sees key block j from
            fx = tiles.flex
            dk, dv, dq_acc, dbias, dconsts = lax.fori_loop(
                0, fx.q_count[j], lambda ii, c: query_block(fx.q_order[j, ii], c), init
            )
        else:
            lo, hi = spec.query_block_range(j * bk, (j + 1) * bk, bq, nq, q_offset)
            dk, dv, dq_acc, dbias, dconsts = lax.fori_loop(lo, jnp.maximum(lo, hi), query_block, init)
        return (dq_acc, dbias, dconsts), (dk.astype(k.dtype), dv.astype(v.dtype))

    dq0 = full((b, tiles.t_pad, kh, g, h), 0, acc_dt, q, k, v, dout)
    (dq_acc, dbias, dconsts), (dk, dv) = lax.scan(key_block, (dq0, dbias0, dconsts0), jnp.arange(nk, dtype=jnp.int32))
    dq = dq_acc.reshape(b, tiles.t_pad, n, h)[:, :t].astype(q.dtype)
    # dk, dv: [nk, B, bk, K, H | Hv] -> [B, S, K, H | Hv]
    dk = jnp.moveaxis(dk, 0, 1).reshape(b, tiles.s_pad, kh, h)[:, :s]
    dv = jnp.moveaxis(dv, 0, 1).reshape(b, tiles.s_pad, kh, hv)[:, :s]
    if dbias is not None:
        assert masks.bias is not None  # dbias is accumulated only for a bias
        dbias = dbias[:, :, : masks.bias.shape[2], : masks.bias.shape[3]].astype(masks.bias.dtype)
    if spec.flex is None or masks.score_consts is None:
        return dq, dk, dv, dbias
    dscore: list[jax.Array | None] = [None] * len(score_consts)
    for c, d in zip(diff, dconsts):
        dscore[c] = d
    return dq, dk, dv, dbias, tuple(dscore)


def paged_forward(pspec: PagedSpec, q, key_pages, value_pages, table, lengths, splits=None, sinks=None):
    """paged_attention on the xla forward: out [B, T, N, H] (dtype of q), lse [B, N, T].
    splits: the number of split-KV chunks of the page table (default pspec.splits). sinks: [N] or None; without a
    split the online softmax's initial state, with one a partial of the merge (out 0, lse =
    sink), as in `split_kv`.

    The blockwise forward (`forward`) with its key blocks read through the page table: block
    j is the pages table[:, j·pp : (j+1)·pp], gathered page by page into one [B, pp·page_size,
    K, H] tile; the cache is never copied into a contiguous array."""
    spec = pspec.attention
    b, t, n, h = q.shape
    ps, cap = pspec.page_size, pspec.capacity
    c = pspec.splits if splits is None else max(1, min(splits, pspec.max_pages))
    lengths = jnp.maximum(lengths, 0)
    key_len = jnp.minimum(lengths, cap)  # keys beyond the table do not exist
    offset = lengths - t  # >= -T: no int32 wrap-around below
    # Chunk c of sequence b is row b·C + c: pages [c·pc, (c+1)·pc) of its table.
    pc = -(-pspec.max_pages // c)
    pp = max(1, min(BLOCK_K // ps, pc))  # pages per key block
    pc = -(-pc // pp) * pp
    table = pad_axis(table, 1, c * pc, -1).reshape(b * c, pc)
    base = jnp.arange(c, dtype=jnp.int32) * (pc * ps)  # position of each chunk's first key
    row_len = jnp.clip(key_len[:, None] - base, 0, pc * ps).reshape(b * c)
    row_offset = (offset[:, None] - base).reshape(b * c)
    rows_q = q if c == 1 else jnp.broadcast_to(q[:, None], (b, c, t, n, h)).reshape(b * c, t, n, h)
    local = dataclasses.replace(spec, batch=b * c, kv_len=pc * ps, has_kv_lengths=True, has_q_offset=True)
    num_pages = pspec.num_pages

    def fetch(j):
        ids = lax.dynamic_slice_in_dim(table, j * pp, pp, axis=1)  # [R, pp]
        valid = (ids >= 0) & (ids < num_pages)
        ids = jnp.where(valid, ids, 0)  # an invalid id reads page 0, masked below
        k_blk = jnp.take(key_pages, ids, axis=0).reshape(b * c, pp * ps, *key_pages.shape[2:])
        v_blk = jnp.take(value_pages, ids, axis=0).reshape(b * c, pp * ps, *value_pages.shape[2:])
        bad_v = jnp.transpose(nonfinite_rows(v_blk), (0, 2, 1))[:, :, None, None, :]
        vis = jnp.repeat(valid, ps, axis=1)[:, None, None, None, :]  # [R, 1, 1, 1, pp·ps]
        return k_blk, finite_part(v_blk), bad_v, vis

    masks = MaskInputs(kv_lengths=row_len, q_offset=row_offset, sinks=sinks if c == 1 else None)
    local = dataclasses.replace(local, has_sinks=masks.sinks is not None)
    acc_dt = acc_dtype(q.dtype)
    out, lse = forward(
        local,
        rows_q,
        None,
        None,
        masks,
        kv_blocks=(pp * ps, fetch),
        out_dtype=q.dtype if c == 1 else acc_dt,
    )
    if c == 1:
        return out, lse
    out = out.reshape(b, c, t, n, h)
    lse = lse.reshape(b, c, n, t)
    outs, lses = [out[:, i] for i in range(c)], [lse[:, i] for i in range(c)]
    if sinks is not None:
        outs.append(jnp.zeros_like(outs[0]))
        lses.append(jnp.broadcast_to(sinks.astype(lses[0].dtype)[None, :, None], lses[0].shape))
    out, lse = merge_partials(outs, lses)
    return out.astype(q.dtype), lse


def _accumulate_dbias(dbias, ds, row0, col0, bq: int, bk: int):
    """dbias[..., tile] += ds summed over the axes the bias broadcasts along."""
    bb, nb, tb, sb = dbias.shape
    x = ds.reshape(ds.shape[0], -1, bq, bk)  # [B, N, bq, bk]
    axes = tuple(ax for ax, size in ((0, bb), (1, nb), (2, tb), (3, sb)) if size == 1)
    x = jnp.sum(x, axis=axes, keepdims=True) if axes else x
    start = _index(0, 0, row0 if tb != 1 else 0, col0 if sb != 1 else 0)
    cur = lax.dynamic_slice(dbias, start, x.shape)
    return lax.dynamic_update_slice(dbias, cur + x, start)


def _flex_note(spec: AttentionSpec) -> str:
    """How the xla implementation runs a flex_attention call (`explain`)."""
    flex = spec.flex
    assert flex is not None
    if flex.block_size is None:
        bq, _, bk, _ = _tile_sizes(spec, spec.q_len, spec.kv_len, BLOCK_Q, BLOCK_K)
        every = "evaluates mask_mod" if flex.mask_mod is not None else "is fully visible"
        return (
            f"flex: {bq}x{bk} tiles, no block_mask: every tile runs and {every} "
            "(create_block_mask skips the empty blocks)"
        )
    bq, bk = flex.block_size
    return (
        f"flex: the block mask's {bq}x{bk} blocks as tiles; runs the blocks that are not empty "
        "for some batch row or head (their union); mask_mod only where one sees a block partly; no split-KV"
    )


class XlaImplementation:
    """Pure JAX; serves every configuration and dtype on every backend."""

    name = "xla"

    def unsupported(self, spec: AttentionSpec) -> str | None:
        return None

    def head_dims(self) -> str:
        return "any pair"

    # flex_attention: score_mod, mask_mod and block masks (`_FlexTiles`).
    serves_flex = True

    def forward(self, spec, q, k, v, masks):
        if spec.flex is not None:  # its tiles are the block mask's: no split-KV
            return forward(spec, q, k, v, masks)
        # Split-KV decoding: few queries, long S (`split_kv`), around this forward.
        return split_kv.forward(forward, spec, q, k, v, masks, split_kv.num_splits(spec, _registry.platform()))

    def note(self, spec) -> str:
        if spec.flex is not None:
            return _flex_note(spec)
        return _heuristics.xla_description(spec, _registry.platform())

    def summary(self, spec) -> str:
        return _heuristics.xla_summary(spec, _registry.platform())

    # paged_attention (jax_flash/inference/paged.py): every paged call.
    paged_default = True

    def paged_unsupported(self, pspec: PagedSpec) -> str | None:
        return None

    def paged_forward(self, pspec, q, key_pages, value_pages, table, lengths, sinks=None):
        return paged_forward(pspec, q, key_pages, value_pages, table, lengths, sinks=sinks)

    def paged_summary(self, pspec: PagedSpec) -> str:
        split = f"split-KV over {pspec.splits} page chunks" if pspec.splits > 1 else "split-KV off"
        return f"pages read through the table, {split}"

    def paged_note(self, pspec: PagedSpec) -> str:
        pp = max(1, min(BLOCK_K // pspec.page_size, pspec.max_pages))
        split = f"split-KV over {pspec.splits} page chunks" if pspec.splits > 1 else "no split-KV"
        return (
            f"reads {pp} page(s) of {pspec.page_size} per key block through the table; {split}; rule: {split_kv.rule()}"
        )

    def backward(self, spec, q, k, v, masks, out, lse, dout, dlse):
        return backward(spec, q, k, v, masks, out, lse, dout, dlse)


IMPLEMENTATION = XlaImplementation()
