"""Attention over a paged KV cache, and appending to it.

A paged cache stores K and V in fixed-size pages `[num_pages, page_size, K, H]` shared by
all sequences; `page_table[b]` lists the pages of sequence b in order, so position p of
sequence b is slot p % page_size of page page_table[b, p // page_size]. Sequences grow by
pages without moving anything, and a server allocates pages instead of max-length buffers.

`paged_attention` is attention of the last T positions of each sequence (a decode step:
T = 1; speculative / chunked prefill: T > 1) against that sequence's first kv_lengths[b]
positions. The xla implementation runs the blockwise forward (`xla.paged_forward`: the
same online softmax and masks as `jax_flash.attention`) with its key blocks read through the
page table: block j is the pages page_table[:, j·pp : (j+1)·pp], gathered page by page
into one [B, pp·page_size, K, H] tile. The cache is never copied into a contiguous array.
On a GPU/TPU the pages are split into chunks processed in parallel and merged by lse
(split-KV, `split_kv`), by the same rule as `attention`. `implementation="cuda"` runs the
CUDA forward kernel with its K/V tiles read through the table (a cp.async from each page's
slot, `jax_flash.cuda`), with the split-KV and GQA packing of a decode step; it is what
implementation=None picks on an NVIDIA GPU. `implementation="cpu"` (None on a CPU) runs the
host forward, each tile packing its key block from the pages' slots. `implementation="pallas"`
runs a decode kernel (`pallas._decode`, on request).

Dispatch goes through the registry (`_registry.paged_reason`, `paged_default`): each
implementation says what it serves with `paged_unsupported(pspec)`, runs it with
`paged_forward` and describes it with `paged_note`; `paged_default` marks the ones that
implementation=None may pick, in the platform's order of preference.

Bad ids and lengths: checked at trace time where the values are concrete (not traced):
a length outside [0, max_pages·page_size] or a page id outside [0, num_pages) among the
pages a sequence uses raises ValueError. At run time nothing is read out of bounds: keys
of pages whose id is out of range are masked (invisible), a length beyond the table counts
only the table's keys, a negative length counts as 0.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from jax_flash import _registry
from jax_flash._config import Config
from jax_flash._normalize import IMPLEMENTATIONS, canonicalize, sinks_array
from jax_flash._paged_spec import PagedSpec
from jax_flash._registry import Explanation
from jax_flash._types import OutAndLse, Window
from jax_flash.inference import split_kv


def reason(name: str, pspec: PagedSpec) -> str | None:
    """Why implementation `name` cannot serve this paged call, or None (the registry asks the
    implementation: `paged_unsupported`)."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {name!r}")
    return _registry.paged_reason(name, pspec)


def _shape_str(x) -> str:
    return f"shape {tuple(x.shape)} and dtype {x.dtype}"


def _int_array(name: str, x, shape) -> jax.Array:
    if x is None:
        raise TypeError(f"{name} must be an int32 array of shape {shape}, got None")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array (int32) of shape {shape}, got {_shape_str(x)}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {_shape_str(x)}")
    return x.astype(jnp.int32)


