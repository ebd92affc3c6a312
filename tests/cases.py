"""Test cases shared by the suite: shapes, mask kinds, dtypes, inputs and tolerances."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Shape:
    b: int
    t: int
    s: int
    n: int
    kh: int
    h: int
    hv: int | None = None  # the value head dim Hv (None: Hv = H)

    @property
    def v_h(self) -> int:
        return self.h if self.hv is None else self.hv

    def __str__(self):
        extra = "" if self.hv is None else f"Hv{self.hv}"
        return f"B{self.b}T{self.t}S{self.s}N{self.n}K{self.kh}H{self.h}{extra}"


# Ragged lengths, T != S both ways, GQA and MQA, a head dim that is not a power of two.
FULL_SHAPES = {
    "ragged": Shape(2, 97, 1025, 4, 2, 64),
    "square": Shape(1, 256, 256, 4, 4, 128),
    "odd_h": Shape(2, 130, 77, 6, 2, 40),
    "one_query": Shape(1, 1, 33, 2, 1, 64),
    # Value head dim Hv != H: MLA's (192, 128) with GQA and ragged T, S; a half-width value
    # (128, 64) with MQA; a value wider than the keys (32, 80, not a multiple of 16).
    "mla": Shape(2, 97, 130, 4, 2, 192, hv=128),
    "hv_half": Shape(1, 70, 150, 4, 1, 128, hv=64),
    "hv_wide": Shape(2, 40, 61, 2, 1, 32, hv=80),
}
# Interpreted / emulated implementations run these.
SMALL_SHAPES = {
    # Still several tiles of every kernel: the CUDA forward has 128-row query blocks and a
    # 3-stage ring of 64-key tiles (S = 300 wraps it), the backward 64-key blocks.
    "small_mqa": Shape(1, 33, 300, 2, 1, 64),
    "small_gqa": Shape(1, 150, 150, 4, 2, 128),
    "small_tall": Shape(1, 140, 17, 2, 2, 64),
    "small_h32": Shape(1, 100, 260, 2, 1, 32),
    "small_h96": Shape(2, 37, 200, 2, 2, 96),
    # The large head dims, tiny (the emulation runs them slowly), still several tiles of each
    # cuda kernel: H=192 has 32-key forward tiles and 32 x 32 backward blocks, H=256 16-key
    # forward and dQ tiles and 16-row backward query blocks.
    "small_h192": Shape(1, 37, 40, 1, 1, 192),
    "small_h256": Shape(1, 40, 35, 1, 1, 256),
    # T and S = +1 and -1 modulo every tile size of the CUDA kernels (16 rows or keys per
    # warp, 32- and 64-row backward query blocks, 64-key tiles, 128-row forward query blocks):
    # a tile bound, tail guard or interior test that is off by one shows up in one of them.
    "tile_plus": Shape(2, 129, 127, 2, 1, 64),  # T = +1, S = -1 (mod 16, 32, 64, 128)
    "tile_minus": Shape(2, 127, 129, 2, 2, 128),  # T = -1, S = +1; H=128: 32-row backward blocks
    # Hv != H: MLA-like (192, 128) and (64, 32) with GQA, ragged.
    "small_mla": Shape(1, 33, 70, 2, 1, 192, hv=128),
    "small_hv": Shape(1, 40, 50, 4, 2, 64, hv=32),
    # The cuda kernels' other Hv != H cases (HV_CUDA_CASES in test_attention.py): (192, 128) with
    # T = 31, S = 65 (-1 and +1 modulo their 16-row and 32-key blocks), (128, 64) tiny.
    "small_mla_edge": Shape(1, 31, 65, 2, 1, 192, hv=128),
    "small_hv_half": Shape(1, 17, 33, 2, 1, 128, hv=64),
    # Attention sinks (SINK_CASES): tiny, ragged, GQA; H = 32 so that cuda serves them too.
    "sinks_gqa": Shape(2, 40, 70, 4, 2, 32),
    "sinks_tall": Shape(1, 50, 20, 2, 1, 32),  # T > S: with a window, the last rows see no key
}

MASK_KINDS = (
    "none",
    "causal",
    "window",
    "window_causal",
    "lengths",
    "segments",
    "softcap",
    "bias",
    "mask",
    "combo",
    "all_masked",
)
# query_offset: query t sits at key position offset + t for the causal/window band.
OFFSET_KINDS = ("offset_causal", "offset_window", "offset_rows", "offset_combo", "offset_decode")


@dataclasses.dataclass(frozen=True)
class Case:
    shape_name: str
    mask_kind: str
    dtype: str
    small: bool
    sinks: bool = False  # pass sinks (`make_sinks`) too

    @property
    def shape(self) -> Shape:
        return (SMALL_SHAPES if self.small else FULL_SHAPES)[self.shape_name]

    def __str__(self):
        return f"{self.shape_name}-{self.mask_kind}-{self.dtype}" + ("-sinks" if self.sinks else "")


def _cases():
    out = []
    for name in FULL_SHAPES:
        if FULL_SHAPES[name].hv is not None:
            continue  # the Hv != H cases are chosen below
        for kind in ("none", "causal"):
            out.append(Case(name, kind, "float32", False))
    for kind in MASK_KINDS:
        if kind not in ("none", "causal"):
            out.append(Case("ragged", kind, "float32", False))
    for dt in ("bfloat16", "float16"):
        for kind in ("none", "causal", "combo"):
            out.append(Case("ragged", kind, dt, False))
    for kind in ("window", "lengths", "segments", "bias"):
        out.append(Case("odd_h", kind, "float32", False))
    for kind in MASK_KINDS:
        out.append(Case("small_mqa", kind, "bfloat16", True))
    for dt in ("bfloat16", "float16"):
        for kind in ("none", "causal", "combo", "window"):
            out.append(Case("small_gqa", kind, dt, True))
    for dt in ("float16", "float32"):
        for kind in ("none", "window_causal", "lengths"):
            out.append(Case("small_tall", kind, dt, True))
    for name, dt in (("small_h32", "float16"), ("small_h96", "bfloat16")):
        for kind in ("none", "causal", "combo"):
            out.append(Case(name, kind, dt, True))
    for name, dt in (("small_h192", "bfloat16"), ("small_h256", "float16")):
        out.append(Case(name, "combo", dt, True))
    for name, dt in (("tile_plus", "float16"), ("tile_minus", "bfloat16")):
        for kind in TILE_EDGE_KINDS:
            out.append(Case(name, kind, dt, True))
    # Scales that are not positive (zero, -0.0, negative), with masked elements.
    for kind in SCALE_KINDS:
        out.append(Case("ragged", kind, "float32", False))
        out.append(Case("small_mqa", kind, "bfloat16", True))
    # query_offset: bottom-right causal for T < S, T > S and a decode step (T = 1), windows
    # moved by per-row offsets, negative / beyond-S offsets, with lengths and segments.
    for kind in OFFSET_KINDS:
        out.append(Case("ragged", kind, "float32", False))
        out.append(Case("small_mqa" if kind != "offset_decode" else "small_h96", kind, "bfloat16", True))
    out.append(Case("odd_h", "offset_causal", "float32", False))
    out.append(Case("one_query", "offset_causal", "float32", False))
    out.append(Case("small_tall", "offset_causal", "float16", True))
    out.append(Case("small_h96", "offset_rows", "bfloat16", True))
    # Value head dim Hv != H: forward out/lse and gradients, GQA/MQA, masks, dtypes.
    out.append(Case("mla", "combo", "float32", False))
    out.append(Case("mla", "causal", "bfloat16", False))
    out.append(Case("hv_half", "offset_decode", "float16", False))
    out.append(Case("hv_wide", "lengths", "float32", False))
    out.append(Case("small_mla", "causal", "bfloat16", True))
    out.append(Case("small_hv", "combo", "float16", True))
    out.append(Case("small_hv", "bias", "float32", True))
    return out


# Mask kinds of the tile-edge shapes: every edge of the visible region (sequence ends, the
# diagonal, window edges, lengths) lands at +1 / -1 of a tile boundary somewhere.
TILE_EDGE_KINDS = (
    "none",
    "causal",
    "tile_window",
    "tile_window_wide",
    "tile_lengths",
    "tile_causal_lengths",
    "segments",
)
SCALE_KINDS = ("zero_scale", "neg_zero_scale", "negative_scale")


CASES = _cases()

# Attention sinks in every implementation: GQA with causal, soft cap, lengths and segment ids
# (rows that see no key), a window past the end of a short key sequence, and a decode step
# over caches of which one is empty (float32: not cuda). {case: the implementations that run it}
# (two or three cases each, within the CI budget).
SINK_CASES = {
    Case("sinks_gqa", "combo", "bfloat16", True, sinks=True): ("xla", "cpu", "pallas", "cuda"),
    Case("sinks_tall", "window", "float16", True, sinks=True): ("cpu", "cuda"),
    Case("sinks_gqa", "offset_decode", "float32", True, sinks=True): ("xla", "cpu", "pallas"),
}


def make_sinks(shape: Shape, seed: int = 3):
    """[N] float32 sinks around log(S), so that the sink takes a large share of each row."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.log(max(shape.s, 1)) + rng.normal(size=shape.n), jnp.float32)


