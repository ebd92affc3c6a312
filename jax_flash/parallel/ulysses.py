"""All-to-all sequence parallelism (DeepSpeed-Ulysses) and the 2-D all-to-all × ring hybrid,
inside `jax.shard_map`.

`ulysses_attention`: each of the P devices of mesh axis `axis_name` holds a chunk
[B, T/P, N, H] of the queries (and [B, S/P, K, H] / [B, S/P, K, Hv] of the keys/values).
One `lax.all_to_all` per input re-shards from sequence to heads: device d then holds the
whole sequence of query heads [d·N/P, (d+1)·N/P) (and of the kv heads they use), calls
`jax_flash.attention` once on it (any implementation, chosen as usual), and one all-to-all
per output shards the result back over the sequence. Nothing of size T×S is gathered:
activations per device are O(T·N/P).

GQA. Query head n uses kv head n // (N/K). The kv heads are repeated r = lcm(K, P) / K
times (jnp.repeat: head j of the repeated K' = lcm(K, P) heads is head j // r), which keeps
the grouping (N / K' query heads per repeated kv head) and makes K' divisible by P: device d
receives exactly the kv heads of its query heads. K % P == 0 repeats nothing (each device
holds K/P kv heads); K < P with P % K == 0 gives each device the one kv head its query heads
share. The repeat's transpose sums the replicas' gradients.

Positions are global after the all-to-all (the full sequence, in order), so causal masks,
windows, `query_offset` and the global lengths pass through unchanged; segment ids (small
int arrays) are all-gathered along the sequence; `sinks` [N] are sliced to the device's
heads; a dense bias/mask holding this device's query rows against all keys is re-sharded
like the queries (all-to-all over heads and rows, an all-gather of rows when it broadcasts
over heads, a slice of heads when it broadcasts over rows).

Backward: the all-to-alls are linear (JAX transposes each into the reverse all-to-all, an
all-gather into a reduce-scatter, a head slice into its padding); `jax_flash.attention`
brings its own custom_vjp. No custom rule is needed here.

Dropout needs the unsharded call's keep-mask, whose Philox counter holds the *global* query
head (`jax_flash._dropout`); the local call numbers its heads from 0 and `attention` takes no
head offset, so dropout with more than one device raises NotImplementedError rather than
draw a different mask.

`hybrid_attention`: the sequence is sharded over two mesh axes (ring axis major, the
all-to-all axis minor, i.e. `P(None, (ring_axis, a2a_axis))`); the all-to-all over
`a2a_axis` gathers each ring chunk whole and shards the heads, then `ring_attention` over
`ring_axis` (contiguous or zigzag chunks) computes the attention, then the reverse
all-to-all. Sinks are merged into the ring's result by log-sum-exp.
"""

from __future__ import annotations

import math
import numbers
from typing import Literal, overload

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from jax_flash._api import attention
from jax_flash._types import OutAndLse, SegmentIds, Window
from jax_flash.parallel.ring import LAYOUTS, ring_attention, unzigzag, zigzag

__all__ = ["hybrid_attention", "ulysses_attention"]


# ----------------------------------------------------------------------------- helpers


def _axis_size(axis_name, fn: str, arg: str = "axis_name") -> int:
    if not isinstance(axis_name, str):
        raise TypeError(f"{fn}: {arg} must be the name (str) of a mesh axis, got {axis_name!r}")
    try:
        return int(lax.axis_size(axis_name))
    except (NameError, KeyError) as e:
        raise ValueError(
            f"{fn}: {arg} {axis_name!r} is not an axis of the enclosing shard_map: call "
            f"{fn} inside jax.shard_map over a mesh with that axis"
        ) from e


