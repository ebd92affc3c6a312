"""The `pallas` implementation's Triton kernels, as launched: FlashAttention-2 on Pallas's
Triton backend (`jax_flash.pallas` re-exports what the rest of the package calls).

On a GPU the kernels are compiled by Triton: every `pallas_call` passes the Triton
`CompilerParams` (num_warps, num_stages), which is what selects the Triton backend rather
than Mosaic GPU. On a CPU backend the same kernels run with `interpret=True` (slow; it is
how the test suite exercises them without a GPU), and `implementation=None` never picks
them there (the registry prefers `cpu`, then `xla`).

Kernels (`_triton_kernels`): a forward over (query block, head, batch) with the online
softmax; a dK/dV kernel over (key block, kv head, batch) that loops over the query blocks
of every query head of its group (GQA without repeated K/V and without atomics); a dQ
kernel over (query block, head, batch) that loops over key blocks and, when a bias is
given, also writes dS for dbias (a [B, N, T, S] float32 buffer, summed over the axes the
bias broadcasts along). D = rowsum(dO ∘ O) - dlse is one XLA reduction before them.

Each pass comes as plain and general kernels (`_triton_kernels`' docstring): a call
`_heuristics.pallas_plain_blocker` lets through runs the plain ones where `plain_inputs`
holds (q, k, v finite, no score can overflow: one reduction over each, on each device's
shard), the general ones, which follow the numerical contract for any input, elsewhere. Both
are launched, each gated on the flag (`launches`): no conditional, whose predicate XLA would
copy to the host.

Tiles, warps and stages come from `_table.TABLE` (made for sm_90; the data file
`table.json`), shrunk to the GPU's shared memory where it has less
(`_heuristics.pallas_tile_config`, beside the forward's split-KV and the dK/dV kernel's group
split);
`_tune.tune()` searches candidates on a GPU and writes that file.

The wrapper pads what Triton needs powers of two for (the head dims H and Hv, each to at
least 16) and the sequence lengths to whole tiles; padded keys are masked, padded rows sliced off, and
the scale uses the true head dim (it comes from the spec).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jax_flash import _flex, _heuristics, _registry
from jax_flash._merge import merge_partials
from jax_flash._numerics import pad_axis, round_up, scores_are_finite
from jax_flash._paged_spec import PagedSpec
from jax_flash._spec import AttentionSpec, MaskInputs
from jax_flash.pallas import _backend, _decode, _flex_tiles, _mosaic, _mosaic_backward
from jax_flash.pallas._table import padded_head_dim, smem_budget, smem_estimate
from jax_flash.pallas._triton_kernels import (
    Layout,
    compiler_params,
    dkdv_kernel,
    dq_kernel,
    forward_kernel,
    triton,
    triton_deprecation,
    triton_missing,
)
from jax_flash.parallel import partitioning

DTYPES = ("float16", "bfloat16", "float32")
# H and Hv each up to MAX_HEAD_DIM, in any pair (each padded to its own power of two).
MAX_HEAD_DIM = 256


def _interpret(interpret: bool | None) -> bool:
    return _registry.platform() == "cpu" if interpret is None else interpret


def _config(spec: AttentionSpec, masks: MaskInputs, hp: int, pass_: str, configs, interpret):
    """The table's entry for this call, shrunk to the GPU's shared memory (sm_86/89/120 have
    99 KB per block, the table is for sm_90); an explicit `configs` entry is used as is."""
    if configs and pass_ in configs:
        return configs[pass_]
    dense_bytes = (0 if masks.bias is None else min(4, masks.bias.dtype.itemsize)) + (0 if masks.mask is None else 1)
    budget = None if interpret else smem_budget(compute_capability())
    cfg = _heuristics.pallas_tile_config(hp, spec.dtype, pass_, interpret, budget, dense_bytes)
    if spec.flex is not None and budget is not None:
        cfg = flex_config(spec, cfg, hp, pass_, budget)
    return cfg


# Shared memory Triton takes per tile-wide read of a closed-over array (`_flex_tiles.tile_reads`):
# its [bq, bk] tile of 64-bit pointers converted to the scores' layout. Measured on an H200: a
# T5 table read at 128 × 128 tiles, H = 64, bf16, asked for 240 KiB = the forward's 112 KiB of
# streamed tiles (3 stages, `smem_estimate`) + 128 KiB.
FLEX_READ_BYTES = 8


def flex_config(spec: AttentionSpec, cfg, hp: int, pass_: str, budget: int):
    """A flex call's launch configuration: the block mask's blocks as tiles, and as many
    pipeline stages (at most the table's) as leave room for the user functions' tile-wide
    reads within `budget` bytes of shared memory."""
    flex = spec.flex
    assert flex is not None
    if flex.block_size is not None:
        cfg = dataclasses.replace(cfg, block_q=flex.block_size[0], block_k=flex.block_size[1])
    reads = _flex_tiles.tile_reads(flex.mask_mod, False) + _flex_tiles.tile_reads(flex.score_mod, True)
    extra = FLEX_READ_BYTES * cfg.block_q * cfg.block_k * reads
    # Without such reads the table's stages stay (its model errs high for dK/dV at 128 × 128
    # tiles, which ran at H = 128 on an H200 as they are).
    while extra and cfg.num_stages > 1 and smem_estimate(cfg, hp, spec.dtype, pass_) + extra > budget:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg


def compute_capability():
    """(major, minor) of the first device if it is an NVIDIA GPU, else None."""
    cc = getattr(jax.devices()[0], "compute_capability", None)
    if cc is None:
        return None
    major, minor = str(cc).split(".")[:2]
    return int(major), int(minor)


def _dense(x, t_pad: int, s_pad: int, value, dtype=None):
    """Pad a dense [B|1, N|1, T|1, S|1] input along the axes it varies on."""
    if x is None:
        return None
    if dtype is not None:
        x = x.astype(dtype)
    if x.shape[2] != 1:
        x = pad_axis(x, 2, t_pad, value)
    if x.shape[3] != 1:
        x = pad_axis(x, 3, s_pad, value)
    return x


def _flex_layout(masks: MaskInputs) -> dict:
    """Layout fields of a flex call: which closed-over arrays are bool, whether lists drive."""
    is_bool = lambda cs: tuple(jnp.asarray(c).dtype == jnp.bool_ for c in cs or ())
    return dict(
        mask_consts=is_bool(masks.mask_consts),
        score_consts=is_bool(masks.score_consts),
        block_lists=masks.block_mask is not None,
    )


def _layout(spec: AttentionSpec, masks: MaskInputs, bq, bk, t_pad, s_pad, **kw) -> Layout:
    if spec.flex is not None:
        kw = {**_flex_layout(masks), **kw}
    dense = lambda x: (None, None) if x is None else (x.shape[2] != 1, x.shape[3] != 1)
    bias_rows, bias_cols = dense(masks.bias)
    mask_rows, mask_cols = dense(masks.mask)
    return Layout(
        spec=spec,
        block_q=bq,
        block_k=bk,
        t_pad=t_pad,
        s_pad=s_pad,
        has_lengths=masks.q_lengths is not None or masks.kv_lengths is not None,
        has_segments=masks.q_segment_ids is not None,
        has_q_offset=masks.q_offset is not None,
        has_sinks=masks.sinks is not None,
        bias_rows=bias_rows,
        bias_cols=bias_cols,
        mask_rows=mask_rows,
        mask_cols=mask_cols,
        **{"group": spec.group_size, **kw},
    )


def _num_sms() -> int:
    return _registry.sm_count()


class _Extras:
    """The optional per-call inputs, padded, and their BlockSpecs for one grid kind."""

    def __init__(self, spec: AttentionSpec, masks: MaskInputs, t_pad: int, s_pad: int):
        self.spec = spec
        b = spec.batch
        self.lengths = None
        if masks.q_lengths is not None or masks.kv_lengths is not None:
            ql = masks.q_lengths if masks.q_lengths is not None else jnp.full((b,), spec.q_len)
            kl = masks.kv_lengths if masks.kv_lengths is not None else jnp.full((b,), spec.kv_len)
            self.lengths = (ql.astype(jnp.int32)[:, None], kl.astype(jnp.int32)[:, None])
        self.segments = None
        if masks.q_segment_ids is not None:
            assert masks.kv_segment_ids is not None  # segment ids come in pairs
            self.segments = (
                pad_axis(masks.q_segment_ids.astype(jnp.int32), 1, t_pad),
                pad_axis(masks.kv_segment_ids.astype(jnp.int32), 1, s_pad),
            )
        # One query offset per batch row: the programs of row b read q_offset[b].
        self.q_offset = None if masks.q_offset is None else masks.q_offset.astype(jnp.int32)[:, None]
        f64_bias = masks.bias is not None and masks.bias.dtype == jnp.float64
        self.bias = _dense(masks.bias, t_pad, s_pad, 0, jnp.float32 if f64_bias else None)
        # Booleans travel as int8 (Triton has no i1 memory type).
        self.mask = _dense(masks.mask, t_pad, s_pad, 0, jnp.int8)
        # Sinks [N] -> [N, 1] float32: the programs of head n read sinks[n] (forward only).
        self.sinks = None if masks.sinks is None else masks.sinks.astype(jnp.float32)[:, None]
        # Dropout's Philox key, the same [2] words for every program (last).
        self.seed = None if masks.dropout_seed is None else masks.dropout_seed.astype(jnp.uint32)
        # flex_attention: the arrays its mask_mod and score_mod close over (whole, in every
        # program), and the block mask whose lists drive the loops.
        self.flex_consts = _flex_tiles.kernel_consts((masks.mask_consts or ()) + (masks.score_consts or ()))
        self.block_mask = masks.block_mask

    def _flex_consts(self):
        pl, _ = triton()
        specs = [pl.BlockSpec(c.shape, lambda *_, nd=c.ndim: (0,) * nd) for c in self.flex_consts]
        return list(self.flex_consts), specs

    def _row_lists(self):
        """The block mask's lists per query block: full then partial (count, indices)."""
        pl, _ = triton()
        bm = self.block_mask
        if bm is None:
            return [], []
        bb, nb, _, nk = bm.shape
        sel = lambda b, n: (b if bb != 1 else 0, n if nb != 1 else 0)
        args: list[Any] = []
        specs: list[Any] = []
        for count, indices in ((bm.full_kv_num_blocks, bm.full_kv_indices), (bm.kv_num_blocks, bm.kv_indices)):
            args += [count, indices]
            specs += [
                pl.BlockSpec((None, None, 1), lambda i, n, b: (*sel(b, n), i)),
                pl.BlockSpec((None, None, None, nk), lambda i, n, b: (*sel(b, n), i, 0)),
            ]
        return args, specs

    def _key_lists(self):
        """The block mask's lists per key block, for every query head (of the mask): full
        then partial (count [N|1], indices [N|1, nq])."""
        pl, _ = triton()
        bm = self.block_mask
        if bm is None:
            return [], []
        bb, nb, nq, _ = bm.shape
        sel = lambda b: b if bb != 1 else 0
        args: list[Any] = []
        specs: list[Any] = []
        for count, indices in ((bm.full_q_num_blocks, bm.full_q_indices), (bm.q_num_blocks, bm.q_indices)):
            args += [count, indices]
            specs += [
                pl.BlockSpec((None, nb, None), lambda j, h, b: (sel(b), 0, j)),
                pl.BlockSpec((None, nb, None, nq), lambda j, h, b: (sel(b), 0, j, 0)),
            ]
        return args, specs

    def row_grid(self, bq: int, s_pad: int, chunks: int = 1):
        """Arrays and specs for a grid (query block i, head n, batch b) seeing all keys; with
        split-KV grid axis 0 is (query block, key chunk), the chunk fastest."""
        pl, _ = triton()
        args: list[Any] = []
        specs: list[Any] = []
        if chunks > 1:
            return self._chunked(self.row_grid(bq, s_pad), chunks)
        if self.lengths is not None:
            args += self.lengths
            specs += [pl.BlockSpec((None, 1), lambda i, n, b: (b, 0))] * 2
        if self.segments is not None:
            args += self.segments
            specs += [
                pl.BlockSpec((None, bq), lambda i, n, b: (b, i)),
                pl.BlockSpec((None, s_pad), lambda i, n, b: (b, 0)),
            ]
        if self.q_offset is not None:
            args.append(self.q_offset)
            specs.append(pl.BlockSpec((None, 1), lambda i, n, b: (b, 0)))
        for x in (self.bias, self.mask):
            if x is None:
                continue
            bb, nb, tb, sb = x.shape
            args.append(x)
            specs.append(
                pl.BlockSpec(
                    (None, None, bq if tb != 1 else 1, sb),
                    lambda i, n, b, bb=bb, nb=nb, tb=tb: (
                        b if bb != 1 else 0,
                        n if nb != 1 else 0,
                        i if tb != 1 else 0,
                        0,
                    ),
                )
            )
        if self.sinks is not None:
            args.append(self.sinks)
            specs.append(pl.BlockSpec((None, 1), lambda i, n, b: (n, 0)))
        for more in (self._flex_consts(), self._row_lists()):
            args += more[0]
            specs += more[1]
        if self.seed is not None:
            args.append(self.seed)
            specs.append(pl.BlockSpec((2,), lambda i, n, b: (0,)))
        return args, specs

    @staticmethod
    def _chunked(grid, chunks: int):
        """A row grid's specs with axis 0 numbering (query block, key chunk) pairs."""
        pl, _ = triton()
        args, specs = grid
        chunked = [pl.BlockSpec(s.block_shape, lambda i, n, b, f=s.index_map: f(i // chunks, n, b)) for s in specs]
        return args, chunked

    def key_grid(self, bk: int, t_pad: int, splits: int):
        """Arrays and specs for a grid (key block j, kv head h · splits, batch b)."""
        pl, _ = triton()
        spec = self.spec
        kh, g = spec.num_kv_heads, spec.group_size
        args: list[Any] = []
        specs: list[Any] = []
        if self.lengths is not None:
            args += self.lengths
            specs += [pl.BlockSpec((None, 1), lambda j, h, b: (b, 0))] * 2
        if self.segments is not None:
            args += self.segments
            specs += [
                pl.BlockSpec((None, t_pad), lambda j, h, b: (b, 0)),
                pl.BlockSpec((None, bk), lambda j, h, b: (b, j)),
            ]
        if self.q_offset is not None:
            args.append(self.q_offset)
            specs.append(pl.BlockSpec((None, 1), lambda j, h, b: (b, 0)))
        for x in (self.bias, self.mask):
            if x is None:
                continue
            bb, nb, tb, sb = x.shape
            # [B|1, N|1, T|1, S|1] -> [B|1, K|1, G|1, T|1, S|1]: the kernel picks head g.
            x = x.reshape(bb, kh, g, tb, sb) if nb != 1 else x[:, :, None]
            args.append(x)
            specs.append(
                pl.BlockSpec(
                    (None, None, x.shape[2], tb, bk if sb != 1 else 1),
                    lambda j, h, b, bb=bb, nb=nb, sb=sb: (
                        b if bb != 1 else 0,
                        h // splits if nb != 1 else 0,
                        0,
                        0,
                        j if sb != 1 else 0,
                    ),
                )
            )
        for more in (self._flex_consts(), self._key_lists()):
            args += more[0]
            specs += more[1]
        if self.seed is not None:
            args.append(self.seed)
            specs.append(pl.BlockSpec((2,), lambda j, h, b: (0,)))
        return args, specs


def _tiles(spec: AttentionSpec, cfgs):
    """(block_q, block_k) per config and the common padded lengths T_pad, S_pad. A flex call
    with a block mask runs its blocks as tiles."""
    tile = _heuristics.pallas_tile
    blocks = [(tile(spec.q_len, c.block_q), tile(spec.kv_len, c.block_k)) for c in cfgs]
    if spec.flex is not None and spec.flex.block_size is not None:
        blocks = [spec.flex.block_size for _ in cfgs]
    t_pad = round_up(spec.q_len, max(b[0] for b in blocks))
    s_pad = round_up(spec.kv_len, max(b[1] for b in blocks))
    return blocks, t_pad, s_pad


def plain_inputs(q, k, v, masks: MaskInputs):
    """Bool scalar: the plain kernels may run on these inputs: every raw score q·k is finite
    (`_numerics.scores_are_finite`) and v is finite. One reduction over each of q, k and v.
    (Sinks may be anything: the plain forward joins them as the general one does.)"""
    del masks  # the same signature as the rule's other callers; the masks change nothing here
    return scores_are_finite(q, k) & jnp.all(jnp.isfinite(v))


# A launch of one kernel variant: (plain, run flag): the flag an int32 [1] array (the launch's
# programs return at once where it is 0), or None (ungated).
Launch = tuple[bool, Any]


def launches(spec: AttentionSpec, q, k, v, masks: MaskInputs) -> tuple[Launch, ...]:
    """The kernel launches of one pass: the general kernels alone for a call
    `_heuristics.pallas_plain_blocker` refuses; else the plain kernels gated on `plain_inputs`
    (tested on this device's shard), then the general ones gated on its negation, writing into
    the same outputs (input_output_aliases). Both are launched, no conditional: XLA's GPU
    conditional copies its predicate to the host and waits for the device, a stall in every
    call; the launch that does not apply costs one scalar load per program."""
    if _heuristics.pallas_plain_blocker(spec) is not None:
        return ((False, None),)
    run = plain_inputs(q, k, v, masks).astype(jnp.int32).reshape(1)
    return ((True, run), (False, 1 - run))


def _chain(pl, launches_, kernel, layout_of, args, in_specs, out_specs, out_shape, name, outs=(), **kw):
    """The pallas_calls of `launches_` in order, each gated by its flag and writing into the
    previous one's outputs (the first into `outs` where given); the last one's outputs."""
    outs = list(outs)
    for plain, run in launches_:
        call_args, specs = list(args), list(in_specs)
        if run is not None:
            call_args.append(run)
            specs.append(pl.BlockSpec((1,), lambda *_: (0,)))
        aliases: dict[int, int] = {len(call_args) + i: i for i in range(len(outs))}
        call_args += outs
        specs += list(out_specs) if outs else []
        layout = layout_of(plain=plain, gated=run is not None, aliased=len(outs))
        outs = pl.pallas_call(
            functools.partial(kernel, layout=layout),
            in_specs=specs,
            out_specs=out_specs,
            out_shape=out_shape,
            input_output_aliases=aliases,
            name=f"{name}_plain" if plain else name,
            **kw,
        )(*call_args)
        outs = list(outs)
    return outs


def forward(spec: AttentionSpec, q, k, v, masks: MaskInputs, *, configs=None, interpret=None):
    """out [B, T, N, Hv] (dtype of q), lse [B, N, T] float32 natural log; partitioned over
    the inputs' shardings (`jax_flash.parallel.partitioning`)."""

    def local(spec, q, k, v, masks):
        if _backend.choose(spec)[0] == "mosaic_gpu":
            return _mosaic_forward_call(spec, q, k, v, masks, configs=configs, interpret=interpret)
        run = launches(spec, q, k, v, masks)
        return _forward_call(spec, q, k, v, masks, configs=configs, interpret=interpret, launches=run)

    return partitioning.forward("pallas", local, spec, q, k, v, masks)


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
    *,
    configs=None,
    interpret=None,
):
    """dq, dk, dv (input dtypes), dbias (shape and dtype of masks.bias, or None);
    partitioned over the inputs' shardings."""

    def local(spec, q, k, v, masks, out, lse, dout, dlse):
        if _backend.runs_mosaic_backward(spec):
            return _mosaic_backward_call(
                spec, q, k, v, masks, out, lse, dout, dlse, configs=configs, interpret=interpret
            )
        run = launches(spec, q, k, v, masks)
        return _backward_call(
            spec, q, k, v, masks, out, lse, dout, dlse, configs=configs, interpret=interpret, launches=run
        )

    grads = partitioning.backward("pallas", local, spec, q, k, v, masks, out, lse, dout, dlse)
    if spec.flex is not None:
        return (*grads, _flex_consts_cotangent(spec, q, k, v, masks, out, lse, dout, dlse))
    return grads


def _flex_consts_cotangent(spec, q, k, v, masks, out, lse, dout, dlse):
    """The cotangents of the floating arrays a score_mod closes over (None for the others),
    from the xla implementation's tile loop: the kernels compute dq, dk and dv, and a
    gradient of a closed-over array (one sum over every tile of the score_mod's vjp) would
    need scatter-adds across programs. Only what uses these cotangents runs (dead code
    otherwise: a score_mod's array that is not differentiated costs nothing)."""
    consts = masks.score_consts
    if consts is None:
        return None
    if not _flex.split_float(consts)[0]:
        return tuple(None for _ in consts)
    return _registry.get("xla").backward(spec, q, k, v, masks, out, lse, dout, dlse)[4]


# Split-KV of the forward (flash-decoding; the rule: `_heuristics.pallas_split_kv_chunks`):
# with fewer programs than SMs, a decode step's key blocks are cut into chunks, one program
# each, with float32 partials merged by lse in chunk order (jax_flash/_merge.py).
# Config.pallas_split_kv (JAX_FLASH_PALLAS_SPLIT_KV=C) forces C.


def split_kv_chunks(spec: AttentionSpec, block_q: int, block_k: int, interpret: bool = False) -> int:
    """The forward's split-KV chunk count for `spec` at tiles (block_q, block_k); 1: none."""
    return _heuristics.pallas_split_kv_chunks(spec, block_q, block_k, _heuristics.pallas_target(interpret, _num_sms()))


def split_kv_description(spec: AttentionSpec) -> str:
    """What `explain` says of the forward's split-KV (at the default tiles)."""
    try:
        interpret = _interpret(None)
        hp = max(padded_head_dim(spec.head_dim), padded_head_dim(spec.v_head_dim))
        cfg = _config(spec, MaskInputs(), hp, "fwd", None, interpret)
        ((bq, bk),), _, _ = _tiles(spec, [cfg])
        return _heuristics.pallas_split_kv_description(spec, bq, bk, interpret, _num_sms())
    except ValueError as e:
        return f"forward split-KV: {e}"


def split_kv_summary(spec: AttentionSpec) -> str:
    """`explain`'s one line of the forward's split-KV (at the default tiles)."""
    try:
        interpret = _interpret(None)
        hp = max(padded_head_dim(spec.head_dim), padded_head_dim(spec.v_head_dim))
        cfg = _config(spec, MaskInputs(), hp, "fwd", None, interpret)
        ((bq, bk),), _, _ = _tiles(spec, [cfg])
        return _heuristics.pallas_split_kv_summary(spec, bq, bk, interpret, _num_sms())
    except ValueError as e:
        return f"{e}: calls fail"


def _mosaic_forward_call(spec: AttentionSpec, q, k, v, masks: MaskInputs, *, configs, interpret):
    """The Mosaic GPU plain forward gated on `plain_inputs`, then the Triton general forward gated
    on the negation, writing into its results (`_backend`'s docstring)."""
    run = plain_inputs(q, k, v, masks).astype(jnp.int32).reshape(1)
    sinks = None if masks.sinks is None else masks.sinks.astype(jnp.float32)
    out, lse = _mosaic.forward(
        q,
        k,
        v,
        scale=spec.scale,
        **_backend.band(spec),
        **_backend.masks(masks),
        sinks=sinks,
        run=run,
        interpret=_backend.INTERPRET,
    )
    return _forward_call(
        spec, q, k, v, masks, configs=configs, interpret=interpret, launches=((False, 1 - run),), outs=(out, lse)
    )


def _forward_call(
    spec: AttentionSpec, q, k, v, masks: MaskInputs, *, configs, interpret, launches=((False, None),), outs=()
):
    """The forward kernels (`launches`) on (local) canonical arrays; `spec` describes them.
    `outs`: results of an earlier launch (out [B, T, N, Hv], lse [B, N, T]) the launches write
    into, unsplit (a ragged T is padded to the tiles: a copy)."""
    pl, _ = triton()
    interpret = _interpret(interpret)
    b, t, n, h = q.shape
    hv = v.shape[-1]
    hp, hvp = padded_head_dim(h), padded_head_dim(hv)
    cfg = _config(spec, masks, max(hp, hvp), "fwd", configs, interpret)
    ((bq, bk),), t_pad, s_pad = _tiles(spec, [cfg])
    g = spec.group_size
    c = 1 if spec.flex is not None or outs else split_kv_chunks(spec, bq, bk, interpret)
    if outs:
        out, lse = outs
        outs = (pad_axis(pad_axis(out, 3, hvp), 1, t_pad), pad_axis(lse, 2, t_pad))
    qp = pad_axis(pad_axis(q, 3, hp), 1, t_pad)
    kp = pad_axis(pad_axis(k, 3, hp), 1, s_pad)
    vp = pad_axis(pad_axis(v, 3, hvp), 1, s_pad)
    if masks.sinks is None and any(plain for plain, _ in launches):
        # The plain forward always joins a sink, -inf (no sink) when the call has none: one
        # program for both, so that a -inf sink gives the call without it bit for bit (the
        # general kernels' -inf sink vanishes exactly in the first tile).
        masks = masks._replace(sinks=jnp.full((spec.num_heads,), -jnp.inf, jnp.float32))
    extras = _Extras(spec, masks, t_pad, s_pad)
    extra_args, extra_specs = extras.row_grid(bq, s_pad, c)
    layout_of = functools.partial(_layout, spec, masks, bq, bk, t_pad, s_pad, kv_chunks=c)
    # Grid axis 0: the query block (and with split-KV its key chunk, the chunk fastest).
    row_spec = pl.BlockSpec((None, bq, None, hp), lambda i, n_, b_: (b_, i // c, n_, 0))
    kv_spec = pl.BlockSpec((None, s_pad, None, hp), lambda i, n_, b_: (b_, 0, n_ // g, 0))
    v_spec = pl.BlockSpec((None, s_pad, None, hvp), lambda i, n_, b_: (b_, 0, n_ // g, 0))
    if c == 1:
        out_specs = [
            pl.BlockSpec((None, bq, None, hvp), lambda i, n_, b_: (b_, i, n_, 0)),
            pl.BlockSpec((None, None, bq), lambda i, n_, b_: (b_, n_, i)),
        ]
        out_shape = [
            jax.ShapeDtypeStruct((b, t_pad, n, hvp), q.dtype),
            jax.ShapeDtypeStruct((b, n, t_pad), jnp.float32),
        ]
    else:  # chunk c's normalised float32 partial out and its lse
        out_specs = [
            pl.BlockSpec((None, None, bq, None, hvp), lambda i, n_, b_: (i % c, b_, i // c, n_, 0)),
            pl.BlockSpec((None, None, None, bq), lambda i, n_, b_: (i % c, b_, n_, i // c)),
        ]
        out_shape = [
            jax.ShapeDtypeStruct((c, b, t_pad, n, hvp), jnp.float32),
            jax.ShapeDtypeStruct((c, b, n, t_pad), jnp.float32),
        ]
    out, lse = _chain(
        pl,
        launches,
        forward_kernel,
        layout_of,
        [qp, kp, vp, *extra_args],
        [row_spec, kv_spec, v_spec, *extra_specs],
        out_specs,
        out_shape,
        "jax_flash_fwd",
        outs=outs,
        grid=(t_pad // bq * c, n, b),
        compiler_params=compiler_params(cfg),
        interpret=interpret,
    )
    if c > 1:
        out, lse = merge_partials([out[i] for i in range(c)], [lse[i] for i in range(c)])
        out = out.astype(q.dtype)
    return out[:, :t, :, :hv], lse[:, :, :t]


def _mosaic_backward_call(spec: AttentionSpec, q, k, v, masks: MaskInputs, out, lse, dout, dlse, *, configs, interpret):
    """The Mosaic GPU backward gated on `plain_inputs`, then the Triton general kernels gated on
    the negation, writing into its results (`_backend`'s docstring)."""
    run = plain_inputs(q, k, v, masks).astype(jnp.int32).reshape(1)
    grads = _mosaic_backward.backward(
        q,
        k,
        v,
        out,
        lse,
        dout.astype(q.dtype),
        dlse.astype(jnp.float32),
        scale=spec.scale,
        **_backend.band(spec),
        **_backend.masks(masks),
        run=run,
        interpret=_backend.INTERPRET,
    )
    return _backward_call(
        spec,
        q,
        k,
        v,
        masks,
        out,
        lse,
        dout,
        dlse,
        configs=configs,
        interpret=interpret,
        launches=((False, 1 - run),),
        outs=grads,
    )


def _backward_call(
    spec: AttentionSpec,
    q,
    k,
    v,
    masks: MaskInputs,
    out,
    lse,
    dout,
    dlse,
    *,
    configs,
    interpret,
    launches=((False, None),),
    outs=(),
):
    """The dK/dV and dQ kernels (plain or general) on (local) canonical arrays; `spec`
    describes them. `outs`: (dq, dk, dv) of an earlier launch the launches write into (no bias;
    ragged T or S padded to the tiles: copies)."""
    pl, _ = triton()
    interpret = _interpret(interpret)
    b, t, n, h = q.shape
    s, hv = k.shape[1], v.shape[-1]
    kh, g = spec.num_kv_heads, spec.group_size
    hp, hvp = padded_head_dim(h), padded_head_dim(hv)
    cfg_kv = _config(spec, masks, max(hp, hvp), "dkdv", configs, interpret)
    cfg_q = _config(spec, masks, max(hp, hvp), "dq", configs, interpret)
    ((bq1, bk1), (bq2, bk2)), t_pad, s_pad = _tiles(spec, [cfg_kv, cfg_q])

    # D = rowsum(dO ∘ O) (FlashAttention-2 §3.2); the lse cotangent shifts it by -dlse
    # (d lse / d logit = P). One fused XLA reduction, O(B·T·N·Hv).
    delta = jnp.einsum("btnh,btnh->bnt", dout.astype(jnp.float32), out.astype(jnp.float32)) - dlse.astype(jnp.float32)
    delta = pad_axis(delta, 2, t_pad)
    # Rows that see nothing (lse = -inf) and padded rows get lse = +inf, so that
    # P = exp2((x - lse)·log2 e) = 0 there; a NaN lse (a poisoned row)
    # stays NaN.
    lse_rows = jnp.where(lse == -jnp.inf, jnp.inf, lse.astype(jnp.float32))
    lse_rows = pad_axis(lse_rows, 2, t_pad, jnp.inf)
    qp = pad_axis(pad_axis(q, 3, hp), 1, t_pad)
    dop = pad_axis(pad_axis(dout.astype(q.dtype), 3, hvp), 1, t_pad)
    kp = pad_axis(pad_axis(k, 3, hp), 1, s_pad)
    vp = pad_axis(pad_axis(v, 3, hvp), 1, s_pad)
    extras = _Extras(spec, masks, t_pad, s_pad)

    # dK, dV: grid (key block, kv head · splits, batch); each program loops over G / splits
    # query heads of its kv head. splits = 1 (no partial sums) unless the grid would be too
    # small to fill the GPU (MQA/GQA at small batch); then f32 partials are summed below.
    splits = 1 if outs else _heuristics.pallas_group_splits(g, (s_pad // bk1) * kh * b, interpret, _num_sms())
    pad_rows = lambda x, length, width: pad_axis(pad_axis(x, 3, width), 1, length)
    outs_dq = (pad_rows(outs[0], t_pad, hp),) if outs else ()
    outs_dkv = (pad_rows(outs[1], s_pad, hp), pad_rows(outs[2], s_pad, hvp)) if outs else ()
    q5 = qp.reshape(b, t_pad, kh, g, hp)
    do5 = dop.reshape(b, t_pad, kh, g, hvp)
    rows5 = pl.BlockSpec((None, t_pad, None, g, hp), lambda j, h_, b_: (b_, 0, h_ // splits, 0, 0))
    do_rows5 = pl.BlockSpec((None, t_pad, None, g, hvp), lambda j, h_, b_: (b_, 0, h_ // splits, 0, 0))
    kv_blk = pl.BlockSpec((None, bk1, None, hp), lambda j, h_, b_: (b_, j, h_ // splits, 0))
    v_blk = pl.BlockSpec((None, bk1, None, hvp), lambda j, h_, b_: (b_, j, h_ // splits, 0))
    dkv_blk = pl.BlockSpec((None, bk1, None, hp), lambda j, h_, b_: (b_, j, h_, 0))
    dv_blk = pl.BlockSpec((None, bk1, None, hvp), lambda j, h_, b_: (b_, j, h_, 0))
    stat5 = pl.BlockSpec((None, None, g, t_pad), lambda j, h_, b_: (b_, h_ // splits, 0, 0))
    extra_args, extra_specs = extras.key_grid(bk1, t_pad, splits)
    layout_of = functools.partial(_layout, spec, masks, bq1, bk1, t_pad, s_pad, group=g // splits, splits=splits)
    dkv_dtype = lambda x: jnp.float32 if splits > 1 else x.dtype
    dk, dv = _chain(
        pl,
        launches,
        dkdv_kernel,
        layout_of,
        [q5, kp, vp, do5, lse_rows.reshape(b, kh, g, t_pad), delta.reshape(b, kh, g, t_pad), *extra_args],
        [rows5, kv_blk, v_blk, do_rows5, stat5, stat5, *extra_specs],
        [dkv_blk, dv_blk],
        [
            jax.ShapeDtypeStruct((b, s_pad, kh * splits, hp), dkv_dtype(k)),
            jax.ShapeDtypeStruct((b, s_pad, kh * splits, hvp), dkv_dtype(v)),
        ],
        "jax_flash_bwd_dkdv",
        outs=outs_dkv,
        grid=(s_pad // bk1, kh * splits, b),
        compiler_params=compiler_params(cfg_kv),
        interpret=interpret,
    )

    # dQ (and dS for dbias): grid (query block, head, batch), looping over key blocks.
    write_ds = masks.bias is not None
    row_blk = pl.BlockSpec((None, bq2, None, hp), lambda i, n_, b_: (b_, i, n_, 0))
    do_blk = pl.BlockSpec((None, bq2, None, hvp), lambda i, n_, b_: (b_, i, n_, 0))
    kv_full = pl.BlockSpec((None, s_pad, None, hp), lambda i, n_, b_: (b_, 0, n_ // g, 0))
    v_full = pl.BlockSpec((None, s_pad, None, hvp), lambda i, n_, b_: (b_, 0, n_ // g, 0))
    stat = pl.BlockSpec((None, None, bq2), lambda i, n_, b_: (b_, n_, i))
    extra_args, extra_specs = extras.row_grid(bq2, s_pad)
    out_specs = [row_blk]
    out_shape = [jax.ShapeDtypeStruct((b, t_pad, n, hp), q.dtype)]
    if write_ds:
        # dS per (batch, head) tile, summed over the axes the bias broadcasts along below.
        out_specs.append(pl.BlockSpec((None, None, bq2, s_pad), lambda i, n_, b_: (b_, n_, i, 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, n, t_pad, s_pad), jnp.float32))
    res = _chain(
        pl,
        launches,
        dq_kernel,
        functools.partial(_layout, spec, masks, bq2, bk2, t_pad, s_pad, write_ds=write_ds),
        [qp, kp, vp, dop, lse_rows, delta, *extra_args],
        [row_blk, kv_full, v_full, do_blk, stat, stat, *extra_specs],
        out_specs,
        out_shape,
        "jax_flash_bwd_dq",
        outs=outs_dq,
        grid=(t_pad // bq2, n, b),
        compiler_params=compiler_params(cfg_q),
        interpret=interpret,
    )
    dq = res[0][:, :t, :, :h]
    dbias = None
    if write_ds:
        bias = masks.bias
        assert bias is not None  # write_ds is set by the bias
        ds = res[1][:, :, :t, :s]
        axes = tuple(ax for ax in range(4) if bias.shape[ax] == 1 and ds.shape[ax] != 1)
        dbias = jnp.sum(ds, axis=axes, keepdims=True).astype(bias.dtype)
    if splits > 1:
        dk = dk.reshape(b, s_pad, kh, splits, hp).sum(3).astype(k.dtype)
        dv = dv.reshape(b, s_pad, kh, splits, hvp).sum(3).astype(v.dtype)
    return dq, dk[:, :s, :, :h], dv[:, :s, :, :hv], dbias


# Triton's launch grid (jax's Pallas Triton lowering): grid.x holds at most 2**31 - 1
# programs and grid.y, grid.z 65535; a grid whose heads or batch axis is larger is folded
# into grid.x. The kernels' grids are (blocks, heads, batch) with blocks of at least 16 rows or
# keys and at most N heads (the dK/dV grid's K·splits). Checked on every platform so that a
# call is refused the same way interpreted on a CPU as on a GPU.
MIN_BLOCK = 16
MAX_GRID_X = 2**31 - 1
MAX_GRID_YZ = 65535


def launch_limit(spec: AttentionSpec) -> str | None:
    """Why Triton cannot launch the kernels' grids for `spec`, or None."""
    b, n = spec.batch, spec.num_heads
    if b <= MAX_GRID_YZ and n <= MAX_GRID_YZ:
        return None
    blocks = -(-max(spec.q_len, spec.kv_len) // MIN_BLOCK)
    programs = blocks * n * b
    if programs >= MAX_GRID_X:
        return (
            f"with batch B={b} or heads N={n} above Triton's grid.y/z limit of 65535 the grid "
            f"is folded into grid.x: ceil(max(T, S)/{MIN_BLOCK})·N·B = {programs} programs, "
            "above its limit of 2**31 - 1"
        )
    return None


def flex_limit(spec: AttentionSpec, interpret: bool) -> str | None:
    """Why the kernels cannot run this flex_attention call, or None: a user function they
    cannot evaluate on a tile, or (compiled by Triton) block-mask blocks that are not tiles."""
    flex = spec.flex
    assert flex is not None
    for fn in (flex.mask_mod, flex.score_mod):
        why = _flex_tiles.reason(fn)
        if why:
            return why
    if flex.block_size is not None and not interpret:
        bq, bk = flex.block_size
        if any(x < MIN_BLOCK or x & (x - 1) for x in (bq, bk)):
            return (
                f"the block mask's blocks ({bq}, {bk}) are its tiles, which Triton needs to be powers of two "
                f">= {MIN_BLOCK} (create_block_mask(..., block_size=128) is the default)"
            )
    return None


def flex_description(spec: AttentionSpec) -> str:
    """What `explain` says of a flex call's kernels."""
    flex = spec.flex
    assert flex is not None
    if flex.block_size is None:
        loops = "no block mask: every tile runs" + (", evaluating mask_mod" if flex.mask_mod is not None else "")
    else:
        loops = (
            f"the block mask's {flex.block_size[0]}x{flex.block_size[1]} blocks are the tiles: each program runs its "
            "fully visible blocks, then its partly visible ones with mask_mod, and no empty one"
        )
    functions = [f.name for f in (flex.score_mod, flex.mask_mod) if f is not None]
    return (
        f"flex_attention: {loops}; {' and '.join(functions) or 'no user function'} evaluated on each tile; no split-KV"
    )


class PallasImplementation:
    """Pallas/Triton kernels on a GPU; the same kernels interpreted on a CPU (tests)."""

    name = "pallas"

    def unsupported(self, spec: AttentionSpec) -> str | None:
        plat = _registry.platform()
        if plat not in ("gpu", "cpu"):
            return f"runs on GPUs through Triton (and interpreted on the CPU), not on {plat}"
        missing = triton_missing()
        if missing:
            return missing
        if spec.dtype not in DTYPES:
            return f"supports dtypes {DTYPES}, got {spec.dtype}"
        if spec.head_dim > MAX_HEAD_DIM:
            return f"supports head dims up to {MAX_HEAD_DIM}, got {spec.head_dim}"
        if spec.v_head_dim > MAX_HEAD_DIM:
            return f"supports value head dims up to {MAX_HEAD_DIM}, got {spec.v_head_dim}"
        if spec.flex is not None:
            why = flex_limit(spec, _interpret(None))
            if why:
                return why
        try:
            _backend.choose(spec)  # pallas_backend="mosaic_gpu" on a call the kernel cannot serve
        except ValueError as e:
            return str(e)
        return launch_limit(spec)

    # flex_attention: score_mod and mask_mod evaluated on each tile inside the kernels
    # (`pallas._flex_tiles`), the block mask's lists driving the loops.
    serves_flex = True

    def head_dims(self) -> str:
        return f"any pair with H, Hv <= {MAX_HEAD_DIM}"

    def note(self, spec: AttentionSpec) -> str | None:
        """What `explain` adds: the forward's split-KV (a flex call: its loops), and on a CPU
        that the kernels are interpreted, which is for tests."""
        split = flex_description(spec) if spec.flex is not None else split_kv_description(spec)
        split = f"{_heuristics.pallas_kernels_description(spec)}; {_backend.description(spec)}; {split}"
        deprecation = triton_deprecation()
        if deprecation:
            split += f"; {deprecation}"
        if _interpret(None):
            return f"interpreted (slow): the Triton kernels run with interpret=True on the CPU; {split}"
        return split

    def summary(self, spec: AttentionSpec) -> str:
        split = (
            "flex: the block lists drive the loops, no split-KV" if spec.flex is not None else split_kv_summary(spec)
        )
        if _backend.runs_mosaic(spec):
            split = f"forward on Mosaic GPU, {split}"
        return f"interpreted on the CPU (slow, for tests), {split}" if _interpret(None) else split

    def forward(self, spec, q, k, v, masks):
        _heuristics.forced(spec, "pallas_split_kv")  # an unknown JAX_FLASH_PALLAS_SPLIT_KV: a ValueError now
        return forward(spec, q, k, v, masks)

    def backward(self, spec, q, k, v, masks, out, lse, dout, dlse):
        return backward(spec, q, k, v, masks, out, lse, dout, dlse)

    # paged_attention (jax_flash/inference/paged.py): a decode kernel of its own
    # (`inference/_decode.py`), on request only until it has been measured on a GPU.
    paged_default = False

    def paged_unsupported(self, pspec: PagedSpec) -> str | None:
        return _decode.unsupported(pspec)

    def paged_summary(self, pspec: PagedSpec) -> str:
        split = f"split-KV over {pspec.splits} page chunks" if pspec.splits > 1 else "split-KV off"
        where = ", interpreted on the CPU (slow, for tests)" if _decode.note() else ""
        return f"on request only{where}, {split}"

    def paged_note(self, pspec: PagedSpec) -> str:
        split = f"split-KV over {pspec.splits} page chunks" if pspec.splits > 1 else "no split-KV"
        extra = _decode.note()
        return (
            "on request only (implementation=None never picks it); decode kernel, one "
            f"page per key block, GQA-packed rows; {split}" + (f"; {extra}" if extra else "")
        )

    def paged_forward(self, pspec, q, key_pages, value_pages, table, lengths, sinks=None):
        return _decode.paged_forward(pspec, q, key_pages, value_pages, table, lengths, sinks=sinks)


IMPLEMENTATION = PallasImplementation()