def make_qkv(shape: Shape, dtype, seed: int = 0):
    """Random, off-zero q, k, v (normal with a shifted mean)."""
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (shape.b, shape.t, shape.n, shape.h), jnp.float32) + 0.1
    k = jax.random.normal(kk, (shape.b, shape.s, shape.kh, shape.h), jnp.float32) - 0.1
    v = jax.random.normal(kv, (shape.b, shape.s, shape.kh, shape.v_h), jnp.float32) + 0.2
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def _segments(rng, b, length, num):
    """Sorted (packed-document) segment ids in [0, num)."""
    ids = np.sort(rng.integers(0, num, size=(b, length)), axis=1)
    return jnp.asarray(ids, jnp.int32)


def mask_kwargs(kind: str, shape: Shape, seed: int = 1) -> dict:
    """Keyword arguments of jax_flash.attention for one mask kind."""
    rng = np.random.default_rng(seed)
    b, t, s, n = shape.b, shape.t, shape.s, shape.n
    if kind == "none":
        return {}
    if kind == "causal":
        return dict(is_causal=True)
    if kind == "window":
        return dict(local_window_size=(7, 3))
    if kind == "window_causal":
        return dict(local_window_size=(9, 4), is_causal=True)
    if kind == "lengths":
        q_len = [max(1, t - 10)] + [t] * (b - 1)
        kv_len = [s] * (b - 1) + [max(1, s // 3)]
        return dict(
            query_seq_lengths=jnp.asarray(q_len, jnp.int32),
            key_value_seq_lengths=jnp.asarray(kv_len, jnp.int32),
        )
    if kind == "segments":
        # Query ids range over 0..4 and key ids over 0..3: queries of segment 4 see nothing.
        return dict(segment_ids=(_segments(rng, b, t, 5), _segments(rng, b, s, 4)))
    if kind == "softcap":
        return dict(logits_soft_cap=2.5, scale=0.5)
    if kind == "bias":
        bias = jnp.asarray(rng.normal(size=(b, 1, t, s)), jnp.float32)
        return dict(bias=bias)
    if kind == "mask":
        m = rng.random(size=(1, n, t, s)) < 0.7
        m[0, 0, 0, :] = False  # one row of one head sees nothing
        return dict(mask=jnp.asarray(m))
    if kind == "combo":
        kw = dict(
            is_causal=True,
            logits_soft_cap=4.0,
            key_value_seq_lengths=jnp.asarray([s] * (b - 1) + [max(1, (2 * s) // 3)], jnp.int32),
        )
        if t == s:
            kw["segment_ids"] = _segments(rng, b, t, 3)
        else:
            kw["segment_ids"] = (_segments(rng, b, t, 3), _segments(rng, b, s, 3))
        return kw
    if kind == "tile_lengths":
        # Lengths at +1 / -1 of the tile boundaries (clipped to the shape): batch row 0 has
        # T = 65 valid queries and S = 63 valid keys, row 1 the other way round.
        q_len = [min(t, 65), min(t, 63)] + [t] * (b - 2)
        kv_len = [min(s, 63), min(s, 65)] + [s] * (b - 2)
        return dict(
            query_seq_lengths=jnp.asarray(q_len[:b], jnp.int32),
            key_value_seq_lengths=jnp.asarray(kv_len[:b], jnp.int32),
        )
    if kind == "tile_causal_lengths":
        # Causal with 65 valid queries and every key valid: the diagonal of the last valid row
        # (64) crosses into the second key tile by one key.
        q_len = [min(t, 65), min(t, 63)] + [t] * (b - 2)
        return dict(is_causal=True, query_seq_lengths=jnp.asarray(q_len[:b], jnp.int32))
    if kind == "tile_window":
        # Window edges 1 past / before a tile boundary: left 78 = 14 (mod 16) puts the last
        # row's first key at +1 of a tile's first key where the tile's other edge is inside
        # every row's window; right 14 does the same at the far edge.
        return dict(local_window_size=(78, 14))
    if kind == "tile_window_wide":
        # Left 65 = 1 (mod 64): the first row of a query block is the last to see a key block.
        return dict(local_window_size=(65, 0))
    if kind == "zero_scale":
        return dict(scale=0.0, is_causal=True)
    if kind == "neg_zero_scale":
        return dict(scale=-0.0, local_window_size=(5, 2))
    if kind == "negative_scale":
        kv_len = [s] * (b - 1) + [max(1, s // 2)]
        return dict(scale=-0.3, is_causal=True, key_value_seq_lengths=jnp.asarray(kv_len, jnp.int32))
    if kind == "offset_causal":  # bottom-right aligned (FlashAttention's causal)
        return dict(is_causal=True, query_offset=s - t)
    if kind == "offset_window":  # one offset per batch row, as an array
        return dict(
            local_window_size=(7, 3),
            query_offset=jnp.asarray([s - t, (s - t) // 2 + 5][:b], jnp.int32),
        )
    if kind == "offset_rows":
        # Negative (the first t//2 rows see nothing) and beyond S (every key visible).
        offsets = [-(t // 2), s + 3, s - t][:b]
        return dict(is_causal=True, query_offset=jnp.asarray(offsets, jnp.int32))
    if kind == "offset_combo":
        # Lengths and segment ids index the arrays as given: the offset does not shift them.
        q_len = [max(1, t - 5)] + [t] * (b - 1)
        kv_len = [s] * (b - 1) + [max(1, (3 * s) // 4)]
        return dict(
            is_causal=True,
            local_window_size=(s // 3, 5),
            query_offset=jnp.asarray([s - t, 3, -2][:b], jnp.int32),
            query_seq_lengths=jnp.asarray(q_len, jnp.int32),
            key_value_seq_lengths=jnp.asarray(kv_len, jnp.int32),
            segment_ids=(_segments(rng, b, t, 3), _segments(rng, b, s, 3)),
        )
    if kind == "offset_decode":
        # A decode step over caches filled to L[b] (one of them empty): the queries are the
        # last T positions, query_offset = L - T, bottom-right causal per row.
        lengths = jnp.asarray([max(1, s - 7), 0, s][:b], jnp.int32)
        return dict(is_causal=True, key_value_seq_lengths=lengths, query_offset=lengths - t)
    if kind == "all_masked":
        # The first batch element sees no key at all; the second has padded query rows.
        return dict(
            key_value_seq_lengths=jnp.asarray([0] + [s] * (b - 1), jnp.int32),
            query_seq_lengths=jnp.asarray([t] + [max(1, t // 2)] * (b - 1), jnp.int32),
        )
    raise ValueError(kind)


# err(impl) <= FACTOR * err(reference at the input dtype) + EPS[dtype], both against float64.
FACTOR = 2.0
EPS = {"float32": 1e-5, "float16": 2e-4, "bfloat16": 2e-3, "float64": 1e-10}
GRAD_EPS = {"float32": 5e-5, "float16": 1e-3, "bfloat16": 1e-2, "float64": 1e-9}


def max_err(x, ref) -> float:
    x = np.asarray(jnp.asarray(x, jnp.float64))
    ref = np.asarray(jnp.asarray(ref, jnp.float64))
    assert x.shape == ref.shape, (x.shape, ref.shape)
    assert not np.isnan(x).any(), "NaN in result"
    finite = np.isfinite(ref)
    assert np.array_equal(np.isfinite(x), finite), "the -inf pattern differs from the reference"
    if not finite.any():
        return 0.0
    return float(np.max(np.abs(x[finite] - ref[finite])))


def emulator_or_skip():
    """Skips the calling test where the host emulation of the cuda kernels is not built
    (JAX_FLASH_EMULATOR=ON): the tests that call its targets or count its tiles."""
    try:
        from jax_flash import _jax_flash_emu  # noqa: F401
    except ImportError:
        import pytest  # here, not at the top: tests/internals/test_gpu.py imports this module without pytest

        pytest.skip("the host emulation of the cuda kernels is not built (JAX_FLASH_EMULATOR=ON)")


def _cuda_mask_operands(b, t, s, q_lengths, kv_lengths, q_offset):
    """The CUDA targets' mask operands (cuda/README.md), each at its "none" value unless given:
    lengths, segment ids (zeros), query offsets, no dense bias or mask, no block mask."""
    return (
        jnp.full((b,), t, jnp.int32) if q_lengths is None else jnp.asarray(q_lengths, jnp.int32),
        jnp.full((b,), s, jnp.int32) if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32),
        jnp.zeros((b, t), jnp.int32),
        jnp.zeros((b, s), jnp.int32),
        jnp.zeros((b,), jnp.int32) if q_offset is None else jnp.asarray(q_offset, jnp.int32),
        jnp.zeros((0,), jnp.float32),  # bias, mask: none
        jnp.zeros((0,), jnp.bool_),
        jnp.zeros((0,), jnp.int8),  # block_states, block_slots, block_bits: no block mask
        jnp.zeros((0,), jnp.int32),
        jnp.zeros((0,), jnp.uint32),
    )


def _cuda_attributes(scale, window, layout, plain_kernel) -> dict:
    """The shared attributes of a direct CUDA target call (no soft cap, segment ids, dropout or
    block mask; results poisoned before the kernels run) and the CUDA targets' own two."""
    return dict(
        scale=np.float32(scale),
        window_left=np.int64(window[0]),
        window_right=np.int64(window[1]),
        softcap=np.float32(0),
        use_segment_ids=False,
        dropout_rate=np.float32(0),
        poison_outputs=True,
        block_q=np.int64(0),
        block_k=np.int64(0),
        layout=layout,
        plain_kernel=plain_kernel,
    )


def _route_operand(route):
    """A routed call's route operand (kernels/params.h, Route), [0] s32 for None (not routed)."""
    return jnp.zeros((0,), jnp.int32) if route is None else jnp.asarray([route], jnp.int32)


def cuda_forward_target(
    target,
    q,
    k,
    v,
    *,
    layout="warp16",
    plain_kernel=False,
    decode_tile=False,
    route=None,
    q_lengths=None,
    kv_lengths=None,
    q_offset=None,
    window=(-1, -1),
    sinks=None,
    scale=0.125,
):
    """A direct call of a CUDA forward FFI target (`jax_flash_fwd` or the emulated
    `jax_flash_emu_fwd`; cuda/README.md): every mask operand at its "none" value unless given,
    no split-KV, results poisoned before the kernels run; `route` (kernels/params.h, Route):
    a routed call's route, None for none. Returns (out, lse)."""
    b, t, n, _ = q.shape
    s = k.shape[1]
    operands = (
        q,
        k,
        v,
        *_cuda_mask_operands(b, t, s, q_lengths, kv_lengths, q_offset),
        jnp.full((n,), -jnp.inf, jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32),
        jnp.zeros((2,), jnp.uint32),
        _route_operand(route),
    )
    shapes = (
        jax.ShapeDtypeStruct((b, t, n, v.shape[-1]), q.dtype),
        jax.ShapeDtypeStruct((b, n, t), jnp.float32),
        jax.ShapeDtypeStruct((0,), jnp.float32),  # partial_out, partial_lse: no split-KV
        jax.ShapeDtypeStruct((0,), jnp.float32),
    )
    attributes = dict(_cuda_attributes(scale, window, layout, plain_kernel), pack_gqa=False, decode_tile=decode_tile)
    out, lse, *_ = jax.ffi.ffi_call(target, shapes)(*operands, **attributes)
    return out, lse


def cuda_backward_target(
    target,
    q,
    k,
    v,
    out,
    lse,
    dout,
    *,
    dlse=None,
    layout="warp16",
    plain_kernel=False,
    route=None,
    q_heads_grid=False,
    q_lengths=None,
    kv_lengths=None,
    q_offset=None,
    window=(-1, -1),
    scale=0.125,
):
    """A direct call of a CUDA backward FFI target (`jax_flash_bwd` or the emulated
    `jax_flash_emu_bwd`; cuda/README.md) on the forward's out and lse: every mask operand at its
    "none" value unless given, dlse 0 unless given, results poisoned before the kernels run;
    `route` as the forward's; `q_heads_grid`: the main kernel's grid (the dk_accum / dv_accum
    workspaces). Returns (dq, dk, dv)."""
    b, t, n, h = q.shape
    s, hv = k.shape[1], v.shape[-1]
    operands = (
        q,
        k,
        v,
        out,
        dout,
        lse,
        jnp.zeros((b, n, t), jnp.float32) if dlse is None else jnp.asarray(dlse, jnp.float32),
        *_cuda_mask_operands(b, t, s, q_lengths, kv_lengths, q_offset),
        jnp.zeros((2,), jnp.uint32),  # the dropout seed (no dropout)
        _route_operand(route),
    )
    shapes = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        jax.ShapeDtypeStruct((b, t, n, h), jnp.float32),  # dq_accum
        jax.ShapeDtypeStruct((b, n, t), jnp.float32),  # delta
        jax.ShapeDtypeStruct((b, s, n, h) if q_heads_grid else (0,), jnp.float32),  # dk_accum
        jax.ShapeDtypeStruct((b, s, n, hv) if q_heads_grid else (0,), jnp.float32),  # dv_accum
        jax.ShapeDtypeStruct((0,), jnp.float32),  # dbias_accum, dbias: no bias
        jax.ShapeDtypeStruct((0,), jnp.float32),
    )
    attributes = dict(_cuda_attributes(scale, window, layout, plain_kernel), deterministic=False)
    dq, dk, dv, *_ = jax.ffi.ffi_call(target, shapes)(*operands, **attributes)
    return dq, dk, dv