def _check_layout(layout, fn: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"{fn}: layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


class _Resharder:
    """The sequence <-> heads re-sharding over one mesh axis of size p.

    `layout`: how the devices' chunks order the sequence ("contiguous": chunk d on device d;
    "zigzag": chunks d and 2p-1-d). After the all-to-all the gathered sequence is in device
    order; zigzag is undone locally so the local call sees global positions in order.
    """

    def __init__(self, axis_name: str, p: int, layout: str):
        self.axis_name, self.p, self.layout = axis_name, p, layout

    def _order(self, x, axis):
        return unzigzag(x, self.p, axis=axis) if self.layout == "zigzag" else x

    def _disorder(self, x, axis):
        return zigzag(x, self.p, axis=axis) if self.layout == "zigzag" else x

    def to_heads(self, x, seq_axis: int, head_axis: int):
        """[.., T/p (seq_axis), .., N (head_axis), ..] -> [.., T, .., N/p, ..]."""
        if self.p == 1:
            return x
        y = lax.all_to_all(x, self.axis_name, split_axis=head_axis, concat_axis=seq_axis, tiled=True)
        return self._order(y, seq_axis)

    def to_sequence(self, y, seq_axis: int, head_axis: int):
        """Inverse of `to_heads`: [.., T, .., N/p, ..] -> [.., T/p, .., N, ..]."""
        if self.p == 1:
            return y
        y = self._disorder(y, seq_axis)
        return lax.all_to_all(y, self.axis_name, split_axis=seq_axis, concat_axis=head_axis, tiled=True)

    def gather(self, x, seq_axis: int):
        """All-gather of the sequence (segment ids, bias rows), in sequence order."""
        if self.p == 1:
            return x
        y = lax.all_gather(x, self.axis_name, axis=seq_axis, tiled=True)
        return self._order(y, seq_axis)

    def head_slice(self, x, head_axis: int):
        """This device's block of a head-indexed array that is the same on every device."""
        if self.p == 1:
            return x
        size = x.shape[head_axis] // self.p
        start = lax.axis_index(self.axis_name) * size
        return lax.dynamic_slice_in_dim(x, start, size, axis=head_axis)


def _check_heads(fn, q, k, v, p, axis_name, hybrid: bool):
    for name, x in (("query", q), ("key", k), ("value", v)):
        if jnp.ndim(x) < 3:
            raise ValueError(f"{fn}: {name} must be [*B, T/P, heads, head_dim] (rank >= 3), got shape {jnp.shape(x)}")
    n, kh = q.shape[-2], k.shape[-2]
    if n % p:
        other = (
            "ring_attention over all the axes (any head count), or an all-to-all axis whose size divides the heads"
            if hybrid
            else "ring_attention (any head count) or hybrid_attention (all-to-all over an axis whose "
            "size divides the heads, ring over another)"
        )
        raise ValueError(
            f"{fn}: the N={n} query heads must be divisible by the P={p} devices of mesh axis "
            f"{axis_name!r} (each device attends N/P heads over the whole sequence); use {other}"
        )
    if kh < 1 or n % kh:
        raise ValueError(f"{fn}: the N={n} query heads must be a multiple of the K={kh} kv heads (GQA)")


def _expand_kv(x, p: int):
    """Repeat the kv heads (axis -2) lcm(K, P) / K times, so that their count divides p and
    every device receives the kv heads of its query heads."""
    kh = x.shape[-2]
    r = math.lcm(kh, p) // kh
    return x if r == 1 else jnp.repeat(x, r, axis=-2)


def _segments(segment_ids, rs: _Resharder):
    if segment_ids is None:
        return None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(
                "segment_ids must be one array [*B, T/P] or a pair (q_ids [*B, T/P], kv_ids [*B, S/P]), "
                f"got a sequence of {len(segment_ids)}"
            )
        return tuple(rs.gather(jnp.asarray(s), jnp.ndim(s) - 1) for s in segment_ids)
    return rs.gather(jnp.asarray(segment_ids), jnp.ndim(segment_ids) - 1)


def _sinks(sinks, n: int, rs: _Resharder, fn: str):
    if sinks is None:
        return None
    sinks = jnp.asarray(sinks)
    if sinks.shape != (n,):
        raise ValueError(f"{fn}: sinks must have shape [N] = ({n},) (one logit per query head), got {sinks.shape}")
    return rs.head_slice(sinks, 0)


def _dense(x, name: str, q, s_global: int, rs: _Resharder, fn: str):
    """A bias/mask holding this device's query rows against all keys, broadcastable to
    `[*B, N, T/P, S]` -> broadcastable to `[*B, N/P, T, S]` (this device's heads, every row)."""
    if x is None:
        return None
    x = jnp.asarray(x)
    rank = q.ndim  # [*B, N, T, S] has the rank of [*B, T, N, H]
    if x.ndim > rank:
        raise ValueError(f"{fn}: {name} must be broadcastable to [*B, N, T/P, S], got shape {x.shape}")
    x = x.reshape((1,) * (rank - x.ndim) + x.shape)
    n, t_local = q.shape[-2], q.shape[-3]
    heads, rows, cols = x.shape[-3], x.shape[-2], x.shape[-1]
    if heads not in (1, n) or rows not in (1, t_local) or cols not in (1, s_global):
        raise ValueError(
            f"{fn}: {name} must hold this device's query rows against all keys, broadcastable "
            f"to [*B, N, T/P, S] = [*B, {n}, {t_local}, {s_global}] (S the global key length), "
            f"got shape {x.shape}"
        )
    is_bool = x.dtype == jnp.bool_
    if is_bool:  # collectives move it as bytes
        x = x.astype(jnp.uint8)
    h_ax, r_ax = rank - 3, rank - 2
    split_heads = heads == n and n > 1
    gather_rows = rows == t_local  # (t_local == 1: gathering is right either way)
    if split_heads and gather_rows:
        x = rs.to_heads(x, r_ax, h_ax)
    elif gather_rows:
        x = rs.gather(x, r_ax)
    elif split_heads:
        x = rs.head_slice(x, h_ax)
    return x.astype(jnp.bool_) if is_bool else x


def _check_dropout(dropout_rate, p: int, fn: str):
    # bool is a numbers.Real at run time (typeshed's classes do not say so): tested first.
    is_real = not isinstance(dropout_rate, bool) and isinstance(dropout_rate, numbers.Real)
    if p > 1 and is_real and dropout_rate > 0:
        raise NotImplementedError(
            f"{fn}: dropout over P={p} devices is not supported: the unsharded call's keep-mask "
            "counts the global query head (jax_flash._dropout: counter (s >> 2, t, n, b)), and "
            "the local call on N/P heads cannot be given a head offset, so its mask would differ. "
            "Use dropout_rate=0 here, or jax_flash.attention under jax.jit (which gathers "
            "the sharded dimensions of a dropout call, so it draws the unsharded mask)"
        )


# ----------------------------------------------------------------------------- ulysses


@overload
def ulysses_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    axis_name: str,
    layout: str = "contiguous",
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: Window | None = None,
    segment_ids: SegmentIds | None = None,
    logits_soft_cap: float | None = None,
    query_offset: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    return_residual: Literal[False] = False,
    implementation: str | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: ArrayLike | None = None,
) -> jax.Array: ...


