"""Bad input, argument by argument: every argument of `jax_flash.attention` with a wrong rank,
shape, dtype or range raises the right exception at trace time, naming the argument — for
every implementation; and the compiled FFI handlers, called directly with operands and
attributes that bypass the Python checks, return an error instead of aborting or computing
garbage."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash

B, T, S, N, K, H = 2, 8, 10, 4, 2, 32


def _inputs(impl):
    dt = jnp.bfloat16 if impl == "cuda" else jnp.float32
    return jnp.ones((B, T, N, H), dt), jnp.ones((B, S, K, H), dt), jnp.ones((B, S, K, H), dt)


def _ints(*shape, dtype=jnp.int32):
    return jnp.zeros(shape, dtype)


# (row id, argument, change, exception, regex): `change(q, k, v)` -> (args, kwargs) of one
# call that is valid except for that argument; the regex must name the argument.
def _with(**kw):
    return lambda q, k, v: ((q, k, v), kw)


ROWS = [
    ("query_rank2", "query", lambda q, k, v: ((q[0, 0], k, v), {}), ValueError, r"query must have rank >= 3"),
    ("query_int", "query", lambda q, k, v: ((q.astype(jnp.int32), k, v), {}), TypeError, r"query must be float16"),
    ("query_none", "query", lambda q, k, v: ((None, k, v), {}), TypeError, r"query must be an array, got None"),
    ("query_string", "query", lambda q, k, v: (("q", k, v), {}), TypeError, r"query must be an array"),
    (
        "query_head_dim",
        "query",
        lambda q, k, v: ((q[..., :16], k, v), {}),
        ValueError,
        r"query and key must have the same head dim",
    ),
    (
        "query_heads",
        "query",
        lambda q, k, v: ((q[:, :, :3], k, v), {}),
        ValueError,
        r"query heads N=3 must be a multiple",
    ),
    (
        "query_batch",
        "query",
        lambda q, k, v: ((q[:1], k, v), {}),
        ValueError,
        r"query and key must have the same leading batch",
    ),
    (
        "query_head_dim_0",
        "query",
        lambda q, k, v: ((q[..., :0], k[..., :0], v[..., :0]), {}),
        ValueError,
        r"query and key must have a head dim H >= 1",
    ),
    ("query_too_long", "query", None, ValueError, r"query has T = 1073741824 positions"),
    ("key_rank2", "key", lambda q, k, v: ((q, k[0, 0], v), {}), ValueError, r"key must have rank >= 3"),
    (
        "key_dtype",
        "key",
        lambda q, k, v: ((q, k.astype(jnp.float16), v), {}),
        TypeError,
        r"query, key and value must share one dtype",
    ),
    (
        "key_no_heads",
        "key",
        lambda q, k, v: ((q, k[:, :, :0], v[:, :, :0]), {}),
        ValueError,
        r"key and value must have at least one head",
    ),
    ("key_too_long", "key", None, ValueError, r"key has S = 1073741824 positions"),
    (
        "value_shape",
        "value",
        lambda q, k, v: ((q, k, v[:, :4]), {}),
        ValueError,
        r"key \[\*B, S, K, H\] and value \[\*B, S, K, Hv\] must have the same shape except the last",
    ),
    (
        "value_kv_heads",
        "value",
        lambda q, k, v: ((q, k, v[:, :, :1]), {}),
        ValueError,
        r"must have the same shape except the last \(head\) dim, got key \(2, 10, 2, 32\) and value \(2, 10, 1, 32\)",
    ),
    (
        "value_batch",
        "value",
        lambda q, k, v: ((q, k, v[:1]), {}),
        ValueError,
        r"key \[\*B, S, K, H\] and value \[\*B, S, K, Hv\] must have the same shape except",
    ),
    (
        "value_rank",
        "value",
        lambda q, k, v: ((q, k, v[None]), {}),
        ValueError,
        r"and value \[\*B, S, K, Hv\] must have the same shape except",
    ),
    (
        "value_head_dim_0",
        "value",
        lambda q, k, v: ((q, k, v[..., :0]), {}),
        ValueError,
        r"value must have a head dim Hv >= 1",
    ),
    (
        "value_dtype",
        "value",
        lambda q, k, v: ((q, k, v.astype(jnp.float16)), {}),
        TypeError,
        r"query, key and value must share one dtype",
    ),
    ("value_none", "value", lambda q, k, v: ((q, k, None), {}), TypeError, r"value must be an array, got None"),
    ("bias_shape", "bias", _with(bias=jnp.zeros((T, S + 1))), ValueError, r"bias must be broadcastable"),
    ("bias_rank", "bias", _with(bias=jnp.zeros((3, B, N, T, S))), ValueError, r"bias must be broadcastable"),
    ("bias_int", "bias", _with(bias=_ints(T, S)), TypeError, r"bias must be a floating-point array"),
    ("bias_bool", "bias", _with(bias=jnp.zeros((T, S), bool)), TypeError, r"bias must be a floating-point array"),
    ("mask_float", "mask", _with(mask=jnp.ones((T, S))), TypeError, r"mask must be a boolean array"),
    ("mask_shape", "mask", _with(mask=jnp.ones((3, T, S), bool)), ValueError, r"mask must be broadcastable"),
    ("scale_array", "scale", _with(scale=jnp.float32(2.0)), TypeError, r"scale must be a Python float"),
    ("scale_bool", "scale", _with(scale=True), TypeError, r"scale must be a Python float"),
    ("scale_inf", "scale", _with(scale=math.inf), ValueError, r"scale must be finite"),
    ("scale_nan", "scale", _with(scale=math.nan), ValueError, r"scale must be finite"),
    ("is_causal_int", "is_causal", _with(is_causal=1), TypeError, r"is_causal must be a Python bool"),
    ("is_causal_array", "is_causal", _with(is_causal=jnp.bool_(True)), TypeError, r"is_causal must be a Python bool"),
    (
        "q_lengths_shape",
        "query_seq_lengths",
        _with(query_seq_lengths=_ints(3)),
        ValueError,
        r"query_seq_lengths must have shape \(2,\)",
    ),
    (
        "q_lengths_float",
        "query_seq_lengths",
        _with(query_seq_lengths=jnp.ones((B,))),
        TypeError,
        r"query_seq_lengths must be an integer array",
    ),
    (
        "kv_lengths_rank",
        "key_value_seq_lengths",
        _with(key_value_seq_lengths=_ints(B, 1)),
        ValueError,
        r"key_value_seq_lengths must have shape",
    ),
    (
        "kv_lengths_bool",
        "key_value_seq_lengths",
        _with(key_value_seq_lengths=jnp.ones((B,), bool)),
        TypeError,
        r"key_value_seq_lengths must be an integer array",
    ),
    (
        "window_negative",
        "local_window_size",
        _with(local_window_size=(-1, 2)),
        ValueError,
        r"local_window_size must be non-negative",
    ),
    (
        "window_negative_int",
        "local_window_size",
        _with(local_window_size=-(2**70)),
        ValueError,
        r"local_window_size must be non-negative",
    ),
    (
        "window_triple",
        "local_window_size",
        _with(local_window_size=(1, 2, 3)),
        ValueError,
        r"local_window_size must be an int",
    ),
    (
        "window_float",
        "local_window_size",
        _with(local_window_size=(1.5, 2)),
        ValueError,
        r"local_window_size must be an int",
    ),
    (
        "window_bool",
        "local_window_size",
        _with(local_window_size=True),
        ValueError,
        r"local_window_size must be an int",
    ),
    (
        "window_array",
        "local_window_size",
        _with(local_window_size=jnp.int32(3)),
        ValueError,
        r"local_window_size must be an int",
    ),
    (
        "segments_single_cross",
        "segment_ids",
        _with(segment_ids=_ints(B, T)),
        ValueError,
        r"single segment_ids array needs self-attention",
    ),
    (
        "segments_kv_shape",
        "segment_ids",
        _with(segment_ids=(_ints(B, T), _ints(B, S + 1))),
        ValueError,
        r"segment_ids \(key/value\) must have shape",
    ),
    (
        "segments_float",
        "segment_ids",
        _with(segment_ids=(jnp.ones((B, T)), _ints(B, S))),
        TypeError,
        r"segment_ids \(query\) must be an integer",
    ),
    (
        "segments_triple",
        "segment_ids",
        _with(segment_ids=(_ints(B, T),) * 3),
        ValueError,
        r"segment_ids must be an array .* or a pair",
    ),
    (
        "segments_int64_range",
        "segment_ids",
        _with(segment_ids=(np.full((B, T), 2**32, np.int64), np.zeros((B, S), np.int64))),
        ValueError,
        r"segment_ids \(query\) must fit in int32",
    ),
    (
        "cap_zero",
        "logits_soft_cap",
        _with(logits_soft_cap=0.0),
        ValueError,
        r"logits_soft_cap must be a positive float32 normal",
    ),
    (
        "cap_negative",
        "logits_soft_cap",
        _with(logits_soft_cap=-2.0),
        ValueError,
        r"logits_soft_cap must be a positive float32 normal",
    ),
    (
        "cap_subnormal",
        "logits_soft_cap",
        _with(logits_soft_cap=1e-46),
        ValueError,
        r"logits_soft_cap must be a positive float32 normal",
    ),
    (
        "cap_too_large",
        "logits_soft_cap",
        _with(logits_soft_cap=1e31),
        ValueError,
        r"logits_soft_cap must be a positive float32 normal",
    ),
    (
        "cap_inf",
        "logits_soft_cap",
        _with(logits_soft_cap=math.inf),
        ValueError,
        r"logits_soft_cap must be a positive float32 normal",
    ),
    (
        "cap_nan",
        "logits_soft_cap",
        _with(logits_soft_cap=math.nan),
        ValueError,
        r"logits_soft_cap must be a positive float32 normal",
    ),
    ("cap_string", "logits_soft_cap", _with(logits_soft_cap="1"), TypeError, r"logits_soft_cap must be a Python float"),
    ("cap_bool", "logits_soft_cap", _with(logits_soft_cap=True), TypeError, r"logits_soft_cap must be a Python float"),
    (
        "offset_float",
        "query_offset",
        _with(query_offset=1.5),
        TypeError,
        r"query_offset must be an int or an integer array",
    ),
    (
        "offset_bool",
        "query_offset",
        _with(query_offset=True),
        TypeError,
        r"query_offset must be an int or an integer array",
    ),
    (
        "offset_shape",
        "query_offset",
        _with(query_offset=_ints(3)),
        ValueError,
        r"query_offset must be an int or an integer array broadcastable",
    ),
    ("offset_range", "query_offset", _with(query_offset=-(2**31) - 1), ValueError, r"query_offset must fit in int32"),
    (
        "offset_int64_range",
        "query_offset",
        _with(query_offset=np.asarray([0, 2**40])),
        ValueError,
        r"query_offset must fit in int32",
    ),
    (
        "return_residual_int",
        "return_residual",
        _with(return_residual=1),
        TypeError,
        r"return_residual must be a Python bool",
    ),
    (
        "implementation_name",
        "implementation",
        _with(implementation="triton"),
        ValueError,
        r"implementation must be None or one of",
    ),
    (
        "implementation_type",
        "implementation",
        _with(implementation=3),
        ValueError,
        r"implementation must be None or one of",
    ),
]


def _too_long(name):
    """Abstract inputs with 2**30 positions (nothing is allocated: traced only)."""
    big = (B, 2**30, K, H)
    if name == "query_too_long":
        return jax.ShapeDtypeStruct((B, 2**30, N, H), jnp.float32), jax.ShapeDtypeStruct((B, S, K, H), jnp.float32)
    return jax.ShapeDtypeStruct((B, T, N, H), jnp.float32), jax.ShapeDtypeStruct(big, jnp.float32)


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_bad_argument(impl, row):
    """One row per bad argument: its exception type and a message naming it, at trace time,
    whichever implementation is requested (and with none)."""
    name, argument, change, exc, match = row
    assert argument in match.replace("\\", "") or argument in ("query", "key", "value")
    for requested in (impl, None):
        if change is None:  # shapes too large to allocate: traced on abstract inputs
            q, k = _too_long(name)
            with pytest.raises(exc, match=match):
                jax.jit(lambda q, k, requested=requested: jax_flash.attention(q, k, k, implementation=requested)).trace(
                    q, k
                )
            continue
        args, kwargs = change(*_inputs(impl))
        kwargs = {"implementation": requested, **kwargs}
        arrays = [a for a in args if isinstance(a, jax.Array)]
        with pytest.raises(exc, match=match):
            # Traced: the error comes before anything runs.
            def call(*arrays, args=args, kwargs=kwargs):
                it = iter(arrays)
                full = [next(it) if isinstance(a, jax.Array) else a for a in args]
                return jax_flash.attention(*full, **kwargs)

            jax.jit(call).trace(*arrays)
        with pytest.raises(exc, match=match):
            jax_flash.explain(*args, **kwargs)


# Traced 64-bit (and uint32) integer mask arguments under jax_enable_x64 (tests/conftest.py
# turns it on): their values cannot be checked at trace time and a cast to int32 could wrap
# (segment ids 0 and 2**32 would match): a TypeError that says int32 is needed. Lengths are
# clipped to [0, T] / [0, S] before their cast, which is exact for any value: accepted.
TRACED_INT_ROWS = [
    (
        "segment_ids_query",
        lambda x: dict(segment_ids=(x[:, :T], x.astype(jnp.int32))),
        r"segment_ids \(query\) must be an int32 array when traced",
    ),
    (
        "segment_ids_kv",
        lambda x: dict(segment_ids=(x[:, :T].astype(jnp.int32), x)),
        r"segment_ids \(key/value\) must be an int32 array when traced",
    ),
    ("query_offset", lambda x: dict(query_offset=x[:, 0]), r"query_offset must be an int32 array when traced"),
]


@pytest.mark.parametrize("dtype", ["int64", "uint32"])
@pytest.mark.parametrize("row", TRACED_INT_ROWS, ids=[r[0] for r in TRACED_INT_ROWS])
def test_traced_wide_mask_ints(row, dtype):
    _name, kwargs, match = row
    q, k, v = _inputs("xla")
    ids = jnp.zeros((B, S), dtype)
    assert ids.dtype == jnp.dtype(dtype)  # x64 is on: a real 64-bit array
    for impl in (None, "xla", "cpu"):
        f = lambda ids, impl=impl: jax_flash.attention(q, k, v, implementation=impl, **kwargs(ids))
        with pytest.raises(TypeError, match=match):
            jax.jit(f).trace(ids)
        jax.jit(f).trace(ids.astype(jnp.int32))  # int32: fine
    # Concrete 64-bit values are checked instead (in range: accepted; test_bad_argument has
    # the out-of-range rows).
    concrete = kwargs(ids)
    jax.jit(lambda: jax_flash.attention(q, k, v, implementation="xla", **concrete)).trace()


def test_traced_wide_lengths_are_exact():
    q, k, v = _inputs("xla")
    f = jax.jit(lambda n: jax_flash.attention(q, k, v, key_value_seq_lengths=n, implementation="xla"))
    huge = f(jnp.asarray([2**40, 2**33 + 3], jnp.int64))  # would wrap to 0 and 3 if cast
    np.testing.assert_array_equal(np.asarray(huge), np.asarray(f(jnp.asarray([S, S], jnp.int64))))


# Requested implementations that cannot serve a valid call: ValueError naming the
# implementation and the limit (never another implementation silently).
IMPL_ROWS = {
    "cuda": [
        (dict(dtype=jnp.float32), r"supports dtypes float16, bfloat16, got float32"),
        (dict(h=48), r"has kernels for head dims \(32, 64, 96, 128, 192, 256\), got 48"),
        (dict(hv=16), r"has kernels for \(H, Hv\) pairs .*\(32, 32\).*, got H = 32, Hv = 16"),
    ],
    "cpu": [
        (dict(dtype=jnp.float64), r"supports dtypes float32, bfloat16, float16, got float64"),
        (dict(h=520), r"supports head dims up to 512, got 520"),
        (dict(hv=520), r"supports value head dims up to 512, got 520"),
    ],
    "pallas": [
        (dict(dtype=jnp.float64), r"supports dtypes .*got float64"),
        (dict(h=264), r"supports head dims up to 256, got 264"),
        (dict(hv=264), r"supports value head dims up to 256, got 264"),
    ],
    "xla": [],
}


def test_implementation_limits(impl):
    for change, match in IMPL_ROWS[impl]:
        dt = change.get("dtype", jnp.bfloat16 if impl == "cuda" else jnp.float32)
        h = change.get("h", H)
        q = jax.ShapeDtypeStruct((B, T, N, h), dt)
        kv = jax.ShapeDtypeStruct((B, S, K, h), dt)
        v = jax.ShapeDtypeStruct((B, S, K, change.get("hv", h)), dt)
        kw = {}
        if change.get("bias"):
            kw["bias"] = jnp.zeros((T, S), jnp.float32)
        if change.get("mask"):
            kw["mask"] = jnp.ones((T, S), bool)
        with pytest.raises(ValueError, match=f'implementation="{impl}" cannot run this call: {match}'):
            jax.jit(lambda q, kv, v, impl=impl, kw=kw: jax_flash.attention(q, kv, v, implementation=impl, **kw)).trace(
                q, kv, v
            )


# ---------------------------------------------------------------- the compiled FFI handlers

# Run in a subprocess so that a handler that aborts fails this test instead of killing the
# suite. Each case calls a target directly through jax.ffi.ffi_call and prints one JSON line.
_HANDLER_SCRIPT = textwrap.dedent(
    r"""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_enable_x64", True)
    from jax_flash import _ffi
    _ffi.targets()
    B, T, S, N, K, H = 1, 8, 8, 2, 2, 32
    F32, I32 = jnp.float32, jnp.int32
    SDS = jax.ShapeDtypeStruct

    def operands(dt, B=B, T=T, S=S, N=N, K=K, H=H, Hv=None):
        Hv = H if Hv is None else Hv
        return [jnp.ones((B, T, N, H), dt), jnp.ones((B, S, K, H), dt), jnp.ones((B, S, K, Hv), dt),
                jnp.full((B,), T, I32), jnp.full((B,), S, I32), jnp.zeros((B, T), I32),
                jnp.zeros((B, S), I32), jnp.zeros((B,), I32),
                jnp.zeros((0,), F32), jnp.zeros((0,), jnp.bool_),  # bias, mask: [0] = none
                *NO_BLOCKS]  # block_states, block_slots, block_bits: [0] = no block mask

    NO_BLOCKS = [jnp.zeros((0,), jnp.int8), jnp.zeros((0,), I32), jnp.zeros((0,), jnp.uint32)]

    def blocks(states=(1, 1, 4, 1), slots=None, bits=(2, 2, 1), states_dt=jnp.int8):
        # A block mask of 2 x 8 blocks over T = S = 8: [Bm, Nm, nq = 4, nk = 1] states and slots,
        # bits for 2 partly visible blocks.
        return [jnp.ones(states, states_dt), jnp.zeros(states if slots is None else slots, I32),
                jnp.full(bits, 0xFF, jnp.uint32)]

    BLOCK_ATTRS = dict(block_q=np.int64(2), block_k=np.int64(8))

    ATTRS = dict(scale=np.float32(0.1), window_left=np.int64(-1), window_right=np.int64(-1),
                 softcap=np.float32(0), use_segment_ids=False, dropout_rate=np.float32(0), poison_outputs=True,
                 block_q=np.int64(0), block_k=np.int64(0))

    def own(target, backward=False):
        # Each target's own attributes (cuda/README.md): the CUDA targets' layout and
        # plain_kernel (and the forward's decode_tile); the cpu
        # targets' isa ("": the default ISA of this CPU) and forward_chunks and pack_gqa, or
        # gradient_chunks (0: the rule).
        if "emu" in target:
            return {"layout": "warp16", "plain_kernel": False} if backward else {"layout": "warp16", "plain_kernel": False, "decode_tile": False}
        if backward:
            return {"isa": "", "gradient_chunks": np.int64(0)}
        return {"isa": "", "forward_chunks": np.int64(1), "pack_gqa": False}

    SEED = jnp.zeros((2,), jnp.uint32)  # the dropout key's words: every target's last operand

    def fwd(target, ops, outs=None, sinks=None, seed=SEED, partials=None, route=None, **attrs):
        q = ops[0]
        if outs is None:
            outs = (SDS(q.shape[:3] + ops[2].shape[3:], q.dtype), SDS((q.shape[0], q.shape[2], q.shape[1]), F32))
        if "emu" in target:
            # The CUDA targets' split-KV workspaces partial_out, partial_lse ([0] f32: no split)
            # and the pack_gqa attribute; the cpu target has neither.
            if len(outs) == 2:
                outs += (SDS((0,), F32),) * 2 if partials is None else partials
            attrs = {"pack_gqa": False, **attrs}
        attrs = {**own(target), **attrs}
        if sinks is None:  # the forward's last operand: sinks [N] f32, -inf = none
            sinks = jnp.full((q.shape[2] if q.ndim == 4 else 1,), -jnp.inf, F32)
        # The CUDA targets' own last operand: route ([0] s32: not routed).
        routes = (jnp.zeros((0,), I32) if route is None else route,) if "emu" in target else ()
        return jax.ffi.ffi_call(target, outs)(*ops, sinks, seed, *routes, **{**ATTRS, **attrs})

    def route_of(target):
        # The CUDA targets' route operand, unrouted; the cpu targets have none.
        return (jnp.zeros((0,), I32),) if "emu" in target else ()

    def dkv(target, shape=(0,), dbias_accum=(0,)):
        # The CUDA targets' dk_accum, dv_accum results: [B, S, N, H] f32 (the q_heads grid)
        # or [0] f32 (kv_heads), and dbias_accum ([B, N, Tb, S] f32 in deterministic mode for a
        # bias broadcast over B, N or S, else [0]); the cpu target has none.
        return (SDS(shape, F32),) * 2 + (SDS(dbias_accum, F32),) if "emu" in target else ()

    def bwd(target, ops, outs=None, workspaces=None, dbias=SDS((0,), F32), route=None, **attrs):
        q, k, v = ops[0], ops[1], ops[2]
        b, t, n, h = q.shape
        if outs is None:
            outs = (SDS(q.shape, q.dtype), SDS(k.shape, k.dtype), SDS(v.shape, v.dtype),
                    SDS(q.shape, F32), SDS((b, n, t), F32))
        if len(outs) == 5:  # then the CUDA targets' workspaces, then dbias (every target's last)
            outs += (dkv(target) if workspaces is None else workspaces) + (dbias,)
        # The CUDA targets' own last operand: route ([0] s32: not routed).
        routes = (jnp.zeros((0,), I32) if route is None else route,) if "emu" in target else ()
        return jax.ffi.ffi_call(target, outs)(*ops, SEED, *routes, **{**ATTRS, **own(target, True),
                                                                      "deterministic": False, **attrs})

    def bwd_operands(dt, **kw):
        o = operands(dt, **kw)
        q = o[0]
        b, t, n, h = q.shape
        out = jnp.ones((b, t, n, o[2].shape[3]), q.dtype)  # [B, T, N, Hv]
        return o[:3] + [out, out, jnp.zeros((b, n, t), F32), jnp.zeros((b, n, t), F32)] + o[3:]

    def cases(prefix, dt):
        other = jnp.float16 if dt == jnp.bfloat16 else jnp.bfloat16
        f, b = prefix + "_fwd", prefix + "_bwd"
        o, bo = operands(dt), bwd_operands(dt)
        lse_shape = SDS((B, N, T), F32)
        hv_expect = None if prefix == "jax_flash" else "value head dim"
        return {
            "ok": (None, lambda: fwd(f, o)),
            "ok_backward": (None, lambda: bwd(b, bo)),
            "ok_empty_batch": (None, lambda: fwd(f, operands(dt, B=0))),
            "ok_no_keys": (None, lambda: fwd(f, operands(dt, S=0))),
            # The value head dim Hv != H: served by the cpu kernels, refused by the cuda ones.
            "value_head_dim": (hv_expect, lambda: fwd(f, operands(dt, Hv=16))),
            "value_head_dim_backward": (hv_expect, lambda: bwd(b, bwd_operands(dt, Hv=48))),
            "value_head_dim_0": ("value head dim", lambda: fwd(f, operands(dt, Hv=0))),
            "out_value_head_dim": (hv_expect or "out", lambda: fwd(f, operands(dt, Hv=16), outs=(SDS((B, T, N, H), dt), lse_shape))),
            "dv_value_head_dim": (hv_expect or "dv", lambda: bwd(b, bwd_operands(dt, Hv=16), outs=(SDS((B, T, N, H), dt), SDS((B, S, K, H), dt), SDS((B, S, K, H), dt), SDS((B, T, N, H), F32), lse_shape))),
            "q_rank3": ("q", lambda: fwd(f, [o[0][0]] + o[1:])),
            "q_int32": ("q", lambda: fwd(f, [o[0].astype(I32)] + o[1:])),
            "q_float64": ("q", lambda: fwd(f, [o[0].astype(jnp.float64)] + o[1:])),
            "k_rank5": ("k", lambda: fwd(f, [o[0], o[1][None]] + o[2:])),
            "v_shape": ("v", lambda: fwd(f, o[:2] + [o[2][:, :4]] + o[3:])),
            "v_dtype": ("v", lambda: fwd(f, o[:2] + [o[2].astype(other)] + o[3:])),
            "q_lengths_shape": ("q_lengths", lambda: fwd(f, o[:3] + [jnp.zeros((3,), I32)] + o[4:])),
            "kv_lengths_int64": ("kv_lengths", lambda: fwd(f, o[:4] + [jnp.zeros((B,), jnp.int64)] + o[5:])),
            "q_segments_shape": ("q_segment_ids", lambda: fwd(f, o[:5] + [jnp.zeros((B, 3), I32)] + o[6:])),
            "kv_segments_dtype": ("kv_segment_ids", lambda: fwd(f, o[:6] + [jnp.zeros((B, S), F32)] + o[7:])),
            "q_offset_shape": ("q_offset", lambda: fwd(f, o[:7] + [jnp.zeros((B, 2), I32)] + o[8:])),
            # The dense bias [B|1, N|1, T|1, S|1] and mask (bool), [0] when absent.
            "bias_rank3": ("bias", lambda: fwd(f, o[:8] + [jnp.zeros((N, T, S), F32)] + o[9:])),
            "bias_wrong_dim": ("bias", lambda: fwd(f, o[:8] + [jnp.zeros((1, N, T, S + 1), F32)] + o[9:])),
            "bias_int32": ("bias", lambda: fwd(f, o[:8] + [jnp.zeros((1, N, T, S), I32)] + o[9:])),
            "mask_float32": ("mask", lambda: fwd(f, o[:9] + [jnp.zeros((1, 1, T, S), F32)] + o[10:])),
            "mask_wrong_dim": ("mask", lambda: fwd(f, o[:9] + [jnp.ones((2, 1, T, S), jnp.bool_)] + o[10:])),
            # A block mask (flex_attention's): served by every target, its operands' shapes and
            # dtypes checked against T, S and block_q, block_k.
            "ok_block_mask": (None, lambda: fwd(f, o[:10] + blocks(), **BLOCK_ATTRS)),
            "ok_block_mask_backward": (None, lambda: bwd(b, bo[:14] + blocks(states=(B, N, 4, 1)), **BLOCK_ATTRS)),
            "block_q_without_operands": ("block_q", lambda: fwd(f, o, **BLOCK_ATTRS)),
            "block_states_nq": ("block_states", lambda: fwd(f, o[:10] + blocks(states=(1, 1, 3, 1)), **BLOCK_ATTRS)),
            "block_states_int32": ("block_states", lambda: fwd(f, o[:10] + blocks(states_dt=I32), **BLOCK_ATTRS)),
            "block_slots_shape": ("block_slots", lambda: fwd(f, o[:10] + blocks(slots=(1, 2, 4, 1)), **BLOCK_ATTRS)),
            "block_bits_words": ("block_bits", lambda: fwd(f, o[:10] + blocks(bits=(2, 2, 2)), **BLOCK_ATTRS)),
            "block_q_negative": ("block_q", lambda: fwd(f, o[:10] + blocks(), block_q=np.int64(-2), block_k=np.int64(8))),
            "dbias_without_bias": ("dbias", lambda: bwd(b, bo, dbias=SDS((1, N, T, S), F32))),
            "sinks_shape": ("sinks", lambda: fwd(f, o, sinks=jnp.zeros((N + 1,), F32))),
            "sinks_float16": ("sinks", lambda: fwd(f, o, sinks=jnp.zeros((N,), jnp.float16))),
            "dropout_seed_shape": ("dropout_seed", lambda: fwd(f, o, seed=jnp.zeros((3,), jnp.uint32))),
            "dropout_seed_int32": ("dropout_seed", lambda: fwd(f, o, seed=jnp.zeros((2,), I32))),
            "dropout_rate_1": ("dropout_rate", lambda: fwd(f, o, dropout_rate=np.float32(1))),
            **({
                "route_shape": ("route", lambda: fwd(f, o, route=jnp.zeros((2,), I32))),
                "route_uint32": ("route", lambda: fwd(f, o, route=jnp.zeros((1,), jnp.uint32))),
                "route_with_bias": ("dense bias", lambda: fwd(f, o[:8] + [jnp.zeros((1, N, T, S), F32)] + o[9:], route=jnp.ones((1,), I32))),
                "ok_routed": (None, lambda: fwd(f, o, route=jnp.full((1,), 2, I32))),
            } if "emu" in f else {}),
            "kv_heads_0": ("heads", lambda: fwd(f, operands(dt, K=0))),
            "heads_not_multiple": ("heads", lambda: fwd(f, operands(dt, N=3))),
            "head_dim_0": ("head dim", lambda: fwd(f, operands(dt, H=0))),
            "head_dim_0_backward": ("head dim", lambda: bwd(b, bwd_operands(dt, H=0))),
            "out_shape": ("out", lambda: fwd(f, o, outs=(SDS((B, T, N, 16), dt), lse_shape))),
            "lse_dtype": ("lse", lambda: fwd(f, o, outs=(SDS((B, T, N, H), dt), SDS((B, N, T), jnp.float64)))),
            "one_result": ("results", lambda: fwd(f, o, outs=(SDS((B, T, N, H), dt),))),
            "missing_operand": ("arguments", lambda: fwd(f, o[:7])),
            "extra_operand": ("arguments", lambda: fwd(f, o + [o[7]])),
            "scale_nan": ("scale", lambda: fwd(f, o, scale=np.float32(np.nan))),
            "scale_inf": ("scale", lambda: fwd(f, o, scale=np.float32(-np.inf))),
            "scale_f64_attribute": ("F32", lambda: fwd(f, o, scale=np.float64(0.1))),
            "softcap_negative": ("softcap", lambda: fwd(f, o, softcap=np.float32(-1))),
            "softcap_nan": ("softcap", lambda: fwd(f, o, softcap=np.float32(np.nan))),
            "softcap_inf": ("softcap", lambda: fwd(f, o, softcap=np.float32(np.inf))),
            # The value as it reads back (not std::to_string's 0.000000).
            "softcap_subnormal": ("softcap must be 0 (off) or a finite float32 normal > 0, got 9.9999461e-41",
                                  lambda: fwd(f, o, softcap=np.float32(1e-40))),
            "window_below_minus_1": ("window", lambda: fwd(f, o, window_left=np.int64(-5))),
            "window_i32_attribute": ("S64", lambda: fwd(f, o, window_right=np.int32(3))),
            "missing_attribute": ("attributes", lambda: jax.ffi.ffi_call(f, (SDS((B, T, N, H), dt), lse_shape) + (SDS((0,), F32),) * (2 if "emu" in f else 0))(*o, jnp.full((N,), -jnp.inf, F32), SEED, *route_of(f), scale=np.float32(1))),
            "dout_shape": ("dout", lambda: bwd(b, bo[:4] + [bo[4][:, :4]] + bo[5:])),
            "out_dtype_backward": ("out", lambda: bwd(b, bo[:3] + [bo[3].astype(other)] + bo[4:])),
            "lse_dtype_backward": ("lse", lambda: bwd(b, bo[:5] + [bo[5].astype(jnp.float16)] + bo[6:])),
            "dlse_shape": ("dlse", lambda: bwd(b, bo[:6] + [bo[6][:, :1]] + bo[7:])),
            "dq_accum_dtype": ("dq_accum", lambda: bwd(b, bo, outs=(SDS((B, T, N, H), dt), SDS((B, S, K, H), dt), SDS((B, S, K, H), dt), SDS((B, T, N, H), other), lse_shape))),
            "delta_shape": ("delta", lambda: bwd(b, bo, outs=(SDS((B, T, N, H), dt), SDS((B, S, K, H), dt), SDS((B, S, K, H), dt), SDS((B, T, N, H), F32), SDS((B, N, T + 1), F32)))),
            "four_results": ("results", lambda: bwd(b, bo, outs=(SDS((B, T, N, H), dt),) * 3 + (SDS((B, T, N, H), F32),))),
            "missing_deterministic": ("attributes", lambda: jax.ffi.ffi_call(b, (SDS((B, T, N, H), dt), SDS((B, S, K, H), dt), SDS((B, S, K, H), dt), SDS((B, T, N, H), F32), lse_shape) + dkv(b) + (SDS((0,), F32),))(*bo, SEED, *route_of(b), **ATTRS, **own(b, True))),
            "no_dbias": ("results", lambda: jax.ffi.ffi_call(b, (SDS((B, T, N, H), dt), SDS((B, S, K, H), dt), SDS((B, S, K, H), dt), SDS((B, T, N, H), F32), lse_shape) + dkv(b))(*bo, SEED, *route_of(b), **ATTRS, **own(b, True), deterministic=False)),
            # Every kernel reads a bias [B|1, N|1, T|1, S|1] and a mask in place.
            "ok_bias_mask": (None, lambda: fwd(f, o[:8] + [jnp.zeros((1, N, 1, S), jnp.bfloat16), jnp.ones((B, 1, T, 1), jnp.bool_)] + o[10:])),
            "ok_bias_backward": (None, lambda: bwd(b, bo[:12] + [jnp.zeros((B, 1, T, S), F32)] + bo[13:], dbias=SDS((B, 1, T, S), F32))),
            "dbias_shape": ("dbias", lambda: bwd(b, bo[:12] + [jnp.zeros((B, 1, T, S), F32)] + bo[13:], dbias=SDS((B, N, T, S), F32))),
            "bias_float64": ("bias", lambda: fwd(f, o[:8] + [jnp.zeros((1, N, T, S), jnp.float64)] + o[9:])),
            **({} if "emu" in prefix else {
                # The cpu targets' own attributes (decided when a call is traced).
                "isa_unknown": ("isa=sse9 is not one of", lambda: fwd(f, o, isa="sse9")),
                "isa_unknown_backward": ("isa=sse9 is not one of", lambda: bwd(b, bo, isa="sse9")),
                "forward_chunks_0": ("forward_chunks", lambda: fwd(f, o, forward_chunks=np.int64(0))),
                "ok_forward_chunks_beyond_keys": (None, lambda: fwd(f, o, forward_chunks=np.int64(1000))),
                "cpu_pack_gqa_long_query": ("pack_gqa needs T = 1", lambda: fwd(f, o, pack_gqa=True)),
                "cpu_ok_pack_gqa": (None, lambda: fwd(f, operands(dt, T=1, K=1), pack_gqa=True)),
                "cpu_pack_gqa_mask": ("a mask", lambda: fwd(f, operands(dt, T=1, K=1)[:9] + [jnp.ones((1, 1, 1, S), jnp.bool_)] + o[10:], pack_gqa=True)),
                "gradient_chunks_5": ("gradient_chunks", lambda: bwd(b, bo, gradient_chunks=np.int64(5))),
                "isa_int_attribute": ("expected string", lambda: fwd(f, o, isa=np.int64(1))),
            }),
            **({} if "emu" not in prefix else {
                "layout_unknown": ("layout=warp64 is not a layout", lambda: fwd(f, o, layout="warp64")),
                "layout_unknown_backward": ("layout=warp64 is not a layout", lambda: bwd(b, bo, layout="warp64")),
                "ok_layout_warp32": (None, lambda: fwd(f, o, layout="warp32")),
                # The plain forward kernel (kernels/fwd.h) is asked for by the caller; a call
                # with an optional feature is refused by name.
                "ok_plain_kernel": (None, lambda: fwd(f, o, plain_kernel=True)),
                "plain_kernel_bias": ("plain_kernel=true needs a call without optional features; this one has a dense bias", lambda: fwd(f, o[:8] + [jnp.zeros((1, N, T, S), F32)] + o[9:], plain_kernel=True)),
                "plain_kernel_pack_gqa": ("this one has GQA packing", lambda: fwd(f, operands(dt, T=1, K=1), pack_gqa=True, plain_kernel=True)),
                # Its softmax takes the scale inside the exponent: positive and normal only.
                "plain_kernel_scale_negative": ("this one has a scale outside [2^-126, 2^127)", lambda: fwd(f, o, scale=np.float32(-0.5), plain_kernel=True)),
                "plain_kernel_scale_0": ("a scale outside", lambda: fwd(f, o, scale=np.float32(0), plain_kernel=True)),
                "plain_kernel_scale_subnormal": ("a scale outside", lambda: fwd(f, o, scale=np.float32(1e-40), plain_kernel=True)),
                "plain_kernel_scale_huge": ("a scale outside", lambda: fwd(f, o, scale=np.float32(3e38), plain_kernel=True)),
                "ok_plain_kernel_scale_large": (None, lambda: fwd(f, o, scale=np.float32(1e38), plain_kernel=True)),
                # The decoding tile (kernels/tile.h): at most 16 query rows per tile, T or the
                # packed G; never with the plain kernel.
                "ok_decode_tile": (None, lambda: fwd(f, o, decode_tile=True)),
                "ok_decode_tile_pack_gqa": (None, lambda: fwd(f, operands(dt, T=1, K=1), pack_gqa=True, decode_tile=True)),
                "ok_decode_tile_16_queries": (None, lambda: fwd(f, operands(dt, T=16), decode_tile=True)),
                "decode_tile_17_queries": ("decode_tile=true needs at most 16 query rows per tile (T, or G with pack_gqa) and no plain_kernel; this call has T > 16 queries", lambda: fwd(f, operands(dt, T=17), decode_tile=True)),
                "decode_tile_group_17": ("pack_gqa needs T = 1, G = N / K <= 16", lambda: fwd(f, operands(dt, T=1, N=17, K=1), pack_gqa=True, decode_tile=True)),
                "ok_pack_gqa_group_17": (None, lambda: fwd(f, operands(dt, T=1, N=17, K=1), pack_gqa=True)),
                "decode_tile_plain_kernel": ("this call has plain_kernel=true", lambda: fwd(f, o, plain_kernel=True, decode_tile=True)),
                # Deterministic mode: a bias broadcast over N needs the [B, N, Tb, S] workspace.
                "ok_bias_deterministic": (None, lambda: bwd(b, bo[:12] + [jnp.zeros((B, 1, T, S), F32)] + bo[13:], dbias=SDS((B, 1, T, S), F32), workspaces=dkv(b, dbias_accum=(B, N, T, S)), deterministic=True)),
                "dbias_accum_missing": ("dbias_accum", lambda: bwd(b, bo[:12] + [jnp.zeros((B, 1, T, S), F32)] + bo[13:], dbias=SDS((B, 1, T, S), F32), deterministic=True)),
                "dbias_accum_unneeded": ("dbias_accum", lambda: bwd(b, bo[:12] + [jnp.zeros((B, 1, T, S), F32)] + bo[13:], dbias=SDS((B, 1, T, S), F32), workspaces=dkv(b, dbias_accum=(B, N, T, S)))),
                "ok_backward_q_heads": (None, lambda: bwd(b, bo, workspaces=dkv(b, (B, S, N, H)))),
                "dk_accum_shape": ("dk_accum", lambda: bwd(b, bo, workspaces=dkv(b, (B, S, N, H + 1)))),
                "dkv_accum_mixed": ("dk_accum and dv_accum must both be", lambda: bwd(
                    b, bo, workspaces=(SDS((B, S, N, H), F32), SDS((0,), F32), SDS((0,), F32)))),
                "dkv_accum_missing": ("results", lambda: bwd(b, bo, workspaces=dkv(b)[:1])),
                "ok_plain_backward": (None, lambda: bwd(b, bo, plain_kernel=True)),
                "ok_plain_backward_routed": (None, lambda: bwd(b, bo, plain_kernel=True, route=jnp.ones((1,), I32))),
                "ok_plain_backward_scale_0": (None, lambda: bwd(b, bo, plain_kernel=True, scale=np.float32(0))),
                "backward_route_shape": ("route", lambda: bwd(b, bo, route=jnp.zeros((2,), I32))),
                "backward_route_uint32": ("route", lambda: bwd(b, bo, route=jnp.zeros((1,), jnp.uint32))),
                "plain_backward_bias": ("plain_kernel=true needs a backward without per-score features; this one has a dense bias", lambda: bwd(b, bo[:12] + [jnp.zeros((B, 1, T, S), F32)] + bo[13:], dbias=SDS((B, 1, T, S), F32), plain_kernel=True)),
                "plain_backward_soft_cap": ("this one has a soft cap", lambda: bwd(b, bo, plain_kernel=True, softcap=np.float32(5))),
                "plain_backward_deterministic": ("this one has deterministic mode", lambda: bwd(b, bo, plain_kernel=True, deterministic=True)),
                "plain_backward_dropout": ("this one has dropout", lambda: bwd(b, bo, plain_kernel=True, dropout_rate=np.float32(0.5))),
                # Split-KV's workspaces: [C, B, T, N, Hv] and [C, B, N, T] f32, C >= 2 chunks.
                "ok_split_kv": (None, lambda: fwd(f, o, partials=(SDS((3, B, T, N, H), F32), SDS((3, B, N, T), F32)))),
                "partial_out_one_chunk": ("2 <= C", lambda: fwd(f, o, partials=(SDS((1, B, T, N, H), F32), SDS((1, B, N, T), F32)))),
                "partial_lse_shape": ("partial_lse", lambda: fwd(f, o, partials=(SDS((3, B, T, N, H), F32), SDS((3, B, N, T + 1), F32)))),
                "partial_out_dtype": ("partial_out", lambda: fwd(f, o, partials=(SDS((3, B, T, N, H), jnp.float16), SDS((3, B, N, T), F32)))),
                "split_kv_dropout": ("not used with dropout", lambda: fwd(f, o, dropout_rate=np.float32(0.5), partials=(SDS((3, B, T, N, H), F32), SDS((3, B, N, T), F32)))),
                "pack_gqa_long_query": ("pack_gqa needs T = 1", lambda: fwd(f, o, pack_gqa=True)),
                "ok_pack_gqa": (None, lambda: fwd(f, operands(dt, T=1, K=1), pack_gqa=True)),
                # The paged forward: the page table [B, max_pages] s32 first, k and v as pages
                # [num_pages, page_size, K, H] (S = max_pages · page_size: 2 pages of 4 here).
                "ok_paged": (None, lambda: jax.ffi.ffi_call(prefix + "_paged_fwd", (SDS((B, T, N, H), dt), lse_shape, SDS((0,), F32), SDS((0,), F32)))(jnp.zeros((B, 2), I32), o[0], jnp.ones((3, 4, K, H), dt), jnp.ones((3, 4, K, H), dt), *o[3:], jnp.full((N,), -jnp.inf, F32), SEED, *route_of(f), **ATTRS, **own(f), pack_gqa=False)),
                "paged_table_dtype": ("page_table", lambda: jax.ffi.ffi_call(prefix + "_paged_fwd", (SDS((B, T, N, H), dt), lse_shape, SDS((0,), F32), SDS((0,), F32)))(jnp.zeros((B, 2), F32), o[0], jnp.ones((3, 4, K, H), dt), jnp.ones((3, 4, K, H), dt), *o[3:], jnp.full((N,), -jnp.inf, F32), SEED, *route_of(f), **ATTRS, **own(f), pack_gqa=False)),
                "paged_table_batch": ("page_table", lambda: jax.ffi.ffi_call(prefix + "_paged_fwd", (SDS((B, T, N, H), dt), lse_shape, SDS((0,), F32), SDS((0,), F32)))(jnp.zeros((B + 1, 2), I32), o[0], jnp.ones((3, 4, K, H), dt), jnp.ones((3, 4, K, H), dt), *o[3:], jnp.full((N,), -jnp.inf, F32), SEED, *route_of(f), **ATTRS, **own(f), pack_gqa=False)),
                "paged_value_pages": ("v has shape [3, 5, 2, 32], expected [3, 4, 2, 32]", lambda: jax.ffi.ffi_call(prefix + "_paged_fwd", (SDS((B, T, N, H), dt), lse_shape, SDS((0,), F32), SDS((0,), F32)))(jnp.zeros((B, 2), I32), o[0], jnp.ones((3, 4, K, H), dt), jnp.ones((3, 5, K, H), dt), *o[3:], jnp.full((N,), -jnp.inf, F32), SEED, *route_of(f), **ATTRS, **own(f), pack_gqa=False)),
                "pack_gqa_bias": ("a bias", lambda: fwd(f, operands(dt, T=1, K=1)[:8] + [jnp.zeros((1, N, 1, S), F32)] + o[9:], pack_gqa=True)),
            }),
        }

    for prefix, dt in (("jax_flash", jnp.float32), ("jax_flash_emu", jnp.bfloat16)):
        for name, (expect, call) in cases(prefix, dt).items():
            print(json.dumps({"target": prefix, "case": name, "expect": expect, "started": True}), flush=True)
            try:
                jax.block_until_ready(call())
                result = {"error": None}
            except Exception as e:  # what a caller sees: jax's runtime error with the message
                result = {"error": type(e).__name__, "message": str(e)}
            print(json.dumps({"target": prefix, "case": name, "expect": expect, **result}), flush=True)
    """
)


def test_ffi_handlers_return_errors(tmp_path):
    from jax_flash import _ffi

    if _ffi.missing("jax_flash_fwd", "cpu") or _ffi.missing("jax_flash_emu_fwd", "cpu"):
        pytest.skip("the extension's cpu and emulated targets are not built")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {
        **os.environ,
        "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "JAX_PLATFORMS": "cpu",
        "JAX_FLASH_POISON_OUTPUTS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", _HANDLER_SCRIPT], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path
    )
    lines = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")]
    finished = [l for l in lines if "started" not in l]
    if proc.returncode != 0:
        last = lines[-1] if lines else None
        pytest.fail(f"the handler process died (rc {proc.returncode}) at {last}:\n{proc.stderr[-3000:]}")
    started = [l for l in lines if "started" in l]
    assert len(finished) == len(started) > 80, (len(finished), len(started))
    bad = []
    for r in finished:
        expect, err = r["expect"], r["error"]
        if expect is None:
            if err is not None:
                bad.append(f"{r['target']} {r['case']}: should run, raised {err}: {r['message'][:200]}")
        elif err is None:
            bad.append(f"{r['target']} {r['case']}: accepted (expected an error naming {expect!r})")
        elif expect not in r["message"] or "RuntimeError" not in err:
            bad.append(f"{r['target']} {r['case']}: {err}: {r['message'][:200]} (expected {expect!r})")
    assert not bad, "\n".join(bad)
