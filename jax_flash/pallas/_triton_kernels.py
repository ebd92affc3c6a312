"""Kernel bodies of the `pallas` implementation (FlashAttention-2 on the Triton backend).

Each kernel sees squeezed 2-D tiles: rows × padded head dim (Hp for q, k, dq, dk; Hvp
for v, out, dout, dv: the value head dim may differ). The wrapper in
`jax_flash.pallas` pads, builds the BlockSpecs and launches them.

Two variants of each kernel, chosen per call (`Layout.plain`):

- **the plain kernels** run where every raw score q·k of the call is finite and every v is
  (`_triton.plain_inputs`, one reduction over each of q, k and v per call, tested on the
  device; the static rule is `_heuristics.pallas_plain_blocker`: no soft cap, bias or flex
  function, a scale in [2^-126, 2^127)); both variants are launched, each gated on that flag
  (`_gated`). Their key loops do only the attention: no poisoning, no finite copies,
  no clamp. The forward keeps the row max m of the raw scores and takes
  p = exp2((s - m)·c), c = scale·log2 e rounded once per call: one subtraction rounded once
  (exact by Sterbenz where s >= m/2), one multiply and one exp2 per score; the row max gets
  exp2(0) = 1 at any magnitude, and no FMA contraction can make an exponent positive (the
  multiply consumes the difference). The statistics become logits once per row at the end:
  scale·m rounded once (the max of the rounded logits, rounding being monotone), the sink
  joined as one more logit (-inf where the call has none: `_join_sink`), lse = that + log l,
  in natural units as before. The backward
  recomputes p = exp2(min(x - lse, 0)·log2 e) from the natural logit x = scale·s: the min
  (one instruction, no NaN can reach it) keeps the exponent <= 0 where Triton contracts
  scale·s - lse into one FMA.
- **the general kernels** serve every call, non-finite inputs too. Units: logits, running
  maxima and lse are natural, each logit rounded to float32 once; every exponent is the
  difference of two such values, then times log2(e) into one exp2: p = exp2((x - m)·log2 e).
  (Folding log2(e) into the scale instead saves that multiply but rounds the base-2 logit
  and the natural lse differently: at |logit| ~ 1e9 the backward's exp2(x₂ - lse·log2 e) of
  a row's top key is then 2^-17, not 1.) Non-finite inputs follow the numerical contract
  (docs/numerical-contract.md) with the functions of `jax_flash._numerics`, as
  `jax_flash.xla` does: ±inf raw scores become NaN, a NaN score reaches l through exp2 even
  where the row max drops it (Triton's max does), a row is empty only when l == 0,
  exponents are clamped to <= 0 by a select (min(NaN, 0) may be 0) (the scaled logit may be
  evaluated twice, once fused into an FMA), and the products that meet masked weights (P·V,
  dS·K, dSᵀ·Q) run over finite copies of their tile, a row that sees a non-finite v being
  made NaN by a per-key flag.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jax_flash import _dropout, _masking
from jax_flash._numerics import clamp_exponent, finite_part, poison_infinite
from jax_flash._spec import AttentionSpec
from jax_flash.pallas import _flex_tiles
from jax_flash.pallas._table import Config

LOG2E = math.log2(math.e)


TRITON_MODULE = "jax.experimental.pallas.triton"


def triton():
    """(jax.experimental.pallas, its Triton module), or ImportError with the reason. Imported
    by name through sys.modules, so a JAX without the module (or a test that sets its entry to
    None) is an ImportError here, never an AttributeError inside Pallas."""
    return pl, importlib.import_module(TRITON_MODULE)


def jax_version() -> tuple[int, int]:
    """(major, minor) of the installed JAX."""
    major, minor = jax.__version__.split(".")[:2]
    return int(major), int(minor)


def triton_missing() -> str | None:
    """None when the installed JAX has Pallas's Triton backend, else why `pallas` cannot run."""
    try:
        triton()
    except ImportError as e:
        return (
            f"this JAX ({jax.__version__}) has no Pallas Triton backend ({TRITON_MODULE} cannot be imported: {e}); "
            "pallas needs a JAX that ships it (implementation=None runs cuda or xla instead)"
        )
    return None


def triton_deprecation() -> str | None:
    """What `explain` adds on a JAX that deprecated Pallas's Triton backend (0.11 and later)."""
    if jax_version() < (0, 11):
        return None
    return (
        f"JAX {jax.__version__} deprecates Pallas's Triton backend and will remove it; pallas then becomes "
        "unavailable, and cuda (the kernels of a CUDA wheel) or xla serve the call"
    )