@overload
def ulysses_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    axis_name: str,
    layout: str = "contiguous",
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: Window | None = None,
    segment_ids: SegmentIds | None = None,
    logits_soft_cap: float | None = None,
    query_offset: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    return_residual: Literal[True],
    implementation: str | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: ArrayLike | None = None,
) -> OutAndLse: ...


@overload
def ulysses_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    axis_name: str,
    layout: str = "contiguous",
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: Window | None = None,
    segment_ids: SegmentIds | None = None,
    logits_soft_cap: float | None = None,
    query_offset: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    return_residual: bool = False,
    implementation: str | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: ArrayLike | None = None,
) -> jax.Array | OutAndLse: ...


def ulysses_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
    *,
    axis_name: str,
    layout: str = "contiguous",
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: Window | None = None,
    segment_ids: SegmentIds | None = None,
    logits_soft_cap: float | None = None,
    query_offset: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    return_residual: bool = False,
    implementation: str | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: ArrayLike | None = None,
) -> jax.Array | OutAndLse:
    """All-to-all sequence parallelism (DeepSpeed-Ulysses) inside `jax.shard_map`: the
    sequences are sharded over mesh axis `axis_name` (P devices); one all-to-all re-shards
    q, k, v to head-sharded full sequences, `jax_flash.attention` runs locally on N/P heads,
    and one all-to-all shards the result back over the sequence.

    The result is exactly `jax_flash.attention` on the gathered arrays, sharded like the
    queries; masks use global positions.

    Args:
      query: this device's chunk `[*B, T/P, N, H]`; N must be divisible by P (else
        ValueError: use `ring_attention` or `hybrid_attention`).
      key, value: this device's chunks `[*B, S/P, K, H]` / `[*B, S/P, K, Hv]` (N % K == 0; any
        K: kv heads are repeated lcm(K, P)/K times so every device gets those its query
        heads use).
      bias, mask: optional, this device's query rows against *all* keys: broadcastable to
        `[*B, N, T/P, S]` (S the global key length); re-sharded to `[*B, N/P, T, S]`.
      axis_name: the mesh axis the sequences are sharded over.
      layout: "contiguous" (device d holds chunk d of P) or "zigzag" (chunks d and 2P-1-d
        of 2P, as `ring_attention`'s; the local call still sees the sequence in order).
      is_causal, local_window_size, logits_soft_cap, scale, query_offset: as in
        `jax_flash.attention`, in global positions.
      query_seq_lengths, key_value_seq_lengths: `[*B]` int32 *global* lengths (replicated
        over the axis).
      segment_ids: this device's chunk `[*B, T/P]`, or a pair (q_ids `[*B, T/P]`, kv_ids
        `[*B, S/P]`); all-gathered along the sequence.
      sinks: [N], the same on every device (replicated); each device uses its heads' slice.
      return_residual: also return this device's lse `[*B, T/P, N]`.
      implementation: the local call's implementation, as in `jax_flash.attention`.
      dropout_rate, dropout_rng: only with P = 1; more devices raise NotImplementedError
        (the unsharded mask depends on the global head index, see the module docstring).

    Differentiable in query, key, value, bias and sinks by reverse mode, like `attention`.
    """
    fn = "ulysses_attention"
    p = _axis_size(axis_name, fn)
    _check_layout(layout, fn)
    _check_dropout(dropout_rate, p, fn)
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    _check_heads(fn, query, key, value, p, axis_name, hybrid=False)
    if layout == "zigzag" and p > 1 and (query.shape[-3] % 2 or key.shape[-3] % 2):
        raise ValueError(
            f'{fn}: layout="zigzag" needs even local sequence lengths (two chunks per device), '
            f"got query {query.shape} and key {key.shape}"
        )
    rs = _Resharder(axis_name, p, layout)
    n = query.shape[-2]
    s_global = key.shape[-3] * p
    seq, head = query.ndim - 3, query.ndim - 2
    q = rs.to_heads(query, seq, head)
    k = rs.to_heads(_expand_kv(key, p), seq, head)
    v = rs.to_heads(_expand_kv(value, p), seq, head)
    res = attention(
        q,
        k,
        v,
        _dense(bias, "bias", query, s_global, rs, fn),
        _dense(mask, "mask", query, s_global, rs, fn),
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        segment_ids=_segments(segment_ids, rs),
        logits_soft_cap=logits_soft_cap,
        query_offset=query_offset,
        sinks=_sinks(sinks, n, rs, fn),
        return_residual=return_residual,
        implementation=implementation,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
    )
    return _back(res, rs, return_residual)


