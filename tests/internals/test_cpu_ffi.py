"""The host FFI targets jax_flash_fwd / jax_flash_bwd (platform cpu), called directly.

These tests hold the C++ handlers to the contract in cuda/README.md without the Python
API in between: operands, attributes and results exactly as documented, against a naive
float64 NumPy reference of the same mask semantics, forward and backward. They also
cover what only the handler can answer for: every compiled ISA, bitwise determinism
across thread counts, errors surfacing as Python exceptions, and the lowered HLO.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_flash
from jax_flash import _jax_flash_ext

for _name, _capsule in _jax_flash_ext.registrations()["cpu"].items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")

NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# Bound on |kernel - float64 reference| / (max |reference| + 1): the kernels compute in
# float32, so 16-bit results are off by about their own rounding.
TOLERANCE = {"float32": 2e-5, "bfloat16": 1.6e-2, "float16": 2e-3}


@dataclasses.dataclass(frozen=True)
class Config:
    b: int = 2
    t: int = 97
    s: int = 130
    n: int = 4
    kh: int = 2
    h: int = 40
    window: tuple = (-1, -1)  # (left, right); -1 unbounded, causal = (-1, 0)
    q_lengths: tuple | None = None
    kv_lengths: tuple | None = None
    segments: bool = False
    softcap: float = 0.0
    offsets: tuple | None = None  # q_offset per batch row (None: zeros)


CONFIGS = {
    "none": Config(),
    "causal": Config(window=(-1, 0)),
    "window": Config(window=(16, 8)),
    "lengths": Config(q_lengths=(97, 60), kv_lengths=(130, 45)),
    "segments": Config(segments=True),
    "softcap_causal": Config(window=(-1, 0), softcap=5.0),
    "all_masked_batch": Config(kv_lengths=(0, 130)),
    "window_past_end": Config(t=130, s=97, window=(0, 0)),  # rows t >= S see nothing
    "huge_window": Config(window=(2**62, 2**62)),  # as unbounded, without overflow
    "tiny_head": Config(b=1, t=9, s=21, n=2, kh=1, h=8, window=(-1, 0)),
    "wide_head": Config(b=1, t=33, s=40, n=2, kh=2, h=256, softcap=2.0),
    "mqa_wide": Config(b=1, t=65, s=200, n=3, kh=1, h=64, window=(40, 3)),
    # Every edge of the AMX products' tiling (tile_gemm_amx.h): 16-row and 16-column tile
    # remainders, 22 rows past the last whole tile, 40 pairs (8 past the last 16-pair step).
    "odd_tiles": Config(b=1, t=150, s=170, n=2, kh=1, h=80, window=(-1, 0)),
    "combo": Config(window=(48, 0), q_lengths=(90, 97), kv_lengths=(120, 77), segments=True, softcap=3.0),
    # q_offset: query t sits at key position q_offset[b] + t for the window.
    "bottom_right": Config(window=(-1, 0), offsets=(130 - 97, 130 - 97)),
    "offset_rows": Config(window=(20, 3), offsets=(-40, 120)),
    "offset_tall": Config(t=130, s=97, window=(-1, 0), offsets=(-33, 200)),
    "offset_extremes": Config(window=(2**31 - 1, 2**62), offsets=(2**31 - 1, -(2**31))),
    "offset_combo": Config(
        window=(48, 0),
        q_lengths=(90, 97),
        kv_lengths=(120, 77),
        segments=True,
        offsets=(40, -7),
    ),
}


# ---- the operands and the targets ------------------------------------------------


def make_inputs(cfg: Config, dtype: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    dt = NP_DTYPES[dtype]
    q = rng.standard_normal((cfg.b, cfg.t, cfg.n, cfg.h)).astype(dt)
    k = rng.standard_normal((cfg.b, cfg.s, cfg.kh, cfg.h)).astype(dt)
    v = rng.standard_normal((cfg.b, cfg.s, cfg.kh, cfg.h)).astype(dt)
    dout = rng.standard_normal((cfg.b, cfg.t, cfg.n, cfg.h)).astype(dt)
    dlse = (0.3 * rng.standard_normal((cfg.b, cfg.n, cfg.t))).astype(np.float32)
    q_len = np.array(cfg.q_lengths or (cfg.t,) * cfg.b, np.int32)
    kv_len = np.array(cfg.kv_lengths or (cfg.s,) * cfg.b, np.int32)
    if cfg.segments:
        # Sorted document ids (packed sequences), with query id 3 absent from the keys of
        # batch 0, so that some rows see nothing.
        q_seg = np.sort(rng.integers(0, 4, (cfg.b, cfg.t)), axis=1).astype(np.int32)
        kv_seg = np.sort(rng.integers(0, 3, (cfg.b, cfg.s)), axis=1).astype(np.int32)
    else:
        q_seg = np.zeros((cfg.b, cfg.t), np.int32)
        kv_seg = np.zeros((cfg.b, cfg.s), np.int32)
    q_off = np.array(cfg.offsets or (0,) * cfg.b, np.int32)
    return dict(
        q=q,
        k=k,
        v=v,
        dout=dout,
        dlse=dlse,
        q_len=q_len,
        kv_len=kv_len,
        q_seg=q_seg,
        kv_seg=kv_seg,
        q_off=q_off,
        seed=np.zeros((2,), np.uint32),
        bias=np.zeros((0,), np.float32),
        mask=np.zeros((0,), np.bool_),
    )


# block_states, block_slots, block_bits: [0] = no block mask.
NO_BLOCK_MASK = (np.zeros((0,), np.int8), np.zeros((0,), np.int32), np.zeros((0,), np.uint32))


def attributes(cfg: Config) -> dict:
    return dict(
        scale=np.float32(1.0 / np.sqrt(cfg.h)),
        window_left=np.int64(cfg.window[0]),
        window_right=np.int64(cfg.window[1]),
        softcap=np.float32(cfg.softcap),
        use_segment_ids=bool(cfg.segments),
        dropout_rate=np.float32(0.0),
        poison_outputs=jax_flash.current_config().get("poison_outputs"),
        block_q=np.int64(0),  # no block mask (flex_attention's: tests/features/test_flex.py)
        block_k=np.int64(0),
    )


# The targets' own attributes, from the settings jax_flash resolves when a call is traced
# (jax_flash.Config: here JAX_FLASH_CPU_ISA, JAX_FLASH_CPU_GRADIENT_CHUNKS), resolved here at
# each call. No split-KV and no GQA packing: what the rule decides for every call of this file
# (S < 512, T > 1).
def _isa() -> str:
    """Config.cpu_isa, refused by name (a ValueError naming JAX_FLASH_CPU_ISA) when unknown or
    when this CPU lacks it, as a traced call refuses it."""
    value = jax_flash.current_config().get("cpu_isa")
    if value:
        _jax_flash_ext.cpu_isa(value)
    return value


def forward_attributes() -> dict:
    return dict(isa=_isa(), forward_chunks=np.int64(1), pack_gqa=False)


def backward_attributes() -> dict:
    return dict(isa=_isa(), gradient_chunks=np.int64(jax_flash.current_config().get("cpu_gradient_chunks")))


def call_forward(x: dict, attrs: dict):
    q, k = x["q"], x["k"]
    b, t, n, _ = q.shape
    shapes = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, n, t), jnp.float32))
    sinks = x.get("sinks", np.full((n,), -np.inf, np.float32))  # -inf: no sink
    return jax.ffi.ffi_call("jax_flash_fwd", shapes)(
        q,
        k,
        x["v"],
        x["q_len"],
        x["kv_len"],
        x["q_seg"],
        x["kv_seg"],
        x["q_off"],
        x["bias"],
        x["mask"],
        *NO_BLOCK_MASK,
        sinks,
        x["seed"],
        **{**forward_attributes(), **attrs},
    )


def call_backward(x: dict, out, lse, attrs: dict):
    q, k = x["q"], x["k"]
    b, t, n, h = q.shape
    shapes = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct((b, t, n, h), jnp.float32),
        jax.ShapeDtypeStruct((b, n, t), jnp.float32),
        jax.ShapeDtypeStruct(x.get("dbias_shape", x["bias"].shape), jnp.float32),  # dbias
    )
    return jax.ffi.ffi_call("jax_flash_bwd", shapes)(
        q,
        k,
        x["v"],
        out,
        x["dout"],
        lse,
        x["dlse"],
        x["q_len"],
        x["kv_len"],
        x["q_seg"],
        x["kv_seg"],
        x["q_off"],
        x["bias"],
        x["mask"],
        *NO_BLOCK_MASK,
        x["seed"],
        **{**backward_attributes(), **attrs},
        deterministic=True,
    )


def run_both(x: dict, attrs: dict):
    out, lse = call_forward(x, attrs)
    grads = call_backward(x, out, lse, attrs)
    return [np.asarray(a) for a in (out, lse, *grads)]


@contextlib.contextmanager
def environment(**values):
    """Sets environment variables for the duration; JAX_FLASH_CPU_THREADS, a process-wide
    setting the extension reads once, is set through set_cpu_thread_limit too."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update({name: str(value) for name, value in values.items()})
    threads = values.get("JAX_FLASH_CPU_THREADS")
    previous = None if threads is None else _jax_flash_ext.set_cpu_thread_limit(int(threads))
    try:
        yield
    finally:
        if previous is not None:
            _jax_flash_ext.set_cpu_thread_limit(previous)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# ---- the float64 reference -----------------------------------------------------------


