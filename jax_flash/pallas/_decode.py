"""A Pallas decode kernel (Triton backend) for `paged_attention(implementation="pallas")`.

Grid (chunk c, kv head k, sequence b). One program holds the T queries of all G query heads
that share kv head k packed into the rows of one tile (GQA packing: row r = g·T + t, padded
to a power of two >= 16), so each K/V page is read once per kv head, not once per query
head. It walks its chunk's pages through the page table (one page per key block, loaded
from that page's own address: the cache is never gathered), with the xla path's online
softmax step (`_numerics.online_softmax_step`) and the one mask (`_masking.visible`), and writes
a partial (out, lse). The C chunks are merged by lse outside (`_merge.merge_partials`),
exact and in a fixed order; C = 1 is no split.

Limits (`unsupported`): page_size and head dim powers of two >= 16 (Triton tiles; padding the
head dim would copy the cache), dtypes float16/bfloat16/float32. On a CPU it runs with
interpret=True (slow: for tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_flash import _masking, _registry
from jax_flash._merge import merge_partials
from jax_flash._numerics import (
    finite_part,
    nonfinite_rows,
    online_softmax_finish,
    online_softmax_init,
    online_softmax_step,
    pad_axis,
    poison_infinite,
)
from jax_flash.pallas._table import Config
from jax_flash.pallas._triton_kernels import compiler_params, triton_missing

DTYPES = ("float16", "bfloat16", "float32")


def _pow2(x: int) -> bool:
    return x >= 16 and x & (x - 1) == 0


def unsupported(pspec) -> str | None:
    """None, or why the pallas decode kernel cannot serve this paged call."""
    missing = triton_missing()
    if missing:
        return missing
    spec = pspec.attention
    if _registry.platform() not in ("gpu", "cpu"):
        return f"runs on GPUs through Triton (and interpreted on the CPU), not on {_registry.platform()}"
    if spec.dtype not in DTYPES:
        return f"supports dtypes {DTYPES}, got {spec.dtype}"
    if not _pow2(pspec.page_size):
        return f"needs page_size a power of two >= 16 (Triton tiles), got {pspec.page_size}"
    if not _pow2(spec.head_dim) or spec.head_dim > 256:
        return f"needs a head dim that is a power of two in [16, 256], got {spec.head_dim}"
    return None


def note() -> str | None:
    if _registry.platform() == "cpu":
        return "interpreted (slow): the Triton decode kernel runs with interpret=True on the CPU"
    return None


def _kernel(
    q_ref,
    kp_ref,
    vp_ref,
    table_ref,
    len_ref,
    sink_ref,
    out_ref,
    lse_ref,
    *,
    spec,
    pages_per_chunk,
    num_pages,
    page_size,
    rows,
):
    """One (chunk, kv head, sequence): q_ref [R, H], kp_ref/vp_ref [P, page_size, H],
    table_ref [C·pc] (this sequence's pages), len_ref [1], sink_ref [R] (each row's head's
    sink logit; read when spec.has_sinks); out_ref [R, H] f32, lse_ref [R]."""
    from jax.experimental import pallas as pl

    c = pl.program_id(0)
    t = spec.q_len
    cap = spec.kv_len
    length = jnp.maximum(len_ref[0], 0)
    key_len = jnp.minimum(length, cap)  # keys beyond the table do not exist
    offset = length - t  # query t sits at position length - T + t
    band = spec.band(offset)
    q = q_ref[...]
    r = q.shape[0]
    query_t = lax.broadcasted_iota(jnp.int32, (r, 1), 0) % t  # row g·T + t holds query t
    # Pages this program visits: its chunk, cut to the band and to the length.
    lo, hi = spec.key_block_range(0, t, page_size, -(-cap // page_size), offset)
    lo = jnp.maximum(jnp.asarray(lo, jnp.int32), c * pages_per_chunk)
    hi = jnp.minimum(jnp.asarray(hi, jnp.int32), (c + 1) * pages_per_chunk)
    hi = jnp.minimum(hi, (key_len + page_size - 1) // page_size)

    def page(j, carry):
        pid = table_ref[j]
        valid = (pid >= 0) & (pid < num_pages)
        pid = jnp.where(valid, pid, 0)  # an invalid id reads page 0, masked below
        k = kp_ref[pid]  # [page_size, H], read at the page's own address
        v = vp_ref[pid]
        bad_v = nonfinite_rows(v[None])  # [1, page_size]: keys whose v row is non-finite
        scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        logits = _masking.transform_logits(spec, poison_infinite(scores) * spec.scale)
        cols = j * page_size + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
        vis = _masking.visible(spec, query_t, cols, kv_lengths=key_len, band=band) & valid
        pv = lambda p, v: lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        return online_softmax_step(carry, logits, vis, finite_part(v), bad_v, pv=pv)

    # The sink joins the softmax of the first chunk only (the merge adds the chunks up).
    sink = jnp.where(c == 0, sink_ref[...], -jnp.inf) if spec.has_sinks else None
    init = online_softmax_init((r,), q.shape[1], jnp.float32, q, sink=sink)
    carry = lax.fori_loop(lo, jnp.maximum(lo, hi), page, init)
    out, lse = online_softmax_finish(carry)
    out_ref[...] = out
    lse_ref[...] = lse


def paged_forward(pspec, q, key_pages, value_pages, table, lengths, splits=None, interpret=None, sinks=None):
    """out [B, T, N, H] (dtype of q), lse [B, N, T] for a PagedSpec whose `unsupported` is None;
    sinks: float32 [N] when pspec.attention.has_sinks."""
    from jax.experimental import pallas as pl

    spec = pspec.attention
    b, t, n, h = q.shape
    kh, g = spec.num_kv_heads, spec.group_size
    ps = pspec.page_size
    c = pspec.splits if splits is None else max(1, min(splits, pspec.max_pages))
    pc = -(-pspec.max_pages // c)
    rows = max(16, 1 << (g * t - 1).bit_length())
    interpret = _registry.platform() == "cpu" if interpret is None else interpret
    # [B, T, K·G, H] -> [B, K, G·T, H]: the query heads of one kv head packed into rows.
    qr = q.reshape(b, t, kh, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, h)
    qr = pad_axis(qr, 2, rows)
    table = pad_axis(table, 1, c * pc, -1)
    lengths = lengths.astype(jnp.int32)[:, None]
    # Row g·T + t of kv head k holds head k·G + g: its sink, -inf in the padding rows.
    if sinks is None:
        sinks = jnp.full((n,), -jnp.inf, jnp.float32)
    row_sinks = jnp.repeat(sinks.astype(jnp.float32).reshape(kh, g), t, axis=1)
    row_sinks = pad_axis(row_sinks, 1, rows, -jnp.inf)
    kernel = functools.partial(
        _kernel, spec=spec, pages_per_chunk=pc, num_pages=pspec.num_pages, page_size=ps, rows=rows
    )
    pages_spec = pl.BlockSpec((pspec.num_pages, ps, None, h), lambda c_, k_, b_: (0, 0, k_, 0))
    out, lse = pl.pallas_call(
        kernel,
        grid=(c, kh, b),
        in_specs=[
            pl.BlockSpec((None, None, rows, h), lambda c_, k_, b_: (b_, k_, 0, 0)),
            pages_spec,
            pages_spec,
            pl.BlockSpec((None, c * pc), lambda c_, k_, b_: (b_, 0)),
            pl.BlockSpec((None, 1), lambda c_, k_, b_: (b_, 0)),
            pl.BlockSpec((None, rows), lambda c_, k_, b_: (k_, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, h), lambda c_, k_, b_: (c_, b_, k_, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda c_, k_, b_: (c_, b_, k_, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((c, b, kh, rows, h), jnp.float32),
            jax.ShapeDtypeStruct((c, b, kh, rows), jnp.float32),
        ],
        compiler_params=compiler_params(Config(rows, ps, 4, 2)),
        interpret=interpret,
        name="jax_flash_paged_decode",
    )(qr, key_pages, value_pages, table, lengths, row_sinks)
    # [C, B, K, G·T, H] -> C partials [B, T, N, H];  [C, B, K, G·T] -> [B, N, T]
    out = out[:, :, :, : g * t].reshape(c, b, kh, g, t, h).transpose(0, 1, 4, 2, 3, 5).reshape(c, b, t, n, h)
    lse = lse[:, :, :, : g * t].reshape(c, b, n, t)
    if c > 1:
        out, lse = merge_partials([out[i] for i in range(c)], [lse[i] for i in range(c)])
    else:
        out, lse = out[0], lse[0]
    return out.astype(q.dtype), lse