def _back(res, rs: _Resharder, return_residual: bool):
    if not return_residual:
        return rs.to_sequence(res, res.ndim - 3, res.ndim - 2)
    out, lse = res
    return rs.to_sequence(out, out.ndim - 3, out.ndim - 2), rs.to_sequence(lse, lse.ndim - 2, lse.ndim - 1)


# ----------------------------------------------------------------------------- hybrid


def _merge_sinks(out, lse, sinks):
    """Add one virtual key per head with logit sinks[n] and value 0 to a finished
    (out `[*B, T, N, Hv]`, lse `[*B, T, N]`): the softmax denominator gains exp(sinks[n])."""
    s = sinks.astype(lse.dtype)
    new_lse = jnp.logaddexp(lse, s)
    none = jnp.isneginf(new_lse)  # no key and a -inf sink: out stays 0
    w = jnp.where(none, 0.0, jnp.exp(lse - jnp.where(none, 0.0, new_lse)))
    bad = jnp.isnan(s) | jnp.isposinf(s)  # as attention: such a head's out and lse are NaN
    out = jnp.where(bad[:, None], jnp.nan, out * w[..., None].astype(out.dtype)).astype(out.dtype)
    return out, jnp.where(bad, jnp.nan, new_lse)


@overload
def hybrid_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    a2a_axis: str,
    ring_axis: str,
    layout: str = "contiguous",
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: Window | None = None,
    segment_ids: SegmentIds | None = None,
    logits_soft_cap: float | None = None,
    query_offset: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    return_residual: Literal[False] = False,
    implementation: str | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: ArrayLike | None = None,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
) -> jax.Array: ...


@overload
def hybrid_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    a2a_axis: str,
    ring_axis: str,
    layout: str = "contiguous",
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: Window | None = None,
    segment_ids: SegmentIds | None = None,
    logits_soft_cap: float | None = None,
    query_offset: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    return_residual: Literal[True],
    implementation: str | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: ArrayLike | None = None,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
) -> OutAndLse: ...