def visible(cfg: Config, x: dict) -> np.ndarray:
    """[B, T, S] bool: which keys each query row sees."""
    # Key positions of the queries, in Python ints (exact for any offset and window).
    pos = x["q_off"].astype(object)[:, None, None] + np.arange(cfg.t, dtype=object)[:, None]
    s = np.arange(cfg.s, dtype=object)[None, None, :]
    vis = np.ones((cfg.b, cfg.t, cfg.s), bool)
    if cfg.window[0] >= 0:
        vis &= (s >= pos - cfg.window[0]).astype(bool)
    if cfg.window[1] >= 0:
        vis &= (s <= pos + cfg.window[1]).astype(bool)
    vis &= np.arange(cfg.t)[None, :, None] < x["q_len"][:, None, None]
    vis &= np.arange(cfg.s)[None, None, :] < x["kv_len"][:, None, None]
    if cfg.segments:
        vis &= x["q_seg"][:, :, None] == x["kv_seg"][:, None, :]
    return vis


def reference(cfg: Config, x: dict, out_used=None):
    """out, lse, dq, dk, dv, delta in float64 (delta from `out_used`, the out the
    backward is given)."""
    f = lambda a: np.asarray(a).astype(np.float64)
    q, k, v, dout, dlse = f(x["q"]), f(x["k"]), f(x["v"]), f(x["dout"]), f(x["dlse"])
    group = cfg.n // cfg.kh
    kk, vv = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scale = float(np.float32(1.0 / np.sqrt(cfg.h)))
    raw = scale * np.einsum("btnh,bsnh->bnts", q, kk)
    capped = cfg.softcap * np.tanh(raw / cfg.softcap) if cfg.softcap > 0 else raw
    vis = visible(cfg, x)[:, None]
    logits = np.where(vis, capped, -np.inf)
    any_vis = vis.any(-1, keepdims=True)
    m = np.where(any_vis, logits.max(-1, keepdims=True), 0.0)
    e = np.where(vis, np.exp(logits - m), 0.0)
    l = e.sum(-1, keepdims=True)
    p = np.where(any_vis, e / np.where(any_vis, l, 1.0), 0.0)
    out = np.einsum("bnts,bsnh->btnh", p, vv)
    lse = np.where(any_vis[..., 0], (m + np.log(np.where(any_vis, l, 1.0)))[..., 0], -np.inf)
    o = out if out_used is None else f(out_used)
    delta = np.einsum("btnh,btnh->bnt", dout, o) - dlse
    dp = np.einsum("btnh,bsnh->bnts", dout, vv)
    ds = p * (dp - delta[..., None])
    if cfg.softcap > 0:
        ds *= 1.0 - np.tanh(raw / cfg.softcap) ** 2
    dq = scale * np.einsum("bnts,bsnh->btnh", ds, kk)
    dk = scale * np.einsum("bnts,btnh->bsnh", ds, q)
    dv = np.einsum("bnts,btnh->bsnh", p, dout)
    fold = lambda a: a.reshape(cfg.b, cfg.s, cfg.kh, group, cfg.h).sum(3)
    return out, lse, dq, fold(dk), fold(dv), delta