def _concrete(x) -> np.ndarray | None:
    """The values of `x` when they are known at trace time, else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_pages(key_pages, value_pages, head_dim: int, dtype, what: str):
    for name, x in (("key_pages", key_pages), ("value_pages", value_pages)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have shape [num_pages, page_size, K, H], got {_shape_str(x)}")
        if x.dtype != dtype:
            raise TypeError(f"{name} must have the dtype of {what} ({dtype}), got {_shape_str(x)}")
    if key_pages.shape != value_pages.shape:
        raise ValueError(
            "key_pages and value_pages must have the same shape [num_pages, page_size, K, H] "
            "(the paged cache takes a value head dim Hv = H only; jax_flash.attention takes "
            f"Hv != H), got {tuple(key_pages.shape)} and {tuple(value_pages.shape)}"
        )
    p, ps, kh, h = key_pages.shape
    if p == 0 or ps == 0 or kh == 0:
        raise ValueError(f"key_pages must have non-zero num_pages, page_size and K, got {_shape_str(key_pages)}")
    if h != head_dim:
        raise ValueError(f"key_pages must have the head dim H={head_dim} of {what}, got {_shape_str(key_pages)}")


def _check_values(table: np.ndarray, lengths: np.ndarray, num_pages: int, page_size: int, extra=0, first_row=0):
    """Trace-time checks of concrete page ids and lengths (`extra`: tokens about to be
    appended, which must fit too; rows are numbered from `first_row` in messages)."""
    capacity = table.shape[1] * page_size
    for i, length in enumerate(lengths.tolist()):
        b = first_row + i
        if not 0 <= length + extra <= capacity or length < 0:
            raise ValueError(
                f"kv_lengths[{b}] = {length}"
                + (f" plus {extra} new tokens" if extra else "")
                + f" must lie in [0, max_pages·page_size] = [0, {capacity}] (page_table has "
                f"{table.shape[1]} pages of {page_size})"
            )
        used = table[i, : -(-(length + extra) // page_size)]
        bad = (used < 0) | (used >= num_pages)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"page_table[{b}, {i}] = {int(used[i])} is not a page id in [0, num_pages) = "
                f"[0, {num_pages}) (sequence {b} uses its first {used.size} pages)"
            )


def canonicalize_paged(
    query,
    key_pages,
    value_pages,
    page_table,
    kv_lengths,
    *,
    scale=None,
    is_causal=True,
    local_window_size=None,
    logits_soft_cap=None,
    implementation=None,
    sinks=None,
    config=None,
):
    """Validate a paged_attention call: (PagedSpec, q, key_pages, value_pages, table, lengths,
    sinks (float32 [N] or None)); the call's settings (`config`, a `jax_flash.Config`) are
    resolved now, into the spec."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}, got {implementation!r}")
    q = jnp.asarray(query)
    if q.ndim != 4:
        raise ValueError(f"query must have shape [B, T, N, H], got {_shape_str(q)}")
    b, t, n, h = q.shape
    key_pages, value_pages = jnp.asarray(key_pages), jnp.asarray(value_pages)
    _check_pages(key_pages, value_pages, h, q.dtype, "query")
    num_pages, page_size, kh, _ = key_pages.shape
    if page_table is None or jnp.ndim(page_table) != 2 or jnp.shape(page_table)[0] != b:
        got = "None" if page_table is None else _shape_str(jnp.asarray(page_table))
        raise ValueError(f"page_table must have shape [B, max_pages] with B={b}, got {got}")
    table = _int_array("page_table", page_table, (b, jnp.shape(page_table)[1]))
    max_pages = table.shape[1]
    if max_pages == 0:
        raise ValueError("page_table must have at least one page per sequence, got max_pages = 0")
    lengths = _int_array("kv_lengths", kv_lengths, (b,))
    # Everything else (dtypes, N % K, scale, window, soft cap) as jax_flash.attention checks
    # it, on the gathered cache's shapes (nothing is computed or gathered here).
    holder = {}

    def check(q, k, lens):
        holder["c"] = canonicalize(
            q,
            k,
            k,
            scale=scale,
            is_causal=is_causal,
            key_value_seq_lengths=lens,
            query_offset=lens,
            local_window_size=local_window_size,
            logits_soft_cap=logits_soft_cap,
            config=config,
        )
        return lens

    cap = max_pages * page_size
    jax.eval_shape(
        check,
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((b, cap, kh, h), q.dtype),
        jax.ShapeDtypeStruct((b,), jnp.int32),
    )
    spec = holder["c"].spec
    # Queries are the last T positions: q_offset = L - T. Without causality they see every
    # key < L, which is the window's right side T - 1 (with the length mask): a finite right
    # side lets the key loop stop at the last key instead of the table's end.
    right = spec.window_right
    right = t - 1 if right is None else min(right, t - 1)
    sinks = None if sinks is None else sinks_array(sinks, n, q.dtype)
    spec = dataclasses.replace(spec, window_right=right, has_sinks=sinks is not None)
    tv, lv = _concrete(table), _concrete(lengths)
    if tv is not None and lv is not None:
        _check_values(tv, lv, num_pages, page_size)
    elif lv is not None and ((lv < 0) | (lv > cap)).any():
        i = int(np.argmax((lv < 0) | (lv > cap)))
        raise ValueError(f"kv_lengths[{i}] = {int(lv[i])} must lie in [0, max_pages·page_size] = [0, {cap}]")
    splits = split_kv.num_splits(spec, _registry.platform())
    splits = max(1, min(splits, max_pages))
    pspec = PagedSpec(spec, num_pages, page_size, max_pages, splits)
    return pspec, q, key_pages, value_pages, table, lengths, sinks


@overload
def paged_attention(
    query: ArrayLike,
    key_pages: ArrayLike,
    value_pages: ArrayLike,
    page_table: ArrayLike,
    kv_lengths: ArrayLike,
    *,
    scale: float | None = None,
    is_causal: bool = True,
    local_window_size: Window | None = None,
    logits_soft_cap: float | None = None,
    sinks: ArrayLike | None = None,
    return_residual: Literal[False] = False,
    implementation: str | None = None,
    config: Config | None = None,
) -> jax.Array: ...


