"""Validation of the public arguments and their reduction to the canonical call.

Every error is raised at trace time, names the argument, says what it received and what is
accepted.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _config, _dropout
from jax_flash._spec import AttentionSpec, MaskInputs

IMPLEMENTATIONS = ("cuda", "pallas", "cpu", "xla")

_FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


class Canonical(NamedTuple):
    """A call in canonical form plus what is needed to restore the caller's shapes."""

    spec: AttentionSpec
    q: jax.Array  # [B, T, N, H]
    k: jax.Array  # [B, S, K, H]
    v: jax.Array  # [B, S, K, Hv]
    masks: MaskInputs
    batch_shape: tuple[int, ...]  # the caller's leading batch axes (() for 3-D inputs)


def _shape_str(x) -> str:
    return f"shape {tuple(x.shape)} and dtype {x.dtype}"


def _as_array(name: str, x) -> jax.Array:
    if x is None:
        raise TypeError(f"{name} must be an array, got None")
    if isinstance(x, (str, bytes)):
        raise TypeError(f"{name} must be an array, got {type(x).__name__} {x!r}")
    try:
        return jnp.asarray(x)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be an array, got {type(x).__name__}") from e


def _check_int_array(name: str, x, shape: tuple[int, ...], alt_shapes=(), clip=None) -> jax.Array:
    """An integer array of `shape` as int32. clip=(lo, hi): values are clipped to it first
    (lengths: any value means the same as its clip to [0, T]), so that no 64-bit or unsigned
    value wraps around in the cast; without it, concrete values outside int32 are an error."""
    raw = x
    x = _as_array(name, x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array (int32), got {_shape_str(x)}")
    if tuple(x.shape) != shape and tuple(x.shape) not in alt_shapes:
        accepted = " or ".join(str(s) for s in (shape, *alt_shapes))
        raise ValueError(f"{name} must have shape {accepted}, got {_shape_str(x)}")
    wide = x.dtype.itemsize > 4 or (x.dtype.itemsize == 4 and jnp.issubdtype(x.dtype, jnp.unsignedinteger))
    if wide and clip is not None:
        x = jnp.clip(x, *(np.asarray(c).astype(x.dtype) for c in clip))
    elif wide:
        _check_int32_values(name, raw)
    return x.astype(jnp.int32).reshape(shape)


def _check_int32_values(name: str, x) -> None:
    """ValueError when concrete values of a 64-bit or unsigned array do not fit int32. A
    traced one cannot be checked at trace time, and its cast could wrap a value onto another
    (segment ids 0 and 2**32 would match, an offset would move): TypeError, int32 is needed."""
    try:
        values = np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        dtype = jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype
        raise TypeError(
            f"{name} must be an int32 array when traced (under jit, vmap or grad), got {dtype}: "
            "a traced 64-bit or unsigned array's values cannot be checked to fit int32 at trace "
            f"time; pass {name.split(' ')[0]}.astype(jnp.int32) (or concrete values)"
        ) from None
    if values.size and (values.min() < _INT32_MIN or values.max() > _INT32_MAX):
        raise ValueError(f"{name} must fit in int32, got values in [{values.min()}, {values.max()}]")


def _query_offset(query_offset, batch_shape, b: int) -> jax.Array:
    """int, or an integer array broadcastable to [*batch]: -> [B] int32."""
    name = "query_offset"
    if isinstance(query_offset, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int or an integer array [*B], got {query_offset!r}")
    if isinstance(query_offset, numbers.Integral):
        o = int(query_offset)
        if not _INT32_MIN <= o <= _INT32_MAX:
            raise ValueError(f"{name} must fit in int32, got {o}")
        return jnp.full((b,), o, jnp.int32)
    x = _as_array(name, query_offset)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an int or an integer array [*B] (int32), got {_shape_str(x)}")
    shape = tuple(x.shape)
    target = tuple(batch_shape)
    ok = len(shape) <= max(len(target), 1) and all(d == 1 or d == want for d, want in zip(shape[::-1], target[::-1]))
    if ok and not target:
        ok = shape in ((), (1,))
    if not ok:
        raise ValueError(
            f"{name} must be an int or an integer array broadcastable to [*B] = {target}, got {_shape_str(x)}"
        )
    if x.dtype.itemsize > 4 or jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        _check_int32_values(name, query_offset)
    x = x.astype(jnp.int32)
    if not target:
        return x.reshape(1)
    return jnp.broadcast_to(x, target).reshape(b)


_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


# Soft caps every implementation computes exactly (float32 logits, the kernels' unit):
# from float32's smallest normal, so that 1 / cap and logits / cap stay finite where the
# kernels need them, to 1e30, above which logits / cap falls below float32's normal range
# for ordinary logits and is flushed to zero (a cap above 1e30 changes no logit below 1e26
# anyway: pass None).
SOFT_CAP_MIN = float(np.finfo(np.float32).tiny)  # 1.1754944e-38
SOFT_CAP_MAX = 1e30

# T and S stay below 2**30 so that every sum of two positions, a position and a block, or
# the band's ends (clipped to [-T, S]) fits int32, the index type of every implementation.
MAX_SEQ_LEN = 2**30 - 1


def _soft_cap(cap) -> float | None:
    """None (off), or a float in [SOFT_CAP_MIN, SOFT_CAP_MAX]; 0.0 is an error, not "off"."""
    if cap is None:
        return None
    if not isinstance(cap, numbers.Real) or isinstance(cap, (bool, np.bool_)):
        raise TypeError(f"logits_soft_cap must be a Python float or None, got {cap!r}")
    cap = float(cap)
    if not SOFT_CAP_MIN <= cap <= SOFT_CAP_MAX:  # also NaN, inf, 0 and negatives
        raise ValueError(
            "logits_soft_cap must be a positive float32 normal from "
            f"{SOFT_CAP_MIN:.8g} to {SOFT_CAP_MAX:g}, or None (no cap), got {cap!r}"
        )
    return cap


def _window_bound(t: int, s: int) -> int:
    """The widest window side that still means something, for any query offset.

    Query t at position p = o + t sees key s when s - t >= o - left and s - t <= o + right;
    s - t always lies in (-T, S) and the offset o is an int32 (|o| <= 2**31), possibly
    traced. A side of at least T + S + 2**31 therefore bounds nothing for every offset
    (o - left <= -T and o + right >= S), exactly like any wider one, so windows are clamped
    to it: it fits the int64 window attributes of the compiled kernels and keeps the band's
    saturating int32 arithmetic (`AttentionSpec.band`) exact.
    """
    return t + s + 2**31


def window(local_window_size, is_causal, t: int | None = None, s: int | None = None) -> tuple[int | None, int | None]:
    """(left, right), None = unbounded; clamped by `_window_bound(t, s)` when T and S are given."""
    left = right = None
    if local_window_size is not None:
        w = local_window_size
        if isinstance(w, numbers.Integral) and not isinstance(w, bool):
            w = (int(w), int(w))
        if (
            not isinstance(w, (tuple, list))
            or len(w) != 2
            or not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in w)
        ):
            raise ValueError(
                f"local_window_size must be an int w or a pair (left, right) of ints, got {local_window_size!r}"
            )
        left, right = int(w[0]), int(w[1])
        if left < 0 or right < 0:
            raise ValueError(f"local_window_size must be non-negative, got (left, right) = ({left}, {right})")
        if t is not None and s is not None:
            bound = _window_bound(t, s)
            left, right = min(left, bound), min(right, bound)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a Python bool, got {is_causal!r}")
    if is_causal:
        # Causal is the window (inf, 0): query t sees keys s <= t (top-left aligned).
        right = 0 if right is None else min(right, 0)
    return left, right


def sinks_array(sinks, n: int, dtype) -> jax.Array:
    """A floating array [N] (one logit per query head) -> float32 (float64 for float64
    inputs: the statistics' dtype)."""
    x = _as_array("sinks", sinks)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"sinks must be a floating-point array [N] (one logit per query head), got {_shape_str(x)}")
    if tuple(x.shape) != (n,):
        raise ValueError(f"sinks must have shape [N] = ({n},) (one logit per query head), got {_shape_str(x)}")
    return x.astype(jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32)