def assert_close(name, got, want, dtype):
    got = np.asarray(got).astype(np.float64)
    assert np.all(np.isfinite(got)), f"{name}: non-finite values"
    err = np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1.0)
    assert err <= TOLERANCE[dtype], f"{name}: relative error {err:.3g} > {TOLERANCE[dtype]}"


def check_against_reference(cfg: Config, dtype: str, results):
    x = make_inputs(cfg, dtype)
    out, lse, dq, dk, dv, dq_accum, delta, _dbias = results
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv, ref_delta = reference(cfg, x, out_used=out)
    assert out.dtype == x["q"].dtype and dq.dtype == x["q"].dtype and dk.dtype == x["k"].dtype
    assert_close("out", out, ref_out, dtype)
    # lse: the same -inf rows, close elsewhere.
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    assert_close("lse", lse[finite], ref_lse[finite], "float32")
    assert_close("delta", delta, ref_delta, "float32")
    assert_close("dq", dq, ref_dq, dtype)
    assert_close("dq_accum", dq_accum, ref_dq, dtype)
    assert_close("dk", dk, ref_dk, dtype)
    assert_close("dv", dv, ref_dv, dtype)
    # Rows that see nothing: exactly zero output and gradient, lse = -inf.
    empty = ~visible(cfg, x).any(-1)  # [B, T]
    assert np.all(np.asarray(out, np.float64)[empty] == 0)
    assert np.all(np.asarray(dq, np.float64)[empty] == 0)
    assert np.all(np.isneginf(lse.transpose(0, 2, 1)[empty]))
    return empty