def compiler_params(cfg: Config):
    """Triton parameters: `CompilerParams` in jax 0.10-0.12 (`TritonCompilerParams` before)."""
    _, plt = triton()
    cls = getattr(plt, "CompilerParams", None) or plt.TritonCompilerParams
    return cls(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static facts the kernels need beyond the spec: tiles, padding, optional inputs."""

    spec: AttentionSpec
    block_q: int
    block_k: int
    t_pad: int
    s_pad: int
    has_lengths: bool = False
    has_segments: bool = False
    has_q_offset: bool = False  # a [1] query offset per program (its batch row)
    has_sinks: bool = False  # a [1] sink logit per program (its head; forward only)
    bias_rows: bool | None = None  # None: no bias; else whether the bias varies along T
    bias_cols: bool | None = None  # ... and along S
    mask_rows: bool | None = None
    mask_cols: bool | None = None
    group: int = 1  # query heads one dK/dV program loops over (of the kv head's G)
    splits: int = 1  # dK/dV programs per kv head, each summing `group` heads' share
    # Forward split-KV: programs per query block, each over a contiguous chunk of its key
    # blocks, writing a normalised float32 partial (out, lse) that the caller merges by lse.
    kv_chunks: int = 1
    write_ds: bool = False  # dQ kernel: also store dS (for dbias)
    # flex_attention (spec.flex): per closed-over array of the mask_mod / score_mod, whether
    # it is a bool array (it travels as int8); block_lists: the block mask's lists of full
    # and partly visible blocks drive the loops (the tiles are then its blocks).
    mask_consts: tuple[bool, ...] = ()
    score_consts: tuple[bool, ...] = ()
    block_lists: bool = False
    # The plain kernels (the module's docstring): finite scores and values, no cap or bias.
    plain: bool = False
    # Gated launch (`jax_flash.pallas._triton`: the plain and the general kernels are both
    # launched, no conditional): a last int32 [1] input, the program returns at once where it
    # is 0; and `aliased` inputs after it, the previous launch's outputs that this one writes
    # into (input_output_aliases), never read.
    gated: bool = False
    aliased: int = 0

    @property
    def has_bias(self) -> bool:
        return self.bias_rows is not None

    @property
    def has_mask(self) -> bool:
        return self.mask_rows is not None

    @property
    def ragged_keys(self) -> bool:
        return self.s_pad != self.spec.kv_len

    @property
    def masks_everywhere(self) -> bool:
        """Masks that are not a band (lengths, segments, dense mask) need every tile masked."""
        return self.has_lengths or self.has_segments or self.has_mask

    @property
    def folds_scale(self) -> bool:
        """Without bias or soft cap, the scale is one multiply of the raw scores."""
        return not self.has_bias and self.spec.soft_cap is None

    @property
    def exp2_factor(self) -> float:
        """The plain forward's c = scale·log2 e (raw scores to base-2 exponents), rounded to
        float32 once; finite and nonzero for the scales `plain_blocker` lets through."""
        return float(np.float32(self.spec.scale * LOG2E))


class Inputs:
    """Unpacks the refs a kernel receives, in the order the wrapper passes them."""

    # Pallas refs (untyped). The operands named by `names` (q, k, v; do, lse, delta in the
    # backward kernels) are set from the refs in order; an optional input absent from the
    # layout is None.
    q: Any
    k: Any
    v: Any
    do: Any
    lse: Any
    delta: Any
    q_len: Any
    kv_len: Any
    q_seg: Any
    kv_seg: Any
    bias: Any
    mask: Any
    q_offset: Any
    sinks: Any
    seed: Any
    run: Any
    # flex_attention: [(ref, is_bool)] of the user functions' arrays, and the block lists
    # (full count, full indices, partial count, partial indices) of this program's grid.
    mask_consts: list[Any]
    score_consts: list[Any]
    lists: tuple[Any, Any, Any, Any] | None
    outputs: list[Any]

    def __init__(self, layout: Layout, refs, names):
        refs = list(refs)
        for name in names:
            setattr(self, name, refs.pop(0))
        self.q_len = self.kv_len = self.q_seg = self.kv_seg = self.bias = self.mask = None
        self.q_offset = self.sinks = self.seed = None
        if layout.has_lengths:
            self.q_len, self.kv_len = refs.pop(0), refs.pop(0)
        if layout.has_segments:
            self.q_seg, self.kv_seg = refs.pop(0), refs.pop(0)
        if layout.has_q_offset:
            self.q_offset = refs.pop(0)
        if layout.has_bias:
            self.bias = refs.pop(0)
        if layout.has_mask:
            self.mask = refs.pop(0)
        if layout.has_sinks:
            self.sinks = refs.pop(0)
        self.mask_consts = [(refs.pop(0), is_bool) for is_bool in layout.mask_consts]
        self.score_consts = [(refs.pop(0), is_bool) for is_bool in layout.score_consts]
        self.lists = tuple(refs.pop(0) for _ in range(4)) if layout.block_lists else None
        self.seed = refs.pop(0) if layout.spec.has_dropout else None  # uint32 [2]
        self.run = refs.pop(0) if layout.gated else None  # int32 [1]: 0 = return at once
        del refs[: layout.aliased]
        self.outputs = refs
        self.ids: tuple[Any, ...] = ()

    def program_id(self, axis: int):
        """The program's id along a grid axis, read once at the kernel's top (`_gated`)."""
        return self.ids[axis]


def _iota(n: int, axis: int):
    shape = (n, 1) if axis == 0 else (1, n)
    return lax.broadcasted_iota(jnp.int32, shape, axis)


def _dot(a, b, trans_b: bool = False, trans_a: bool = False):
    """a @ b (optionally transposed operands) with float32 accumulation."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def dense_tile(ref, rows_vary: bool, cols_vary: bool, lead, q0, bq: int, k0, bk: int):
    """Tile of a dense [T|1, S|1] input (after `lead` leading indices) as [bq|1, bk|1]."""
    r = pl.ds(q0, bq) if rows_vary else slice(None)
    c = pl.ds(k0, bk) if cols_vary else slice(None)
    return ref[(*lead, r, c)]


class TileMath:
    """The per-tile pieces every kernel shares: visibility and transformed logits."""

    def __init__(self, layout: Layout, inputs: Inputs):
        self.lay, self.inp = layout, inputs
        spec = layout.spec
        self.q_len = None if inputs.q_len is None else inputs.q_len[0]
        self.kv_len = None if inputs.kv_len is None else inputs.kv_len[0]
        self.kv_limit = spec.kv_len if layout.ragged_keys else None
        # Query t sits at key position q_offset + t: the window is the band of diagonals
        # band[0] <= s - t <= band[1] (Python ints when there is no offset).
        self.q_offset = 0 if inputs.q_offset is None else inputs.q_offset[0]
        self.band = spec.band(self.q_offset)

    def visible(self, q0, k0, q_seg, kv_seg, mask_tile, bq: int, bk: int):
        """Bool [bq, bk] (or None): the one definition in `_masking`, plus the dense mask."""
        rows = q0 + _iota(bq, 0)
        cols = k0 + _iota(bk, 1)
        vis = _masking.visible(
            self.lay.spec,
            rows,
            cols,
            q_lengths=self.q_len,
            kv_lengths=self.kv_len,
            q_segment_ids=None if q_seg is None else q_seg[:, None],
            kv_segment_ids=None if kv_seg is None else kv_seg[None, :],
            kv_limit=self.kv_limit,
            band=self.band,
        )
        if mask_tile is not None:
            m = mask_tile != 0
            vis = m if vis is None else vis & m
        return vis

    def flex_visible(self, masked: bool, q0, k0, bq: int, bk: int, batch, head):
        """flex_attention's visibility of a tile (bool [bq, bk], or None: all of it): mask_mod
        where the block is partly visible (`masked`), and the ragged key tail everywhere."""
        flex = self.lay.spec.flex
        assert flex is not None
        vis = None
        if masked and flex.mask_mod is not None:
            args = (batch, head, q0 + _iota(bq, 0), k0 + _iota(bk, 1))
            vis = _flex_tiles.tile(_flex_tiles.evaluate(flex.mask_mod, self.inp.mask_consts, args), (bq, bk))
        if self.kv_limit is not None:
            limit = k0 + _iota(bk, 1) < self.kv_limit
            vis = limit if vis is None else vis & limit
        return vis

    def flex_score(self, x, vis, q0, k0, batch, head):
        """score_mod of the tile's scaled logits x [bq, bk] (masked ones enter as 0, so that a
        masked NaN never reaches a derivative); x itself without a score_mod."""
        flex = self.lay.spec.flex
        assert flex is not None
        if flex.score_mod is None:
            return x
        if vis is not None:
            x = jnp.where(vis, x, 0.0)
        bq, bk = x.shape
        args = (x, batch, head, q0 + _iota(bq, 0), k0 + _iota(bk, 1))
        return _flex_tiles.tile(_flex_tiles.evaluate(flex.score_mod, self.inp.score_consts, args), x.shape).astype(
            jnp.float32
        )

    def flex_score_slope(self, x, vis, q0, k0, batch, head):
        """(score_mod of x, its derivative in the score at every position, or None without a
        score_mod): the backward's chain rule inside the tile (score_mod is element-wise)."""
        flex = self.lay.spec.flex
        assert flex is not None
        if flex.score_mod is None:
            return x, None
        return jax.jvp(lambda s: self.flex_score(s, vis, q0, k0, batch, head), (x,), (jnp.ones_like(x),))

    def dropout_keep(self, batch, head, q0, k0, bq: int, bk: int):
        """Bool [bq, bk]: dropout's keep bits of the tile (`_dropout`, global batch row,
        query head, row and column), or None without dropout. One Philox call per element
        (the word of its column), which keeps the tile 2-D for Triton."""
        spec = self.lay.spec
        if not spec.has_dropout:
            return None
        seed = (self.inp.seed[0], self.inp.seed[1])
        rows = (q0 + _iota(bq, 0)).astype(jnp.uint32)
        cols = (k0 + _iota(bk, 1)).astype(jnp.uint32)
        return _dropout.keep_mask(
            seed, spec.dropout_rate, jnp.asarray(batch, jnp.uint32), jnp.asarray(head, jnp.uint32), rows, cols
        )

    def logits(self, scores, bias_tile):
        """(logits, the soft-capped/biased logits for the cap's derivative or None) of raw
        scores q·kᵀ [f32]."""
        spec = self.lay.spec
        scores = poison_infinite(scores)
        if self.lay.folds_scale:
            return scores * spec.scale, None
        t = _masking.transform_logits(spec, scores * spec.scale, bias_tile)
        return t, t


def flex_key_segments(layout: Layout, inp: Inputs, nk: int):
    """flex_attention's key loops of a row program (lo, hi, masked, block): the block mask's
    fully visible blocks (no mask_mod), then its partly visible ones (mask_mod), each
    `block(jj)` the key block of loop index jj; without a block mask, every key block (masked
    when there is a mask_mod)."""
    flex = layout.spec.flex
    assert flex is not None
    if inp.lists is None:
        return ((0, nk, flex.mask_mod is not None, None),)
    full_n, full_idx, part_n, part_idx = inp.lists  # [1], [nk], [1], [nk]
    return (
        (0, full_n[0], False, lambda jj: full_idx[jj]),
        (0, part_n[0], True, lambda jj: part_idx[jj]),
    )


def flex_query_segments(layout: Layout, inp: Inputs, nq: int, head):
    """The same for the query loops of a key program, for query head `head` (the block mask's
    lists per key block: [N|1] counts, [N|1, nq] indices)."""
    flex = layout.spec.flex
    assert flex is not None
    if inp.lists is None:
        return ((0, nq, flex.mask_mod is not None, None),)
    full_n, full_idx, part_n, part_idx = inp.lists
    h = head if full_n.shape[0] != 1 else 0
    return (
        (0, full_n[h], False, lambda ii: full_idx[h, ii]),
        (0, part_n[h], True, lambda ii: part_idx[h, ii]),
    )


def _loop(segments, step, carry):
    """Run `step(masked, block)` bodies over (lo, hi, masked, block) segments."""
    for lo, hi, masked, block in segments:
        carry = lax.fori_loop(lo, hi, step(masked, block), carry)
    return carry


def band_segments(lo, hi, full_lo, full_hi, left: bool = True, right: bool = True):
    """Split [lo, hi) into masked [lo, a), unmasked [a, b), masked [b, hi); a masked end
    known at trace time to be empty (`left`/`right` False: no window edge or ragged tail
    there) is left out, so that no loop is emitted for it."""
    a = jnp.clip(full_lo, lo, jnp.maximum(lo, hi)) if left else lo
    b = jnp.clip(full_hi, a, jnp.maximum(a, hi)) if right else hi
    return ((lo, a, True),) * left + ((a, b, False),) + ((b, hi, True),) * right


def key_segments(layout: Layout, tm: TileMath, q0, q1, nk: int):
    """Key-block loop ranges for queries [q0, q1): (lo, hi, masked) triples.

    Only band tiles (causal diagonal, window edges, the ragged key tail) pay for mask
    arithmetic; interior tiles run the plain online softmax (FlashAttention-2 §3.1.1).
    Sequence lengths also bound the loop: keys past kv_len and query blocks past q_len
    are never visited.
    """
    spec, bk = layout.spec, layout.block_k
    band_lo, band_hi = tm.band
    lo, hi = spec.key_block_range(q0, q1, bk, nk, tm.q_offset)
    lo = jnp.asarray(lo, jnp.int32)
    hi = jnp.asarray(hi, jnp.int32)
    if tm.kv_len is not None:
        hi = jnp.minimum(hi, (tm.kv_len + bk - 1) // bk)
    if tm.q_len is not None:
        hi = jnp.where(q0 >= tm.q_len, lo, hi)
    hi = jnp.maximum(lo, hi)
    if layout.masks_everywhere:
        return ((lo, hi, True),)
    if not spec.is_windowed and not layout.ragged_keys:
        return ((lo, hi, False),)
    full_lo, full_hi = lo, hi
    if band_lo is not None:  # every key >= (q1 - 1) + band_lo
        full_lo = (q1 - 1 + band_lo + bk - 1) // bk
    if band_hi is not None:  # every key <= q0 + band_hi
        full_hi = (q0 + band_hi + 1) // bk
    if layout.ragged_keys:
        full_hi = jnp.minimum(full_hi, spec.kv_len // bk)
    return band_segments(lo, hi, full_lo, full_hi, band_lo is not None, band_hi is not None or layout.ragged_keys)


def query_segments(layout: Layout, tm: TileMath, k0, k1, nq: int, ragged_block):
    """Query-block loop ranges for keys [k0, k1) (the dK/dV kernel), as `key_segments`."""
    spec, bq = layout.spec, layout.block_q
    band_lo, band_hi = tm.band
    lo, hi = spec.query_block_range(k0, k1, bq, nq, tm.q_offset)
    lo = jnp.asarray(lo, jnp.int32)
    hi = jnp.asarray(hi, jnp.int32)
    if tm.q_len is not None:
        hi = jnp.minimum(hi, (tm.q_len + bq - 1) // bq)
    if tm.kv_len is not None:
        hi = jnp.where(k0 >= tm.kv_len, lo, hi)
    hi = jnp.maximum(lo, hi)
    if layout.masks_everywhere:
        return ((lo, hi, True),)
    if not spec.is_windowed and not layout.ragged_keys:
        return ((lo, hi, False),)
    full_lo, full_hi = lo, hi
    if band_hi is not None:  # every query t >= (k1 - 1) - band_hi
        full_lo = (k1 - 1 - band_hi + bq - 1) // bq
    if band_lo is not None:  # every query t <= k0 - band_lo
        full_hi = (k0 - band_lo + 1) // bq
    if layout.ragged_keys:  # the block holding the ragged key tail is masked throughout
        full_hi = jnp.where(ragged_block, full_lo, full_hi)
    return band_segments(lo, hi, full_lo, full_hi, band_hi is not None, band_lo is not None or layout.ragged_keys)


# ---------------------------------------------------------------------------------------
# Forward: grid (query block, head, batch); FlashAttention-2 Algorithm 1.


def _softmax_init(inp: Inputs, bq: int, first_chunk=True, plain=False):
    """(m, l) [bq] before the first key tile: -inf and 0, or with a sink the state after it
    alone, m = sink and l = 1 (NaN for a NaN or +inf sink, which poisons
    every row of the head; a -inf sink is no sink). Split-KV: the sink is the first chunk's.
    The plain forward joins its sink at the end (`_join_sink`): its m is in raw units."""
    if inp.sinks is None or plain:
        return jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32)
    sink = jnp.where(first_chunk, inp.sinks[...].reshape(1), -jnp.inf)  # [1]: this program's head
    m = jnp.broadcast_to(sink, (bq,))
    l = jnp.broadcast_to(jnp.where(sink < jnp.inf, 1.0, jnp.nan), (bq,))
    return m, l


def _join_sink(inp: Inputs, top, l, acc, first_chunk):
    """The plain forward's sink joined as one more logit of every row, after the key loop
    (every plain forward has one: -inf where the call has none, `_forward_call`):
    top [bq] the rows' largest logit (-inf: none), l, acc relative to it. A -inf sink is no
    sink (f = 1, nothing added: the result of the call without it, bit for bit); a NaN or
    +inf one makes l NaN (exp2(NaN), or exp2(inf - inf)), which poisons every row of the
    head, empty ones too, whether or not the max kept the NaN."""
    sink = jnp.where(first_chunk, inp.sinks[...].reshape(1), -jnp.inf)  # [1]
    new_top = jnp.maximum(top, sink)
    shift = jnp.where(new_top == -jnp.inf, 0.0, new_top)  # a row with neither: stays empty
    f = jnp.exp2((top - shift) * LOG2E)
    l = l * f + jnp.exp2((sink - shift) * LOG2E)
    return new_top, l, acc * f[:, None]


def _gated(body, layout: Layout, refs, names):
    """Run `body(inputs, layout)`, or where the launch is gated (`Layout.gated`) only when its
    run flag is nonzero: one scalar load, and a program of the launch that does not apply
    returns at once, writing nothing (its outputs keep the aliased values). The program ids
    are read before the branch (`Inputs.program_id`: interpret mode replaces them at the top
    level of the kernel only)."""
    inp = Inputs(layout, refs, names)
    inp.ids = tuple(pl.program_id(axis) for axis in range(3))
    if inp.run is None:
        body(inp, layout)
    else:
        pl.when(inp.run[0] != 0)(lambda: body(inp, layout))


def forward_kernel(*refs, layout: Layout):
    _gated(_forward_kernel, layout, refs, ("q", "k", "v"))


def _forward_kernel(inp: Inputs, layout: Layout):
    out_ref, lse_ref = inp.outputs
    lay, spec = layout, layout.spec
    bq, bk = lay.block_q, lay.block_k
    nk = lay.s_pad // bk
    chunks = lay.kv_chunks
    q0 = inp.program_id(0) // chunks * bq
    chunk = inp.program_id(0) % chunks
    batch, head = inp.program_id(2), inp.program_id(1)
    tm = TileMath(lay, inp)
    q = inp.q[...]  # [bq, Hp], resident for the whole key loop
    q_seg = None if inp.q_seg is None else inp.q_seg[...]

    def visible(masked, k0):
        """The tile's visibility (bool [bq, bk]) or None: every pair visible."""
        if spec.flex is not None:
            return tm.flex_visible(masked, q0, k0, bq, bk, batch, head)
        if not masked:
            return None
        kv_seg = None if inp.kv_seg is None else inp.kv_seg[pl.ds(k0, bk)]
        mask = None
        if lay.has_mask:
            mask = dense_tile(inp.mask, bool(lay.mask_rows), bool(lay.mask_cols), (), 0, bq, k0, bk)
        return tm.visible(q0, k0, q_seg, kv_seg, mask, bq, bk)

    def plain_step(masked, block=None):
        c = lay.exp2_factor

        def body(jj, carry):
            m, l, acc, bad = carry  # m: the rows' largest raw score; bad stays 0
            k0 = jj * bk
            s = _dot(q, inp.k[pl.ds(k0, bk), :], trans_b=True)  # raw scores [bq, bk]
            vis = visible(masked, k0)
            if vis is not None:
                s = jnp.where(vis, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that has seen nothing
            p = jnp.exp2((s - m_use[:, None]) * c)
            alpha = jnp.exp2((m - m_use) * c)
            l = alpha * l + jnp.sum(p, axis=1)
            keep = tm.dropout_keep(batch, head, q0, k0, bq, bk)
            if keep is not None:  # after the statistics: P·V of the kept weights only
                p = jnp.where(keep, p, 0.0)
            v = inp.v[pl.ds(k0, bk), :]
            acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v)
            return m_new, l, acc, bad

        return body

    def step(masked, block=None):
        def body(jj, carry):
            m, l, acc, bad = carry  # [bq], [bq], [bq, Hvp], [bq] (1: sees a bad v)
            k0 = (jj if block is None else block(jj)) * bk
            k = inp.k[pl.ds(k0, bk), :]
            v = inp.v[pl.ds(k0, bk), :]
            bad_v = jnp.max(jnp.where(jnp.isfinite(v), 0.0, 1.0).astype(jnp.float32), axis=1)[None, :]
            v = finite_part(v)
            bias = None
            if lay.has_bias:
                bias = dense_tile(inp.bias, bool(lay.bias_rows), bool(lay.bias_cols), (), 0, bq, k0, bk)
            x, _ = tm.logits(_dot(q, k, trans_b=True), bias)
            vis = visible(masked, k0)
            if spec.flex is not None:
                x = tm.flex_score(x, vis, q0, k0, batch, head)
            if vis is not None:
                x = jnp.where(vis, x, -jnp.inf)
                bad_v = jnp.where(vis, bad_v, 0.0)
            # A NaN logit may be dropped by the max, never by exp2(NaN): l and acc carry it.
            m_new = jnp.maximum(m, jnp.max(x, axis=1))
            # A row that has seen nothing keeps m = -inf: subtract 0 instead, so that
            # exp2(-inf) = 0 rather than exp2(-inf + inf) = NaN.
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp2(clamp_exponent(x - m_use[:, None]) * LOG2E)
            alpha = jnp.exp2((m - m_use) * LOG2E)
            l = alpha * l + jnp.sum(p, axis=1)
            keep = tm.dropout_keep(batch, head, q0, k0, bq, bk)
            if keep is not None:  # after the statistics: P·V of the kept weights only
                p = jnp.where(keep, p, 0.0)
            acc = alpha[:, None] * acc + _dot(p.astype(v.dtype), v)
            return m_new, l, acc, jnp.maximum(bad, jnp.max(jnp.broadcast_to(bad_v, p.shape), axis=1))

        return body

    # [bq] m, l, [bq, Hvp] acc, [bq] bad
    carry = (
        *_softmax_init(inp, bq, chunk == 0, lay.plain),
        jnp.zeros((bq, inp.v.shape[-1]), jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    if spec.flex is not None:  # no split-KV
        segments = flex_key_segments(lay, inp, nk)
    else:
        segments = tuple((lo, hi, masked, None) for lo, hi, masked in key_segments(lay, tm, q0, q0 + bq, nk))
    if chunks > 1:  # this program's contiguous share of the block's key blocks
        first, last = segments[0][0], segments[-1][1]
        c_lo = first + (last - first) * chunk // chunks
        c_hi = first + (last - first) * (chunk + 1) // chunks
        segments = tuple((jnp.clip(lo, c_lo, c_hi), jnp.clip(hi, c_lo, c_hi), m, b) for lo, hi, m, b in segments)
    m, l, acc, bad = _loop(segments, plain_step if lay.plain else step, carry)
    if lay.plain:  # the raw row max as a logit, rounded once; then the sink (-inf: none)
        m, l, acc = _join_sink(inp, m * spec.scale, l, acc, chunk == 0)
    # FlashAttention-2 §3.1.1: the accumulator stays unnormalised until the last block.
    # Empty rows (l = 0: no key, or only -inf logits) give 0; a NaN l is not empty.
    empty = l == 0
    l_safe = jnp.where(empty, 1.0, l)
    if spec.has_dropout:  # the kept weights' 1 / (1 - rate); lse is that of the full P
        acc = acc * _dropout.keep_scale(spec.dropout_rate)
    out = acc / l_safe[:, None]
    if not lay.plain:
        out = jnp.where(bad[:, None] > 0, jnp.nan, out)
    out_ref[...] = jnp.where(empty[:, None], 0.0, out).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))


# ---------------------------------------------------------------------------------------
# Backward (FlashAttention-2 Algorithm 2, split in two kernels so that nothing races):
# dK/dV with the key block resident, looping over query blocks of every head in the
# group; dQ with the query block resident, looping over key blocks. Both recompute
# P = exp2((x - lse)·log2 e) from lse; dead rows arrive with lse = +inf so P = 0.


def _probabilities(tm: TileMath, lay: Layout, q, k, lse, bias, vis, flex_at=None):
    """P (exactly 0 where masked and in empty rows, lse = +inf; NaN in poisoned rows),
    the natural transformed logits (or None), `live`: where dS may be nonzero (None in the
    plain kernels: there P is 0 wherever dS must be), and the score_mod's derivative (or
    None). flex_at: (q0, k0, batch, head) of a flex tile."""
    if lay.plain:  # finite scores: no poison; the min keeps a contracted FMA's exponent <= 0
        x = _dot(q, k, trans_b=True) * lay.spec.scale
        p = jnp.exp2(jnp.minimum(x - lse[:, None], 0.0) * LOG2E)
        return (p if vis is None else jnp.where(vis, p, 0.0)), None, None, None
    x, t = tm.logits(_dot(q, k, trans_b=True), bias)
    slope = None
    if flex_at is not None:
        x, slope = tm.flex_score_slope(x, vis, *flex_at)
    p = jnp.exp2(clamp_exponent(x - lse[:, None]) * LOG2E)
    live = (lse != jnp.inf)[:, None]
    if vis is not None:
        p = jnp.where(vis, p, 0.0)
        live = live & vis
    return p, t, live, slope


def _dscores(lay: Layout, p, dp, delta, t, live, slope=None):
    """dS = P ∘ (dP - D), times the soft cap's or the score_mod's derivative (`slope`):
    d loss / d (logit + bias), or d loss / d score_mod's score; exactly 0 outside `live`,
    also where dP (a bad v) or D (a poisoned row) is NaN. The plain kernels' P is 0 outside
    it and dP, D are finite: no select."""
    ds = p * (dp - delta[:, None])
    if live is None:
        return ds
    if lay.spec.soft_cap is not None:
        ds = ds * _masking.soft_cap_grad(lay.spec, t)
    if slope is not None:
        ds = ds * slope
    return jnp.where(live, ds, 0.0)


def _operand(lay: Layout, x):
    """A streamed q or k as the operand of dS·K or dSᵀ·Q: its finite copy (a masked pair's
    dS = 0 must not meet a NaN), or itself in the plain kernels (all finite)."""
    return x if lay.plain else finite_part(x)


def _drop(lay: Layout, keep, x):
    """keep ∘ x / (1 - rate) (dropout's Z from P, and the cotangent of P from dZ)."""
    if keep is None:
        return x
    return jnp.where(keep, x * _dropout.keep_scale(lay.spec.dropout_rate), 0.0)


def dkdv_kernel(*refs, layout: Layout):
    _gated(_dkdv_kernel, layout, refs, ("q", "k", "v", "do", "lse", "delta"))


def _dkdv_kernel(inp: Inputs, layout: Layout):
    dk_ref, dv_ref = inp.outputs
    lay = layout
    bq, bk = lay.block_q, lay.block_k
    nq = lay.t_pad // bq
    j = inp.program_id(0)
    k0 = j * bk
    # Query heads of this kv head: first_head + g (dropout counts the query head).
    batch, first_head = inp.program_id(2), (inp.program_id(1) // lay.splits) * lay.spec.group_size
    tm = TileMath(lay, inp)
    k = inp.k[...]  # [bk, Hp]
    v = inp.v[...]  # [bk, Hvp]
    kv_seg = None if inp.kv_seg is None else inp.kv_seg[...]
    ragged_block = (j + 1) * bk > lay.spec.kv_len
    flex = lay.spec.flex

    def step(g, masked, block=None):
        def body(ii, carry):
            dk, dv = carry  # [bk, Hp], [bk, Hvp] f32
            q0 = (ii if block is None else block(ii)) * bq
            q = inp.q[pl.ds(q0, bq), g, :]
            do = inp.do[pl.ds(q0, bq), g, :]
            lse = inp.lse[g, pl.ds(q0, bq)]
            delta = inp.delta[g, pl.ds(q0, bq)]
            gb = g if inp.bias is not None and inp.bias.shape[0] != 1 else 0
            bias = None
            if lay.has_bias:
                bias = dense_tile(inp.bias, bool(lay.bias_rows), bool(lay.bias_cols), (gb,), q0, bq, 0, bk)
            vis = flex_at = None
            if flex is not None:
                flex_at = (q0, k0, batch, first_head + g)
                vis = tm.flex_visible(masked, q0, k0, bq, bk, batch, first_head + g)
            elif masked:
                q_seg = None if inp.q_seg is None else inp.q_seg[pl.ds(q0, bq)]
                mask = None
                if lay.has_mask:
                    gm = g if inp.mask.shape[0] != 1 else 0
                    mask = dense_tile(inp.mask, bool(lay.mask_rows), bool(lay.mask_cols), (gm,), q0, bq, 0, bk)
                vis = tm.visible(q0, k0, q_seg, kv_seg, mask, bq, bk)
            p, t, live, slope = _probabilities(tm, lay, q, k, lse, bias, vis, flex_at)
            keep = tm.dropout_keep(batch, first_head + g, q0, k0, bq, bk)
            dv = dv + _dot(_drop(lay, keep, p).astype(do.dtype), do, trans_a=True)
            ds = _dscores(lay, p, _drop(lay, keep, _dot(do, v, trans_b=True)), delta, t, live, slope)
            dk = dk + _dot(ds.astype(q.dtype), _operand(lay, q), trans_a=True)
            return dk, dv

        return body

    # This program's share of the kv head's group: heads g0 .. g0 + group - 1.
    g0 = (inp.program_id(1) % lay.splits) * lay.group if lay.splits > 1 else 0

    def head(gi, carry):
        g = g0 + gi
        if flex is not None:
            segments = flex_query_segments(lay, inp, nq, first_head + g)
        else:
            band = query_segments(lay, tm, k0, k0 + bk, nq, ragged_block)
            segments = tuple((lo, hi, masked, None) for lo, hi, masked in band)
        return _loop(segments, lambda masked, block: step(g, masked, block), carry)

    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    if lay.group == 1:
        dk, dv = head(0, zeros)
    else:
        dk, dv = lax.fori_loop(0, lay.group, head, zeros)
    dk_ref[...] = (dk * lay.spec.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def dq_kernel(*refs, layout: Layout):
    _gated(_dq_kernel, layout, refs, ("q", "k", "v", "do", "lse", "delta"))


def _dq_kernel(inp: Inputs, layout: Layout):
    dq_ref = inp.outputs[0]
    ds_ref = inp.outputs[1] if layout.write_ds else None
    lay = layout
    bq, bk = lay.block_q, lay.block_k
    nk = lay.s_pad // bk
    q0 = inp.program_id(0) * bq
    batch, head = inp.program_id(2), inp.program_id(1)
    tm = TileMath(lay, inp)
    q = inp.q[...]
    do = inp.do[...]
    lse = inp.lse[...]
    delta = inp.delta[...]
    q_seg = None if inp.q_seg is None else inp.q_seg[...]

    def step(masked, block=None):
        def body(jj, dq):
            k0 = (jj if block is None else block(jj)) * bk
            k = inp.k[pl.ds(k0, bk), :]
            v = inp.v[pl.ds(k0, bk), :]
            bias = None
            if lay.has_bias:
                bias = dense_tile(inp.bias, bool(lay.bias_rows), bool(lay.bias_cols), (), 0, bq, k0, bk)
            vis = flex_at = None
            if lay.spec.flex is not None:
                flex_at = (q0, k0, batch, head)
                vis = tm.flex_visible(masked, q0, k0, bq, bk, batch, head)
            elif masked:
                kv_seg = None if inp.kv_seg is None else inp.kv_seg[pl.ds(k0, bk)]
                mask = None
                if lay.has_mask:
                    mask = dense_tile(inp.mask, bool(lay.mask_rows), bool(lay.mask_cols), (), 0, bq, k0, bk)
                vis = tm.visible(q0, k0, q_seg, kv_seg, mask, bq, bk)
            p, t, live, slope = _probabilities(tm, lay, q, k, lse, bias, vis, flex_at)
            keep = tm.dropout_keep(batch, head, q0, k0, bq, bk)
            ds = _dscores(lay, p, _drop(lay, keep, _dot(do, v, trans_b=True)), delta, t, live, slope)
            if ds_ref is not None:
                ds_ref[:, pl.ds(k0, bk)] = ds
            return dq + _dot(ds.astype(k.dtype), _operand(lay, k))

        return body

    if lay.spec.flex is not None:
        segments = flex_key_segments(lay, inp, nk)
    else:
        segments = tuple((lo, hi, masked, None) for lo, hi, masked in key_segments(lay, tm, q0, q0 + bq, nk))
    if ds_ref is not None:
        # Key blocks the band skips still own their (zero) slice of dS.
        def zero(j, carry):
            ds_ref[:, pl.ds(j * bk, bk)] = jnp.zeros((bq, bk), jnp.float32)
            return carry

        lax.fori_loop(0, segments[0][0], zero, None)
        lax.fori_loop(segments[-1][1], nk, zero, None)
    dq = _loop(segments, step, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * lay.spec.scale).astype(dq_ref.dtype)