@overload
def paged_attention(
    query: ArrayLike,
    key_pages: ArrayLike,
    value_pages: ArrayLike,
    page_table: ArrayLike,
    kv_lengths: ArrayLike,
    *,
    scale: float | None = None,
    is_causal: bool = True,
    local_window_size: Window | None = None,
    logits_soft_cap: float | None = None,
    sinks: ArrayLike | None = None,
    return_residual: Literal[True],
    implementation: str | None = None,
    config: Config | None = None,
) -> OutAndLse: ...


@overload
def paged_attention(
    query: ArrayLike,
    key_pages: ArrayLike,
    value_pages: ArrayLike,
    page_table: ArrayLike,
    kv_lengths: ArrayLike,
    *,
    scale: float | None = None,
    is_causal: bool = True,
    local_window_size: Window | None = None,
    logits_soft_cap: float | None = None,
    sinks: ArrayLike | None = None,
    return_residual: bool = False,
    implementation: str | None = None,
    config: Config | None = None,
) -> jax.Array | OutAndLse: ...


def paged_attention(
    query: ArrayLike,
    key_pages: ArrayLike,
    value_pages: ArrayLike,
    page_table: ArrayLike,
    kv_lengths: ArrayLike,
    *,
    scale: float | None = None,
    is_causal: bool = True,
    local_window_size: Window | None = None,
    logits_soft_cap: float | None = None,
    sinks: ArrayLike | None = None,
    return_residual: bool = False,
    implementation: str | None = None,
    config: Config | None = None,
) -> jax.Array | OutAndLse:
    """Attention of the newest T positions of each sequence against its paged KV cache.

    Args:
      query: [B, T, N, H]; the last T positions of each sequence: query t of sequence b sits
        at position kv_lengths[b] - T + t (its own K/V already written to the cache).
      key_pages, value_pages: [num_pages, page_size, K, H], N % K == 0, dtype of query. Any
        page_size.
      page_table: [B, max_pages] int32; page_table[b, i] holds positions
        [i·page_size, (i+1)·page_size) of sequence b. Entries past a sequence's length are
        never read (any value).
      kv_lengths: [B] int32, the number of valid positions of each sequence (0 allowed: the
        rows see nothing, output 0).
      scale: logits scale; default 1 / sqrt(H).
      is_causal: query t sees positions <= kv_lengths[b] - T + t (default True); False:
        every position < kv_lengths[b].
      local_window_size: int w or (left, right), around each query's position.
      logits_soft_cap: c > 0: logits -> c·tanh(logits / c).
      sinks: optional [N] floating, one logit per query head, as for `jax_flash.attention`
        (a row that sees nothing then gets out 0 and lse = sinks[n]); every implementation.
      return_residual: also return lse [B, T, N] (float32 natural log; -inf for rows that see
        nothing).
      implementation: None (cuda on an NVIDIA GPU, cpu on a CPU, else xla), "xla", "cuda"
        (the forward kernel reading K/V through the table), "cpu" (the host forward, packing
        each key block from its pages) or "pallas" (a decode kernel on the Triton backend,
        interpreted on a CPU); see `explain_paged`.
      config: a `jax_flash.Config` of call settings, as for `jax_flash.attention` (the cpu
        and cuda kernels' split-KV counts, ISA, warp layout, ...), resolved when traced.

    Page ids and lengths that are concrete at trace time are checked (ValueError naming the
    entry); traced ones are masked at run time (never read out of bounds, see the module
    docs). Forward only: an inference op; jax.grad through it raises NotImplementedError.
    Equal to `jax_flash.attention` on the gathered cache with key_value_seq_lengths =
    kv_lengths and query_offset = kv_lengths - T (`jax_flash.paged_reference`).

    Returns:
      out [B, T, N, H] in the dtype of query, or (out, lse) with return_residual=True.

    Example:

    >>> import jax.numpy as jnp
    >>> import jax_flash
    >>> pages = jnp.ones((8, 16, 2, 64), jnp.float32)  # 8 pages of 16 positions, K = 2, H = 64
    >>> table = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)  # 2 sequences of up to 4 pages
    >>> lengths = jnp.array([20, 64], jnp.int32)
    >>> q = jnp.ones((2, 1, 4, 64), jnp.float32)  # one new query per sequence, N = 4
    >>> jax_flash.paged_attention(q, pages, pages, table, lengths).shape
    (2, 1, 4, 64)
    """
    pspec, q, kp, vp, table, lengths, sinks = canonicalize_paged(
        query,
        key_pages,
        value_pages,
        page_table,
        kv_lengths,
        scale=scale,
        is_causal=is_causal,
        local_window_size=local_window_size,
        logits_soft_cap=logits_soft_cap,
        implementation=implementation,
        sinks=sinks,
        config=config,
    )
    name = implementation or _registry.paged_default(pspec)
    why = reason(name, pspec)
    if why is not None:
        raise ValueError(f'implementation="{name}" cannot run paged_attention: {why}')
    out, lse = _paged(name, pspec, q, kp, vp, table, lengths, sinks)
    lse = jnp.swapaxes(lse, 1, 2)  # [B, N, T] -> [B, T, N]
    return (out, lse) if return_residual else out