# ---- tests -------------------------------------------------------------------------


@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_reference_f32(config):
    cfg = CONFIGS[config]
    x = make_inputs(cfg, "float32")
    check_against_reference(cfg, "float32", run_both(x, attributes(cfg)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("config", ["none", "combo", "all_masked_batch", "mqa_wide"])
def test_matches_reference_16bit(config, dtype):
    cfg = CONFIGS[config]
    x = make_inputs(cfg, dtype)
    check_against_reference(cfg, dtype, run_both(x, attributes(cfg)))


@pytest.mark.parametrize("t,s", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences(t, s):
    """T = 0 or S = 0: nothing to compute; with S = 0 every row sees nothing."""
    cfg = Config(b=2, t=t, s=s, n=2, kh=1, h=16)
    x = make_inputs(cfg, "float32")
    out, lse, dq, dk, _dv, _dq_accum, _delta, _dbias = run_both(x, attributes(cfg))
    assert out.shape == (2, t, 2, 16) and lse.shape == (2, 2, t) and dk.shape == (2, s, 1, 16)
    assert np.all(out == 0) and np.all(np.isneginf(lse)) and np.all(dq == 0)


def test_fully_masked_rows_exist_in_cases():
    """The cases above really contain rows that see no key (and rows that do)."""
    for name in ("segments", "all_masked_batch", "window_past_end", "combo"):
        cfg = CONFIGS[name]
        vis = visible(cfg, make_inputs(cfg, "float32")).any(-1)
        assert (~vis).any() and vis.any(), name


ISAS = ["generic", "avx2", "avx512", "avx512bf16", "amx", "amx_emulated"]


def run_on(isa: str, x: dict, attrs: dict):
    """run_both on one ISA, or None when this CPU lacks it (refused by name)."""
    with environment(JAX_FLASH_CPU_ISA=isa):
        try:
            return run_both(x, attrs)
        except Exception as e:  # the refusal must name the ISA
            assert f"JAX_FLASH_CPU_ISA={isa}" in str(e) and "lacks" in str(e), e
            return None


def test_default_isa_rule():
    """The default ISA: amx where granted; else avx512bf16 only where its bf16 dot products give
    at least the float32 FMAs' FLOP rate (on a Xeon they gave half: avx512 ran bf16 1.5x
    faster), else avx512; else avx2; else generic."""
    rule = _jax_flash_ext.cpu_default_isa
    assert rule(True, True, True, True, 0.5) == "amx"
    assert rule(False, True, True, True, 2.0) == "avx512bf16"
    assert rule(False, True, True, True, 1.0) == "avx512bf16"
    assert rule(False, True, True, True, 0.5) == "avx512"
    assert rule(False, False, True, True, 0.0) == "avx512"
    assert rule(False, False, False, True, 0.0) == "avx2"
    assert rule(False, False, False, False, 0.0) == "generic"


def test_default_isa_is_the_rule_on_this_cpu():
    """cpu_isa("") is the rule applied to what this CPU runs and its measured rate."""

    def runs(isa):
        try:
            return _jax_flash_ext.cpu_isa(isa) == isa
        except ValueError:
            return False

    ratio = _jax_flash_ext.cpu_bf16_dot_over_fma()
    has = {isa: runs(isa) for isa in ("amx", "avx512bf16", "avx512", "avx2")}
    assert (ratio > 0) == has["avx512bf16"]
    if ratio > 0:
        assert 0.1 < ratio < 8, ratio  # a vdpbf16ps is 64 FLOP, an FMA 32: 0.5 to 2 seen
    want = _jax_flash_ext.cpu_default_isa(has["amx"], has["avx512bf16"], has["avx512"], has["avx2"], ratio)
    assert _jax_flash_ext.cpu_isa("") == want


@pytest.mark.parametrize("config", ["combo", "tiny_head", "mqa_wide", "wide_head", "odd_tiles"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("isa", ISAS)
def test_every_isa(isa, dtype, config):
    """Each compiled ISA (its own vector width, micro-tile shapes and, for bf16 on
    avx512bf16 and amx, its bf16 products; amx_emulated: the AMX products' code with the tile
    instructions in C++) matches the reference in every dtype; one this CPU lacks is
    refused by name."""
    cfg = CONFIGS[config]
    x = make_inputs(cfg, dtype)
    results = run_on(isa, x, attributes(cfg))
    if results is not None:
        check_against_reference(cfg, dtype, results)


@pytest.mark.parametrize("config", ["none", "segments", "softcap_causal", "offset_combo"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("isa", ["avx512", "avx512bf16", "amx", "amx_emulated"])
def test_masks_on_wide_isas(isa, dtype, config):
    """The mask cases on the AVX-512 paths, the bf16 products included."""
    cfg = CONFIGS[config]
    x = make_inputs(cfg, dtype)
    results = run_on(isa, x, attributes(cfg))
    if results is not None:
        check_against_reference(cfg, dtype, results)


def test_single_pass_backward_chunk_rule():
    """The chunking rule is what tiling.h says: enough (b, kv head, chunk) items for XLA's
    pool (here 16 or 2 threads), at most 4 chunks, one key block each at least; 1 chunk
    (the items own their query heads) once B·K fills the pool."""
    chunks = _jax_flash_ext.cpu_gradient_chunks
    assert chunks(2, 4, 2, 300, 260, 64, threads=16) == 3
    assert chunks(1, 8, 8, 4096, 4096, 64, threads=16) == 2
    assert chunks(4, 8, 8, 4096, 4096, 64, threads=16) == 1
    assert chunks(1, 1, 1, 4096, 4096, 64, threads=16) == 4
    assert chunks(1, 8, 8, 4096, 4096, 64, threads=2) == 1
    assert chunks(1, 1, 1, 4096, 4096, 64, threads=2) == 2


@pytest.mark.parametrize("chunks", ["rule", "1", "3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("isa", ["generic", "avx512", "avx512bf16", "amx", "amx_emulated"])
def test_threads_bitwise_deterministic(isa, dtype, chunks):
    """1, 2, 3 threads and no cap (JAX_FLASH_CPU_THREADS): the same bits, with the rule's
    chunks for this machine's pool, with one chunk (each item owns its query heads: packs
    their Q and dO, holds their dQ) and with three (the dQ partials of the key-block chunks
    are summed in chunk order whoever ran them; JAX_FLASH_CPU_GRADIENT_CHUNKS)."""
    cfg = Config(b=2, t=300, s=260, n=4, kh=2, h=64, window=(-1, 0), softcap=4.0)
    x = make_inputs(cfg, dtype)
    attrs = attributes(cfg)
    runs = []
    forced = {} if chunks == "rule" else {"JAX_FLASH_CPU_GRADIENT_CHUNKS": chunks}
    for threads in (1, 2, 3, 0):  # 0: no cap
        with environment(JAX_FLASH_CPU_THREADS=threads, **forced):
            runs.append(run_on(isa, x, attrs))
    if runs[0] is None:
        return
    check_against_reference(cfg, dtype, runs[0])
    with environment(**forced):
        again = run_on(isa, x, attrs)
    for other in [*runs[1:], again]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_jit_lowers_to_custom_calls_without_t_by_s_tensor():
    cfg = CONFIGS["combo"]
    x = make_inputs(cfg, "float32")
    attrs = attributes(cfg)

    def loss(q, k, v):
        y = dict(x, q=q, k=k, v=v)
        out, lse = call_forward(y, attrs)
        dq, dk, dv, *_ = call_backward(y, out, lse, attrs)
        return jnp.sum(out) + jnp.sum(dq) + jnp.sum(dk) + jnp.sum(dv)

    text = jax.jit(loss).lower(x["q"], x["k"], x["v"]).as_text()
    assert re.search(r"custom_call.*jax_flash_fwd", text)
    assert re.search(r"custom_call.*jax_flash_bwd", text)
    assert f"{cfg.t}x{cfg.s}" not in text and f"{cfg.s}x{cfg.t}" not in text


def test_public_api_lowers_to_cpu_custom_calls():
    """jax_flash.attention(implementation="cpu") under jit and grad: the same targets."""
    import jax_flash

    cfg = CONFIGS["combo"]
    x = make_inputs(cfg, "float32")
    f = lambda q, k, v: jnp.sum(jax_flash.attention(q, k, v, is_causal=True, implementation="cpu"))
    text = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(x["q"], x["k"], x["v"]).as_text()
    assert "jax_flash_fwd" in text and "jax_flash_bwd" in text
    assert f"{cfg.t}x{cfg.s}" not in text and f"{cfg.s}x{cfg.t}" not in text


def bad_call(target: str, **changes):
    """Calls `target` with operands (or result shapes) replaced by `changes`."""
    cfg = Config(b=1, t=8, s=8, n=2, kh=2, h=16)
    x = make_inputs(cfg, "float32")
    attrs = attributes(cfg)
    attrs.update({key: changes.pop(key) for key in list(changes) if key in attrs})
    x.update(changes)
    if target == "jax_flash_fwd":
        return jax.block_until_ready(call_forward(x, attrs))
    out, lse = call_forward(dict(make_inputs(cfg, "float32")), attributes(cfg))
    return jax.block_until_ready(call_backward(x, out, lse, attrs))


@pytest.mark.parametrize(
    "target,changes,message",
    [
        (
            "jax_flash_fwd",
            dict(q=np.zeros((1, 8, 3, 16), np.float32)),
            "query heads N = 3 must be a multiple of the number of kv heads K = 2",
        ),
        ("jax_flash_fwd", dict(k=np.zeros((1, 8, 2, 16), np.float16)), "k has dtype f16, expected f32"),
        ("jax_flash_fwd", dict(v=np.zeros((1, 9, 2, 16), np.float32)), r"v has shape \[1, 9, 2, 16\]"),
        ("jax_flash_fwd", dict(k=np.zeros((8, 2, 16), np.float32)), "k must have rank 4"),
        ("jax_flash_fwd", dict(kv_len=np.zeros((2,), np.int32)), r"kv_lengths has shape \[2\]"),
        ("jax_flash_fwd", dict(q_seg=np.zeros((1, 7), np.int32)), r"q_segment_ids has shape \[1, 7\]"),
        ("jax_flash_fwd", dict(q_len=np.zeros((1,), np.float32)), "q_lengths has dtype f32, expected s32"),
        ("jax_flash_fwd", dict(window_left=np.int64(-2)), "window_left and window_right"),
        ("jax_flash_fwd", dict(q_off=np.zeros((3,), np.int32)), r"q_offset has shape \[3\]"),
        ("jax_flash_fwd", dict(sinks=np.zeros((3,), np.float32)), r"sinks has shape \[3\], expected \[2\]"),
        ("jax_flash_bwd", dict(q_off=np.zeros((1,), np.int64)), "q_offset has dtype"),
        ("jax_flash_fwd", dict(softcap=np.float32(-1.0)), r"softcap must be 0 \(off\) or a finite float32 normal"),
        ("jax_flash_bwd", dict(dlse=np.zeros((1, 8, 2), np.float32)), r"dlse has shape \[1, 8, 2\]"),
        ("jax_flash_bwd", dict(dout=np.zeros((1, 8, 2, 16), np.float16)), "dout has dtype f16"),
        ("jax_flash_fwd", dict(seed=np.zeros((2,), np.int32)), "dropout_seed has dtype s32"),
        ("jax_flash_bwd", dict(seed=np.zeros((3,), np.uint32)), r"dropout_seed has shape \[3\]"),
        ("jax_flash_fwd", dict(dropout_rate=np.float32(1.0)), r"dropout_rate must be in \[0, 1\)"),
    ],
)
def test_handler_errors_surface_as_exceptions(target, changes, message):
    with pytest.raises(Exception, match=message):
        bad_call(target, **changes)


def test_wrong_result_shape_is_an_error():
    cfg = Config(b=1, t=8, s=8, n=2, kh=2, h=16)
    x = make_inputs(cfg, "float32")
    shapes = (
        jax.ShapeDtypeStruct(x["q"].shape, jnp.float32),
        jax.ShapeDtypeStruct((1, 8, 2), jnp.float32),
    )  # lse must be [B, N, T]
    with pytest.raises(Exception, match=r"lse has shape \[1, 8, 2\], expected \[1, 2, 8\]"):
        jax.block_until_ready(
            jax.ffi.ffi_call("jax_flash_fwd", shapes)(
                x["q"],
                x["k"],
                x["v"],
                x["q_len"],
                x["kv_len"],
                x["q_seg"],
                x["kv_seg"],
                x["q_off"],
                x["bias"],
                x["mask"],
                *NO_BLOCK_MASK,
                np.full((2,), -np.inf, np.float32),
                x["seed"],
                **attributes(cfg),
                **forward_attributes(),
            )
        )


@pytest.mark.parametrize(
    "target,attrs,message",
    [
        ("jax_flash_fwd", dict(isa="sse9"), "isa=sse9 is not one of"),
        ("jax_flash_bwd", dict(isa="sse9"), "isa=sse9 is not one of"),
        ("jax_flash_fwd", dict(forward_chunks=np.int64(0)), "forward_chunks must be >= 1"),
        ("jax_flash_fwd", dict(pack_gqa=True), "pack_gqa needs T = 1"),
        ("jax_flash_bwd", dict(gradient_chunks=np.int64(5)), "gradient_chunks must be 0"),
        ("jax_flash_bwd", dict(gradient_chunks=np.int64(-1)), "gradient_chunks must be 0"),
    ],
)
def test_schedule_attribute_errors(target, attrs, message):
    """The attributes decided when a call is traced (the ISA, split-KV chunks, GQA packing, the
    backward's chunks) are checked by the handlers: an unknown ISA, a chunk count out of range,
    or packing asked where it cannot serve (T > 1 here) is an error naming the attribute."""
    cfg = Config(b=1, t=8, s=8, n=2, kh=1, h=16)
    x = make_inputs(cfg, "float32")
    with pytest.raises(Exception, match=message):
        if target == "jax_flash_fwd":
            jax.block_until_ready(call_forward(x, {**attributes(cfg), **attrs}))
        else:
            out, lse = call_forward(x, attributes(cfg))
            jax.block_until_ready(call_backward(x, out, lse, {**attributes(cfg), **attrs}))


def test_unknown_isa_is_an_error():
    cfg = CONFIGS["none"]
    with environment(JAX_FLASH_CPU_ISA="sse9"), pytest.raises(Exception, match="JAX_FLASH_CPU_ISA=sse9 is not one of"):
        run_both(make_inputs(cfg, "float32"), attributes(cfg))