@overload
def hybrid_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    a2a_axis: str,
    ring_axis: str,
    layout: str = "contiguous",
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: Window | None = None,
    segment_ids: SegmentIds | None = None,
    logits_soft_cap: float | None = None,
    query_offset: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    return_residual: bool = False,
    implementation: str | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: ArrayLike | None = None,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
) -> jax.Array | OutAndLse: ...


def hybrid_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    a2a_axis: str,
    ring_axis: str,
    layout: str = "contiguous",
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: ArrayLike | None = None,
    key_value_seq_lengths: ArrayLike | None = None,
    local_window_size: Window | None = None,
    segment_ids: SegmentIds | None = None,
    logits_soft_cap: float | None = None,
    query_offset: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
    return_residual: bool = False,
    implementation: str | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: ArrayLike | None = None,
    bias: ArrayLike | None = None,
    mask: ArrayLike | None = None,
) -> jax.Array | OutAndLse:
    """2-D sequence parallelism inside `jax.shard_map` ("USP"): all-to-all over `a2a_axis`
    (size Pa, which must divide N), ring attention over `ring_axis` (size Pr).

    The sequences are sharded over both axes, ring axis major: shard global arrays with
    `PartitionSpec(None, (ring_axis, a2a_axis))`, so that the Pa devices of one a2a group
    hold the pieces of one ring chunk. An all-to-all over `a2a_axis` gathers that chunk whole
    on N/Pa heads, `jax_flash.ring_attention` over `ring_axis` (with `layout`) attends it to
    every chunk of the ring, and the reverse all-to-all shards the result back.

    With layout="zigzag" the ring chunks are zigzag chunks: reorder global arrays with
    `jax_flash.zigzag(x, Pr)` (Pr = the ring axis size) before sharding them over
    (ring_axis, a2a_axis), and `jax_flash.unzigzag(out, Pr)` after; causal work is then
    balanced over the ring.

    Args: as `ulysses_attention` (query/key/value: this device's `[*B, T/(Pa·Pr), N, H]` /
    `[*B, S/(Pa·Pr), K, H]` / [.., Hv]; lengths global; segment ids this device's chunk;
    sinks [N] replicated), and as `ring_attention` (is_causal, local_window_size,
    query_offset, logits_soft_cap, scale, in global positions; implementation computes the
    ring's blocks). Dropout and a dense bias/mask raise NotImplementedError (the ring takes
    neither). Differentiable in query, key, value and sinks by reverse mode.
    """
    fn = "hybrid_attention"
    pa = _axis_size(a2a_axis, fn, "a2a_axis")
    _axis_size(ring_axis, fn, "ring_axis")  # an axis of the enclosing shard_map, else a clear error
    if a2a_axis == ring_axis:
        raise ValueError(f"{fn}: a2a_axis and ring_axis must be two different mesh axes, got {a2a_axis!r} twice")
    _check_layout(layout, fn)
    if bias is not None or mask is not None:
        raise NotImplementedError(
            f"{fn}: a dense bias or mask is not supported (the ring computes blocks without "
            "one); use ulysses_attention, which takes them, or express the mask as "
            "is_causal / local_window_size / lengths / segment_ids"
        )
    if isinstance(dropout_rate, numbers.Real) and not isinstance(dropout_rate, bool) and dropout_rate > 0:
        raise NotImplementedError(
            f"{fn}: dropout is not supported (ring_attention has none, and the unsharded "
            "mask counts global heads); use dropout_rate=0"
        )
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    _check_heads(fn, query, key, value, pa, a2a_axis, hybrid=True)
    rs = _Resharder(a2a_axis, pa, "contiguous")  # the a2a group's pieces of one ring chunk
    n = query.shape[-2]
    seq, head = query.ndim - 3, query.ndim - 2
    q = rs.to_heads(query, seq, head)
    k = rs.to_heads(_expand_kv(key, pa), seq, head)
    v = rs.to_heads(_expand_kv(value, pa), seq, head)
    local_sinks = _sinks(sinks, n, rs, fn)
    out, lse = ring_attention(
        q,
        k,
        v,
        axis_name=ring_axis,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,  # global: ring_attention clips wide ones to T, S
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        segment_ids=_segments(segment_ids, rs),
        logits_soft_cap=logits_soft_cap,
        scale=scale,
        layout=layout,
        query_offset=query_offset,
        return_residual=True,
        implementation=implementation,
    )
    if local_sinks is not None:
        out, lse = _merge_sinks(out, lse, local_sinks)
    return _back((out, lse), rs, True) if return_residual else _back(out, rs, False)