def _dense(name: str, x, batch_shape, n, t, s, bool_dtype: bool):
    """Validate a dense bias/mask broadcastable to [*batch, N, T, S]; fold batch axes."""
    x = _as_array(name, x)
    if bool_dtype and x.dtype != jnp.bool_:
        raise TypeError(
            f"{name} must be a boolean array (True = may attend), got {_shape_str(x)}; pass an additive mask as bias"
        )
    if not bool_dtype and not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got {_shape_str(x)}")
    target = (*batch_shape, n, t, s)
    shape = tuple(x.shape)
    if len(shape) > len(target):
        extra = len(shape) - len(target)
        if any(d != 1 for d in shape[:extra]):
            raise ValueError(f"{name} must be broadcastable to [*batch, N, T, S] = {target}, got {_shape_str(x)}")
        x = x.reshape(shape[extra:])
        shape = shape[extra:]
    shape = (1,) * (len(target) - len(shape)) + shape
    for d, want in zip(shape, target):
        if d != 1 and d != want:
            raise ValueError(f"{name} must be broadcastable to [*batch, N, T, S] = {target}, got {_shape_str(x)}")
    x = x.reshape(shape)
    nb = len(batch_shape)
    if all(d == 1 for d in shape[:nb]):
        x = x.reshape((1, *shape[nb:]))
    else:
        x = jnp.broadcast_to(x, (*batch_shape, *shape[nb:]))
        x = x.reshape((math.prod(batch_shape), *shape[nb:]))
    return x