def _run(name: str, pspec: PagedSpec, q, key_pages, value_pages, table, lengths, sinks=None):
    impl = _registry.get_paged(name)
    assert impl is not None  # paged_attention checked that `name` serves the call
    return impl.paged_forward(pspec, q, key_pages, value_pages, table, lengths, sinks=sinks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _paged(name: str, pspec: PagedSpec, q, key_pages, value_pages, table, lengths, sinks):
    return _run(name, pspec, q, key_pages, value_pages, table, lengths, sinks=sinks)


def _paged_fwd(name, pspec, q, key_pages, value_pages, table, lengths, sinks):
    return _run(name, pspec, q, key_pages, value_pages, table, lengths, sinks=sinks), None


def _paged_bwd(name, pspec, residuals, cotangents):
    raise NotImplementedError(
        "jax_flash.paged_attention is an inference op (forward only) and has no gradient; to "
        "differentiate, gather the cache (jax_flash.paged_reference shows how) and use "
        "jax_flash.attention with key_value_seq_lengths and query_offset"
    )


_paged.defvjp(_paged_fwd, _paged_bwd)


def paged_cache_write(
    key_pages: ArrayLike,
    value_pages: ArrayLike,
    page_table: ArrayLike,
    kv_lengths: ArrayLike,
    new_k: ArrayLike,
    new_v: ArrayLike,
    num_new: ArrayLike | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Append new tokens' K/V to a paged cache: (key_pages, value_pages) with new_k[b, t]
    written at position kv_lengths[b] + t of sequence b (page page_table[b, pos //
    page_size], slot pos % page_size).

    Args:
      key_pages, value_pages: [num_pages, page_size, K, H].
      page_table: [B, max_pages] int32; kv_lengths: [B] int32 (positions already filled).
      new_k, new_v: [B, T_new, K, H], cast to the cache's dtype.
      num_new: optional [B] int32: only tokens t < num_new[b] of row b are written (ragged
        appends; default all T_new).

    Under `jax.jit(..., donate_argnums=(0, 1))` the pages are updated in place (one scatter,
    no copy of the cache). The caller advances its lengths (kv_lengths + T_new or + num_new).
    Concrete values are checked at trace time (ValueError: lengths + new tokens beyond the
    table, page ids out of range); at run time a token whose position lies beyond the table
    or whose page id is out of range is dropped (nothing is written out of bounds). Pages
    written must belong to one sequence each (two rows writing one slot: either may win).

    Example:

    >>> import jax.numpy as jnp
    >>> import jax_flash
    >>> kp = vp = jnp.zeros((4, 16, 1, 8), jnp.float32)  # 4 pages of 16 positions
    >>> table = jnp.array([[2, 0]], jnp.int32)  # sequence 0: pages 2, then 0
    >>> new = jnp.ones((1, 3, 1, 8), jnp.float32)  # 3 new tokens
    >>> kp, vp = jax_flash.paged_cache_write(kp, vp, table, jnp.array([15], jnp.int32), new, new)
    >>> float(kp[2, 15, 0, 0]), float(kp[0, 0, 0, 0]), float(kp[0, 1, 0, 0])  # positions 15, 16, 17
    (1.0, 1.0, 1.0)
    """
    key_pages, value_pages = jnp.asarray(key_pages), jnp.asarray(value_pages)
    if key_pages.ndim != 4:
        raise ValueError(f"key_pages must have shape [num_pages, page_size, K, H], got {_shape_str(key_pages)}")
    _check_pages(key_pages, value_pages, key_pages.shape[3], key_pages.dtype, "key_pages")
    num_pages, ps, kh, h = key_pages.shape
    new_k, new_v = jnp.asarray(new_k), jnp.asarray(new_v)
    for name, x in (("new_k", new_k), ("new_v", new_v)):
        if x.ndim != 4 or x.shape[2:] != (kh, h):
            raise ValueError(f"{name} must have shape [B, T_new, K={kh}, H={h}], got {_shape_str(x)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating-point array, got {_shape_str(x)}")
    if new_k.shape != new_v.shape:
        raise ValueError(f"new_k and new_v must have the same shape, got {tuple(new_k.shape)} and {tuple(new_v.shape)}")
    b, tn = new_k.shape[:2]
    no_table = page_table is None  # not an ArrayLike, but a mistaken None gets its own message
    if no_table or jnp.ndim(page_table) != 2 or jnp.shape(page_table)[0] != b:
        got = "None" if no_table else _shape_str(jnp.asarray(page_table))
        raise ValueError(f"page_table must have shape [B, max_pages] with B={b} (new_k's batch), got {got}")
    table = _int_array("page_table", page_table, (b, jnp.shape(page_table)[1]))
    lengths = _int_array("kv_lengths", kv_lengths, (b,))
    count = None if num_new is None else _int_array("num_new", num_new, (b,))
    tv, lv = _concrete(table), _concrete(lengths)
    cv = tn if count is None else _concrete(count)
    if tv is not None and lv is not None and cv is not None:
        if np.any(np.asarray(cv) < 0) or np.any(np.asarray(cv) > tn):
            raise ValueError(f"num_new must lie in [0, T_new] = [0, {tn}], got {np.asarray(cv).tolist()}")
        for row in range(b):
            extra = int(np.asarray(cv).reshape(-1)[row] if count is not None else tn)
            _check_values(tv[row : row + 1], lv[row : row + 1], num_pages, ps, extra, row)
    pos = jnp.maximum(lengths, 0)[:, None] + jnp.arange(tn, dtype=jnp.int32)  # [B, T_new]
    col = pos // ps
    inside = (col < table.shape[1]) & (pos >= 0)  # pos < 0: int32 wrap-around of a huge length
    page = jnp.take_along_axis(table, jnp.clip(col, 0, table.shape[1] - 1), axis=1)
    keep = inside & (page >= 0) & (page < num_pages)
    if count is not None:
        keep = keep & (jnp.arange(tn, dtype=jnp.int32) < count[:, None])
    page = jnp.where(keep, page, num_pages)  # out of range: the scatter drops it
    slot = pos % ps
    key_pages = key_pages.at[page, slot].set(new_k.astype(key_pages.dtype), mode="drop")
    value_pages = value_pages.at[page, slot].set(new_v.astype(value_pages.dtype), mode="drop")
    return key_pages, value_pages


def explain_paged(
    query: ArrayLike,
    key_pages: ArrayLike,
    value_pages: ArrayLike,
    page_table: ArrayLike,
    kv_lengths: ArrayLike,
    *,
    verbose: bool = False,
    **kwargs: Any,
) -> Explanation:
    """Same arguments as `paged_attention`; which implementation would run it and why each
    other one would not: one plain line per implementation, and with ``verbose=True`` the
    rule behind each available one.

    Example:

    >>> import jax.numpy as jnp
    >>> import jax_flash
    >>> pages = jnp.ones((8, 16, 2, 64), jnp.float32)
    >>> table = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)
    >>> q = jnp.ones((2, 1, 4, 64), jnp.float32)
    >>> e = jax_flash.explain_paged(q, pages, pages, table, jnp.array([20, 64], jnp.int32), implementation="xla")
    >>> e.selected, e.reasons["xla"]
    ('xla', None)
    """
    kwargs.pop("return_residual", None)
    requested = kwargs.get("implementation")
    pspec = canonicalize_paged(query, key_pages, value_pages, page_table, kv_lengths, **kwargs)[0]
    reasons = {name: reason(name, pspec) for name in _registry.names()}
    name = requested or _registry.paged_default(pspec)
    selected = name if reasons[name] is None else None
    notes: dict[str, str] = {}
    summaries: dict[str, str] = {}
    for candidate, why in reasons.items():
        if why is None:
            impl = _registry.get_paged(candidate)
            assert impl is not None  # reason() is None only for one that serves paged_attention
            notes[candidate] = impl.paged_note(pspec)
            summaries[candidate] = impl.paged_summary(pspec)
    return Explanation(
        selected=selected,
        reasons=reasons,
        notes=notes,
        op="jax_flash.paged_attention",
        summaries=summaries,
        verbose=verbose,
    )