def canonicalize(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal=False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    segment_ids=None,
    logits_soft_cap=None,
    query_offset=None,
    implementation=None,
    sinks=None,
    dropout_rate=0.0,
    dropout_rng=None,
    config=None,
    length_bounds: tuple[int, int] | None = None,
) -> Canonical:
    """Check every argument and build the canonical call (its settings resolved now).

    length_bounds: (T, S) that a 64-bit or unsigned length array is clipped to before its
    int32 cast; default the arrays' own T and S. A sequence-parallel call canonicalizes its
    local chunks with global lengths: it passes the global T and S."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}, got {implementation!r}")
    q = _as_array("query", query)
    k = _as_array("key", key)
    v = _as_array("value", value)
    for name, x in (("query", q), ("key", k), ("value", v)):
        if x.ndim < 3:
            raise ValueError(f"{name} must have rank >= 3 ([*B, T, N, H] or [T, N, H]), got {_shape_str(x)}")
        if x.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {_shape_str(x)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"query, key and value must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.ndim != v.ndim or k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            "key [*B, S, K, H] and value [*B, S, K, Hv] must have the same shape except the "
            f"last (head) dim, got key {tuple(k.shape)} and value {tuple(v.shape)}"
        )
    if q.ndim != k.ndim or q.shape[:-3] != k.shape[:-3]:
        raise ValueError(
            f"query and key must have the same leading batch axes, got query {tuple(q.shape)} and key {tuple(k.shape)}"
        )
    *batch_axes, t, n, h = q.shape
    s, kh, hk = k.shape[-3:]
    batch_shape = tuple(batch_axes)
    if h != hk:
        raise ValueError(
            f"query and key must have the same head dim H, got query {tuple(q.shape)} and key {tuple(k.shape)}"
        )
    # Empty batch, query, key or head axes are allowed (see `_vjp`: an empty output, or
    # with S = 0 rows that see no key); the head dim and the kv heads are not.
    if h == 0:
        raise ValueError(f"query and key must have a head dim H >= 1, got query {tuple(q.shape)}")
    hv = v.shape[-1]
    if hv == 0:
        raise ValueError(f"value must have a head dim Hv >= 1, got value {tuple(v.shape)}")
    if kh == 0:
        raise ValueError(f"key and value must have at least one head (K >= 1), got key {tuple(k.shape)}")
    for name, length, letter in (("query", t, "T"), ("key", s, "S")):
        if length > MAX_SEQ_LEN:
            raise ValueError(
                f"{name} has {letter} = {length} positions; positions are int32 in every "
                f"implementation, so {letter} must be at most 2**30 - 1 = {MAX_SEQ_LEN}"
            )
    if n % kh != 0:
        raise ValueError(
            f"the number of query heads N={n} must be a multiple of the number of key/value "
            f"heads K={kh} (grouped-query attention), got query {tuple(q.shape)} and key "
            f"{tuple(k.shape)}"
        )
    b = math.prod(batch_shape)

    if scale is None:
        scale = 1.0 / math.sqrt(h)
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise TypeError(f"scale must be a Python float or None, got {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")

    logits_soft_cap = _soft_cap(logits_soft_cap)
    left, right = window(local_window_size, is_causal, t, s)

    bias_c = mask_c = None
    if bias is not None:
        bias_c = _dense("bias", bias, batch_shape, n, t, s, bool_dtype=False)
    if mask is not None:
        mask_c = _dense("mask", mask, batch_shape, n, t, s, bool_dtype=True)

    length_shapes = (batch_shape,) if batch_shape else ((1,), ())
    t_bound, s_bound = (t, s) if length_bounds is None else length_bounds
    q_len = kv_len = None
    if query_seq_lengths is not None:
        q_len = _check_int_array(
            "query_seq_lengths", query_seq_lengths, length_shapes[0], length_shapes[1:], clip=(0, t_bound)
        ).reshape(b)
    if key_value_seq_lengths is not None:
        kv_len = _check_int_array(
            "key_value_seq_lengths",
            key_value_seq_lengths,
            length_shapes[0],
            length_shapes[1:],
            clip=(0, s_bound),
        ).reshape(b)

    q_seg = kv_seg = None
    if segment_ids is not None:
        if isinstance(segment_ids, (tuple, list)):
            if len(segment_ids) != 2:
                raise ValueError(
                    "segment_ids must be an array [*B, T] or a pair (q_ids [*B, T], kv_ids [*B, S]), "
                    f"got a sequence of length {len(segment_ids)}"
                )
            q_ids, kv_ids = segment_ids
        else:
            if t != s:
                raise ValueError(
                    "a single segment_ids array needs self-attention (T == S); got T="
                    f"{t}, S={s}: pass (q_segment_ids, kv_segment_ids)"
                )
            q_ids = kv_ids = segment_ids
        q_seg = _check_int_array("segment_ids (query)", q_ids, (*batch_shape, t)).reshape(b, t)
        kv_seg = _check_int_array("segment_ids (key/value)", kv_ids, (*batch_shape, s)).reshape(b, s)

    q_off = None if query_offset is None else _query_offset(query_offset, batch_shape, b)
    sinks_c = None if sinks is None else sinks_array(sinks, n, q.dtype)

    rate = _dropout.check_rate(dropout_rate)
    # rate 0 ignores the key: the call is exactly the one without dropout.
    seed = _dropout.seed_from_key(dropout_rng) if rate > 0 else None

    spec = AttentionSpec(
        batch=b,
        q_len=t,
        kv_len=s,
        num_heads=n,
        num_kv_heads=kh,
        head_dim=h,
        dtype=np.dtype(q.dtype).name,
        scale=scale,
        window_left=left,
        window_right=right,
        soft_cap=logits_soft_cap,
        bias_shape=None if bias_c is None else tuple(bias_c.shape),
        mask_shape=None if mask_c is None else tuple(mask_c.shape),
        has_q_lengths=q_len is not None,
        has_kv_lengths=kv_len is not None,
        has_segment_ids=q_seg is not None,
        has_q_offset=q_off is not None,
        value_head_dim=None if hv == h else hv,
        has_sinks=sinks_c is not None,
        dropout_rate=rate,
        config=_config.resolve(config),
    )
    masks = MaskInputs(bias_c, mask_c, q_len, kv_len, q_seg, kv_seg, q_off, sinks_c, seed)
    return Canonical(
        spec=spec,
        q=q.reshape(b, t, n, h),
        k=k.reshape(b, s, kh, h),
        v=v.reshape(b, s, kh, hv),
        masks=masks,
        batch_shape=batch_shape,
    )


def restore(c: Canonical, out, lse: Any):
    """Back to the caller's layout: out [*batch, T, N, Hv], lse [*batch, T, N]."""
    spec = c.spec
    out = out.reshape(*c.batch_shape, spec.q_len, spec.num_heads, spec.v_head_dim)
    lse = jnp.swapaxes(lse, 1, 2).reshape(*c.batch_shape, spec.q_len, spec.num_heads)
    return out, lse
