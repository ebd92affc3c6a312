"""Decoding: split-KV attention and the paged KV cache against the float64 reference.

Tolerance as in the shared suite: err(impl, f64 reference) <= FACTOR·err(reference at the
input dtype) + EPS. Paged results are compared with `jax_flash.paged_reference`, i.e.
`jax_flash.reference` on the gathered cache with key_value_seq_lengths = L and
query_offset = L - T. Inputs are random and off zero, lengths ragged (0 included), pages in
shuffled order with unused pages holding poison (NaN), so a read of the wrong page shows.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from cases import EPS, FACTOR, max_err
from jax_flash import _heuristics, xla
from jax_flash._normalize import canonicalize, restore
from jax_flash.inference import paged, split_kv
from jax_flash.reference import gather_pages


def _paged_cache(rng, b, kh, h, page_size, max_pages, dtype, spare=3):
    """Pages in shuffled order: sequence b uses pages table[b]; `spare` pages per sequence
    are never referenced and hold NaN."""
    num_pages = b * max_pages + spare
    kp = rng.normal(size=(num_pages, page_size, kh, h)) - 0.1
    vp = rng.normal(size=(num_pages, page_size, kh, h)) + 0.2
    table = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages)
    unused = np.setdiff1d(np.arange(num_pages), table)
    kp[unused] = np.nan
    vp[unused] = np.nan
    return (jnp.asarray(kp, dtype), jnp.asarray(vp, dtype), jnp.asarray(table, jnp.int32))


def _references(fn, *args, **kw):
    """(float64 reference, reference at the input dtype), each (out, lse), jitted."""
    run = lambda compute_dtype: jax.jit(lambda *a: fn(*a, return_residual=True, compute_dtype=compute_dtype, **kw))(
        *args
    )
    return run(jnp.float64), run(None)


def _check(out, lse, q, refs, dtype):
    (ref64, lse64), (ref_lo, _) = refs
    assert out.shape == ref64.shape and out.shape[:-1] == q.shape[:-1] and out.dtype == q.dtype
    tol = FACTOR * max_err(ref_lo, ref64) + EPS[jnp.dtype(dtype).name]
    err = max_err(out, ref64)
    assert err <= tol, f"out error {err:.3g} > {tol:.3g}"
    lse_err = max_err(lse, lse64)
    assert lse_err <= 1e-4, f"lse error {lse_err:.3g}"
    dead = ~np.isfinite(np.asarray(lse64))
    assert np.all(np.asarray(out, np.float32)[dead] == 0)  # rows that see nothing: exactly 0


# T in {1, 3, 16}; GQA group sizes 1, 4, 8; page sizes 16 and 64; caches up to 5k keys.
PAGED = [
    # (B, T, N, K, H, page_size, max_pages, lengths, dtype, kwargs)
    (3, 1, 8, 1, 64, 16, 20, [0, 37, 320], "float32", {}),
    (3, 3, 8, 2, 64, 64, 80, [5120, 0, 1234], "float32", {}),
    (2, 16, 8, 8, 128, 16, 12, [16, 191], "bfloat16", {}),
    (2, 3, 4, 1, 64, 64, 10, [640, 70], "float16", dict(is_causal=False)),
    (2, 16, 8, 2, 64, 16, 16, [250, 9], "float32", dict(local_window_size=(40, 0), logits_soft_cap=5.0)),
]


@pytest.mark.parametrize("case", PAGED, ids=lambda c: f"T{c[1]}G{c[2] // c[3]}P{c[5]}S{c[5] * c[6]}-{c[8]}")
def test_paged_attention_matches_reference(case):
    b, t, n, kh, h, ps, mp, lengths, dtype, kw = case
    rng = np.random.default_rng(0)
    kp, vp, table = _paged_cache(rng, b, kh, h, ps, mp, dtype)
    q = jnp.asarray(rng.normal(size=(b, t, n, h)) + 0.1, dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    fn = jax.jit(lambda *a: jax_flash.paged_attention(*a, return_residual=True, **kw))
    out, lse = fn(q, kp, vp, table, lengths)
    assert lse.shape == (b, t, n) and lse.dtype == jnp.float32
    ref = _references(jax_flash.paged_reference, q, kp, vp, table, lengths, **kw)
    _check(out, lse, q, ref, dtype)
    # Split over page chunks (what a GPU runs): the same within tolerance, finite.
    pspec = paged.canonicalize_paged(q, kp, vp, table, lengths, **kw)[0]
    out_s, lse_s = jax.jit(lambda *a: xla.paged_forward(pspec, *a, splits=3))(q, kp, vp, table, lengths)
    _check(out_s, jnp.swapaxes(lse_s, 1, 2), q, ref, dtype)
    # The cpu paged forward: each key block packed from its pages' slots by the tile that
    # visits it (split-KV where its rule splits; forced into 3 chunks too).
    for chunks in ("", "3"):
        with pytest.MonkeyPatch.context() as env:
            env.setenv("JAX_FLASH_CPU_SPLIT_KV", chunks)
            out_c, lse_c = jax.jit(
                lambda *a: jax_flash.paged_attention(*a, return_residual=True, implementation="cpu", **kw)
            )(q, kp, vp, table, lengths)
        _check(out_c, lse_c, q, ref, dtype)


def _decode_inputs(b, t, s, n, kh, h, lengths, dtype, seed=0, hv=None):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, t, n, h)) + 0.1, dtype)
    k = jnp.asarray(rng.normal(size=(b, s, kh, h)) - 0.1, dtype)
    v = jnp.asarray(rng.normal(size=(b, s, kh, h if hv is None else hv)) + 0.2, dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    # A decode step over a contiguous cache filled to L: the last T positions are the queries.
    kw = dict(is_causal=True, key_value_seq_lengths=lengths, query_offset=lengths - t)
    return q, k, v, kw


DECODE = [
    # (B, T, S, N, K, H, lengths, dtype, extra kwargs)
    (2, 1, 5000, 8, 8, 64, [5000, 0], "float32", {}),
    (2, 3, 4099, 8, 2, 64, [4099, 1500], "bfloat16", {}),
    (1, 16, 2048, 8, 1, 128, [1999], "float32", dict(local_window_size=(700, 0))),
    (2, 1, 3000, 4, 1, 64, [2500, 7], "float16", dict(logits_soft_cap=4.0)),
    (1, 2, 1100, 4, 1, 192, [1090], "float32", dict(hv=128)),  # MLA's value head dim Hv != H
]


@pytest.mark.parametrize("case", DECODE, ids=lambda c: f"T{c[1]}S{c[2]}G{c[3] // c[4]}-{c[7]}")
def test_split_kv_matches_reference_and_unsplit(case):
    b, t, s, n, kh, h, lengths, dtype, extra = case
    extra = dict(extra)
    q, k, v, kw = _decode_inputs(b, t, s, n, kh, h, lengths, dtype, hv=extra.pop("hv", None))
    kw.update(extra)
    c = canonicalize(q, k, v, **kw)
    ref = _references(jax_flash.reference, q, k, v, **kw)
    results = {}
    for splits in (1, 8):
        fn = jax.jit(lambda q, k, v, m, splits=splits: split_kv.forward(xla.forward, c.spec, q, k, v, m, splits))
        out, lse = restore(c, *fn(c.q, c.k, c.v, c.masks))
        _check(out, lse, q, ref, dtype)
        results[splits] = np.asarray(out, np.float32)
    # Split and unsplit agree within the suite's tolerance of each other.
    (ref64, _), (ref_lo, _) = ref
    tol = 2 * (FACTOR * max_err(ref_lo, ref64) + EPS[dtype])
    assert np.max(np.abs(results[1] - results[8])) <= tol


# The cpu kernels' split-KV: chunks of key blocks, merged in chunk order (cuda/cpu/README.md).
# JAX_FLASH_CPU_SPLIT_KV=C forces C chunks (1: unsplit); unset, the rule decides (it splits
# the last two: fewer than 16 query blocks, S >= 1024). Sinks join the first chunk.
@pytest.mark.parametrize("case", DECODE[:4], ids=lambda c: f"T{c[1]}S{c[2]}G{c[3] // c[4]}-{c[7]}")
def test_cpu_split_kv_matches_reference_and_unsplit(case, monkeypatch):
    b, t, s, n, kh, h, lengths, dtype, extra = case
    q, k, v, kw = _decode_inputs(b, t, s, n, kh, h, lengths, dtype)
    kw.update(extra)
    kw["sinks"] = jnp.asarray(np.linspace(-1.0, 2.0, n), jnp.float32)
    ref = _references(jax_flash.reference, q, k, v, **kw)
    assert "split-KV" in jax_flash.explain(q, k, v, implementation="cpu", **kw).notes["cpu"]
    results = {}
    for chunks in ("1", "", "5", "40"):
        monkeypatch.setenv("JAX_FLASH_CPU_SPLIT_KV", chunks)
        out, lse = jax_flash.attention(q, k, v, implementation="cpu", return_residual=True, **kw)
        _check(out, lse, q, ref, dtype)
        results[chunks] = np.asarray(out, np.float32)
    (ref64, _), (ref_lo, _) = ref
    tol = 2 * (FACTOR * max_err(ref_lo, ref64) + EPS[dtype])
    for chunks in ("", "5", "40"):
        assert np.max(np.abs(results["1"] - results[chunks])) <= tol, chunks
    assert np.abs(results["1"] - results["5"]).max() > 0 or dtype != "float32"  # a split ran
    # The rule's split is the same bits for any number of threads.
    monkeypatch.setenv("JAX_FLASH_CPU_SPLIT_KV", "")
    from jax_flash import _jax_flash_ext

    previous = _jax_flash_ext.set_cpu_thread_limit(1)  # the process-wide JAX_FLASH_CPU_THREADS setting
    try:
        one = jax_flash.attention(q, k, v, implementation="cpu", **kw)
    finally:
        _jax_flash_ext.set_cpu_thread_limit(previous)
    assert np.asarray(one, np.float32).tobytes() == results[""].tobytes()


# The cpu kernels' GQA packing: at T = 1 the G query heads of one kv head are the rows of one
# tile (K and V read once per kv head). Group sizes 2, 4 and 8, ragged lengths with a 0, sinks,
# a soft cap and a window; split-KV on top where the rule splits; a NaN in a visible value
# reaches exactly the rows of its kv head, as in the reference.
@pytest.mark.parametrize(
    "n, kh, extra",
    [(8, 4, {}), (8, 2, dict(logits_soft_cap=3.0)), (8, 1, dict(local_window_size=(300, 0)))],
    ids=("G2", "G4-softcap", "G8-window"),
)
def test_cpu_gqa_packing(n, kh, extra):
    b, t, s, h = 3, 1, 1300, 64
    q, k, v, kw = _decode_inputs(b, t, s, n, kh, h, [1300, 0, 333], "float32", seed=5)
    kw.update(extra)
    kw["sinks"] = jnp.asarray(np.linspace(-2.0, 1.0, n), jnp.float32)
    note = jax_flash.explain(q, k, v, implementation="cpu", **kw).notes["cpu"]
    assert f"GQA packing: the {n // kh} query heads" in note, note
    ref = _references(jax_flash.reference, q, k, v, **kw)
    out, lse = jax_flash.attention(q, k, v, implementation="cpu", return_residual=True, **kw)
    _check(out, lse, q, ref, "float32")
    # Poison: a NaN in a value row batch row 0 sees, in its last kv head.
    v = v.at[0, 1200, kh - 1, 5].set(jnp.nan)
    out, lse = jax_flash.attention(q, k, v, implementation="cpu", return_residual=True, **kw)
    ref64, lse64 = jax.jit(lambda *a: jax_flash.reference(*a, return_residual=True, compute_dtype=jnp.float64, **kw))(
        q, k, v
    )
    assert np.array_equal(np.isnan(np.asarray(out)), np.isnan(np.asarray(ref64)))
    assert np.array_equal(np.isnan(np.asarray(lse)), np.isnan(np.asarray(lse64)))
    assert np.isnan(np.asarray(out[0, 0, n - n // kh :])).all()
    assert not np.isnan(np.asarray(out[0, 0, : n - n // kh])).any() and not np.isnan(np.asarray(out[1:])).any()


# The cuda kernels' split-KV and GQA packing (kernels/fwd.h; emulated on a CPU, so small
# caches of a few key tiles). JAX_FLASH_CUDA_SPLIT_KV=C forces C chunks (1: unsplit; 9 is more
# chunks than some cases have key tiles: those chunks see nothing); unset, the rule splits (the
# emulation counts 132 SMs). Sinks per query head (chunk 0 and, packed, each row its own
# head's), windows, a soft cap, ragged lengths with a 0, T = 3 (unpacked) and Hv != H.
CUDA_DECODE = [
    # (B, T, S, N, K, H, lengths, dtype, extra kwargs)
    (2, 1, 300, 8, 2, 64, [300, 0], "bfloat16", {}),
    (2, 1, 200, 4, 4, 64, [150, 3], "float16", dict(logits_soft_cap=4.0)),
    (1, 3, 260, 4, 1, 32, [250], "bfloat16", dict(local_window_size=(100, 0))),
    (2, 1, 230, 16, 1, 128, [230, 77], "bfloat16", dict(local_window_size=(90, 0))),
    (1, 1, 260, 4, 2, 128, [260], "bfloat16", dict(hv=64)),
]


def _cuda_or_skip():
    from conftest import availability

    why = availability("cuda")
    if why is not None:
        pytest.skip(f"cuda unavailable here: {why}")


@pytest.mark.parametrize("case", CUDA_DECODE, ids=lambda c: f"T{c[1]}S{c[2]}G{c[3] // c[4]}-{c[7]}")
def test_cuda_split_kv_and_gqa_packing(case, monkeypatch):
    _cuda_or_skip()
    from jax_flash import cuda

    b, t, s, n, kh, h, lengths, dtype, extra = case
    extra = dict(extra)
    q, k, v, kw = _decode_inputs(b, t, s, n, kh, h, lengths, dtype, seed=7, hv=extra.pop("hv", None))
    kw.update(extra)
    kw["sinks"] = jnp.asarray(np.linspace(-1.0, 2.0, n), jnp.float32)
    ref = _references(jax_flash.reference, q, k, v, **kw)
    packed = t == 1 and n > kh
    results = {}
    for chunks in ("1", "", "3", "9"):
        monkeypatch.setenv("JAX_FLASH_CUDA_SPLIT_KV", chunks)
        note = jax_flash.explain(q, k, v, implementation="cuda", **kw).notes["cuda"]
        assert ("GQA packing: the" in note) == packed, note
        expected = {"1": "no split-KV", "3": "split-KV into 3 key chunks", "9": "split-KV into 9 key chunks"}
        assert expected.get(chunks, "split-KV into") in note, note
        # A fresh function each time: the rule is applied when the call is traced.
        fn = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, implementation="cuda", return_residual=True, **kw))
        out, lse = fn(q, k, v)
        _check(out, lse, q, ref, dtype)
        results[chunks] = np.asarray(out, np.float32)
        if chunks == "3":  # the combine is deterministic: the same bits again
            again = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, implementation="cuda", **kw))(q, k, v)
            assert np.asarray(again, np.float32).tobytes() == results["3"].tobytes()
    (ref64, _), (ref_lo, _) = ref
    tol = 2 * (FACTOR * max_err(ref_lo, ref64) + EPS[dtype])
    for chunks in ("", "3", "9"):
        assert np.max(np.abs(results["1"] - results[chunks])) <= tol, chunks
    monkeypatch.delenv("JAX_FLASH_CUDA_SPLIT_KV")
    spec = canonicalize(q, k, v, **kw).spec
    assert cuda.packs_heads(spec) == packed and cuda.split_kv_chunks(spec) > 1


# In its decoding settings the cuda forward handles a non-finite V itself (kernels/nonfinite.h):
# zeroed in shared memory, its keys flagged, the rows that see them NaN; the Python side then
# reads V once (no test of V, no lax.cond). Poisons visible to some rows and masked for others
# in one tile: by the lengths, by the window, and by the causal diagonal between the T rows.
@pytest.mark.parametrize("t, chunks", [(1, "1"), (1, "3"), (3, "3")], ids=["pack", "pack-split", "split"])
def test_cuda_decode_handles_nonfinite_values_in_the_kernel(t, chunks, monkeypatch):
    _cuda_or_skip()
    from jax_flash import cuda

    b, s, n, kh, h = 2, 300, 4, 2, 64
    q, k, v, kw = _decode_inputs(b, t, s, n, kh, h, [290, 200], "bfloat16", seed=11)
    kw["local_window_size"] = (150, 0)
    v = np.asarray(v, np.float32)
    v[0, 289, 1, 5] = np.nan  # the newest key of batch row 0, kv head 1: seen by its last query only
    v[0, 100, 0, 7] = np.inf  # behind the window of batch row 0 (position >= 287 - 150): seen by none
    v[1, 250, 0, 3] = -np.inf  # past batch row 1's length: seen by none
    v[1, 120, 1, 0] = np.nan  # inside batch row 1's window: seen by every query of kv head 1
    v = jnp.asarray(v, jnp.bfloat16)
    monkeypatch.setenv("JAX_FLASH_CUDA_SPLIT_KV", chunks)
    spec = canonicalize(q, k, v, **kw).spec
    assert cuda.scans_values(spec, canonicalize(q, k, v, **kw).masks)
    note = jax_flash.explain(q, k, v, implementation="cuda", **kw).notes["cuda"]
    assert "non-finite values of V handled in the kernel" in note, note
    fn = lambda q, k, v: jax_flash.attention(q, k, v, implementation="cuda", return_residual=True, **kw)
    assert not re.search(r"\bcond\[", str(jax.make_jaxpr(fn)(q, k, v)))  # V is not tested on the host
    out, lse = jax.jit(fn)(q, k, v)
    (ref64, lse64), _ = _references(jax_flash.reference, q, k, v, **kw)
    out, ref64 = np.asarray(out, np.float32), np.asarray(ref64)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref64))
    assert np.isnan(out[0, t - 1, 2:]).all() and not np.isnan(out[1, :, :2]).any()
    assert np.isnan(out[1, :, 2:]).all()
    if t > 1:
        assert not np.isnan(out[0, : t - 1]).any()  # the earlier rows do not see key 289
    ok = ~np.isnan(ref64)
    assert np.max(np.abs(out[ok] - ref64[ok])) < 3e-2
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse64), atol=1e-4)  # lse is not poisoned


# The pallas forward's split-KV (jax_flash/pallas/_triton.py; interpreted on a CPU, so small caches):
# JAX_FLASH_PALLAS_SPLIT_KV=C forces C chunks (1: unsplit, 40: more chunks than key blocks);
# unset, the rule (interpreted: fewer than 8 programs) splits these decode steps.
PALLAS_DECODE = [
    # (B, T, S, N, K, H, lengths, dtype, extra kwargs)
    (2, 1, 300, 2, 1, 64, [300, 0], "float32", {}),
    (1, 3, 260, 2, 1, 32, [250], "bfloat16", dict(local_window_size=(100, 0), logits_soft_cap=4.0)),
]


@pytest.mark.parametrize("case", PALLAS_DECODE, ids=lambda c: f"T{c[1]}S{c[2]}G{c[3] // c[4]}-{c[7]}")
def test_pallas_split_kv(case, monkeypatch):
    from conftest import availability

    why = availability("pallas")
    if why is not None:
        pytest.skip(f"pallas unavailable here: {why}")
    b, t, s, n, kh, h, lengths, dtype, extra = case
    q, k, v, kw = _decode_inputs(b, t, s, n, kh, h, lengths, dtype, seed=9)
    kw.update(extra)
    kw["sinks"] = jnp.asarray(np.linspace(-1.0, 2.0, n), jnp.float32)
    ref = _references(jax_flash.reference, q, k, v, **kw)
    results = {}
    for chunks in ("1", "", "3", "40"):
        monkeypatch.setenv("JAX_FLASH_PALLAS_SPLIT_KV", chunks)
        note = jax_flash.explain(q, k, v, implementation="pallas", **kw).notes["pallas"]
        assert ("no split-KV" in note) == (chunks == "1"), note
        out, lse = jax.jit(
            lambda q, k, v: jax_flash.attention(q, k, v, implementation="pallas", return_residual=True, **kw)
        )(q, k, v)
        _check(out, lse, q, ref, dtype)
        results[chunks] = np.asarray(out, np.float32)
    (ref64, _), (ref_lo, _) = ref
    tol = 2 * (FACTOR * max_err(ref_lo, ref64) + EPS[dtype])
    for chunks in ("", "3", "40"):
        assert np.max(np.abs(results["1"] - results[chunks])) <= tol, chunks
    monkeypatch.setenv("JAX_FLASH_PALLAS_SPLIT_KV", "0")
    with pytest.raises(ValueError, match="JAX_FLASH_PALLAS_SPLIT_KV"):
        jax_flash.attention(q, k, v, implementation="pallas", **kw)


def test_cuda_split_kv_rule(monkeypatch):
    """The rule (FlashAttention-2's): split when the forward's CTAs fill fewer than 80% of the
    resident slots (the SMs; 4 per SM on the decoding tile, a call of at most 16 rows per tile),
    into the fewest chunks whose waves are 85% as full as the best count's, at most 64 of at
    least 2 key tiles each; never with dropout; the override and its errors. The figures below
    are worked by hand from that rule (132 SMs)."""
    from jax_flash import cuda
    from jax_flash._spec import AttentionSpec

    monkeypatch.delenv("JAX_FLASH_CUDA_SPLIT_KV", raising=False)
    monkeypatch.delenv("JAX_FLASH_CUDA_LAYOUT", raising=False)
    monkeypatch.setattr(cuda, "sm_count", lambda: (132, "132 SMs"))
    decode = AttentionSpec(1, 1, 32768, 32, 8, 128, "bfloat16", 0.1)  # packed: B·K = 8 CTAs
    assert cuda.packs_heads(decode) and cuda.forward_ctas(decode) == 8
    # 528 slots; 1024 32-key tiles: at most 64 chunks; 8·C/528 grows to 0.97 at C = 64, and
    # 0.85 of that is first reached at C = 55.
    assert cuda.split_kv_chunks(decode) == 55
    # 64 CTAs: C = 33 fills 4 whole waves (best 1.0); C = 7 fills 0.848 of one, C = 8 0.97.
    assert cuda.split_kv_chunks(dataclasses.replace(decode, batch=8)) == 8
    # 136 CTAs: C = 7 fills 952 / 1056 = 0.90 of two waves (the best, C = 62, 0.998).
    assert cuda.split_kv_chunks(dataclasses.replace(decode, batch=17)) == 7
    assert cuda.split_kv_chunks(dataclasses.replace(decode, batch=106)) == 1  # 848 >= 0.8 · 528
    assert cuda.split_kv_chunks(dataclasses.replace(decode, kv_len=300)) == 5  # 10 tiles // 2
    assert cuda.split_kv_chunks(dataclasses.replace(decode, kv_len=64)) == 1  # 2 tiles: no chunk of 2
    # Unpacked (K = N) but T = 1: still the decoding tile, 32 CTAs; 15 · 32 / 528 = 0.91.
    unpacked = dataclasses.replace(decode, num_kv_heads=32)
    assert not cuda.packs_heads(unpacked) and cuda.forward_ctas(unpacked) == 32
    assert cuda.split_kv_chunks(unpacked) == 15
    # 8 · 32 = 256 query heads at T = 1 (MHA decoding): 0.48 of the slots; 2 chunks fill 0.97.
    assert cuda.split_kv_chunks(dataclasses.replace(unpacked, batch=8)) == 2
    # T = 200: the 128-row tile, one CTA per SM: 64 CTAs of 132 slots, 2 chunks fill 0.97.
    prefill = dataclasses.replace(unpacked, q_len=200)
    assert cuda.forward_ctas(prefill) == 64 and cuda.split_kv_chunks(prefill) == 2
    # The decoding tile reads K's and V's row strides as 32-bit words: K·max(H, Hv) < 2**31.
    wide = dataclasses.replace(unpacked, num_heads=2**23, num_kv_heads=2**23, head_dim=256)
    assert not _heuristics.cuda_decode_tile(wide)
    assert _heuristics.cuda_decode_tile(dataclasses.replace(wide, head_dim=128))
    assert not cuda.packs_heads(dataclasses.replace(decode, q_len=2))
    assert not cuda.packs_heads(dataclasses.replace(decode, bias_shape=(1, 32, 1, 32768)))
    assert cuda.split_kv_chunks(dataclasses.replace(decode, batch=0)) == 1
    monkeypatch.setenv("JAX_FLASH_CUDA_SPLIT_KV", "5")
    assert cuda.split_kv_chunks(dataclasses.replace(decode, batch=64)) == 5
    for bad in ("0", "x", "2000"):
        monkeypatch.setenv("JAX_FLASH_CUDA_SPLIT_KV", bad)
        with pytest.raises(ValueError, match="JAX_FLASH_CUDA_SPLIT_KV"):
            cuda.split_kv_chunks(decode)


# The cuda paged forward (the forward kernel reading K/V through the table), emulated: pages in
# shuffled order with NaN in the unused ones, a page size that is no power of two (48) and one
# smaller than a key tile (16), T = 1 (GQA-packed) and 3, ragged lengths with a 0, sinks, a
# window and soft cap; unsplit, the rule's split, and 3 chunks. All but the last run the
# decoding tile (at most 16 rows), whose copies take their rows' pages from the lanes that
# looked them up (H <= 192: page 8 under its 16-key tiles at H = 192) or look them up each
# (H = 256); T = 20 runs the 128-row tile.
CUDA_PAGED = [
    # (B, T, N, K, H, page_size, max_pages, lengths, dtype, kwargs)
    (3, 1, 8, 2, 64, 16, 20, [0, 37, 320], "bfloat16", {}),
    (2, 3, 4, 1, 64, 48, 6, [288, 70], "float16", dict(is_causal=False)),
    (2, 1, 8, 8, 128, 64, 4, [256, 100], "bfloat16", dict(local_window_size=(40, 0), logits_soft_cap=5.0)),
    (1, 2, 2, 1, 192, 8, 9, [67], "bfloat16", dict(is_causal=False)),
    (1, 1, 4, 2, 256, 16, 3, [41], "bfloat16", {}),
    (1, 20, 2, 1, 64, 16, 5, [77], "bfloat16", dict(is_causal=False)),
]


@pytest.mark.parametrize("case", CUDA_PAGED, ids=lambda c: f"T{c[1]}G{c[2] // c[3]}P{c[5]}S{c[5] * c[6]}-{c[8]}")
def test_cuda_paged_attention(case, monkeypatch):
    _cuda_or_skip()
    b, t, n, kh, h, ps, mp, lengths, dtype, kw = case
    rng = np.random.default_rng(2)
    kp, vp, table = _paged_cache(rng, b, kh, h, ps, mp, dtype)
    q = jnp.asarray(rng.normal(size=(b, t, n, h)) + 0.1, dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    kw = dict(kw, sinks=jnp.asarray(np.linspace(-1.0, 1.5, n), jnp.float32))
    ref = _references(jax_flash.paged_reference, q, kp, vp, table, lengths, **kw)
    e = jax_flash.explain_paged(q, kp, vp, table, lengths, implementation="cuda", **kw)
    assert e.selected == "cuda" and "read through the table" in e.notes["cuda"], e
    results = {}
    for chunks in ("1", "", "3"):
        monkeypatch.setenv("JAX_FLASH_CUDA_SPLIT_KV", chunks)
        out, lse = jax.jit(lambda *a: jax_flash.paged_attention(*a, return_residual=True, implementation="cuda", **kw))(
            q, kp, vp, table, lengths
        )
        assert lse.shape == (b, t, n) and lse.dtype == jnp.float32
        _check(out, lse, q, ref, dtype)
        results[chunks] = np.asarray(out, np.float32)
    (ref64, _), (ref_lo, _) = ref
    tol = 2 * (FACTOR * max_err(ref_lo, ref64) + EPS[dtype])
    assert max(np.max(np.abs(results["1"] - results[c])) for c in ("", "3")) <= tol


def test_split_kv_combine_is_bitwise_reproducible():
    q, k, v, kw = _decode_inputs(2, 3, 4096, 8, 2, 64, [4096, 3001], "float32", seed=3)
    c = canonicalize(q, k, v, **kw)
    run = lambda: jax.jit(lambda q, k, v, m: split_kv.forward(xla.forward, c.spec, q, k, v, m, 16))(
        c.q, c.k, c.v, c.masks
    )
    first = run()
    for _ in range(2):  # same compiled step, then a fresh trace and compilation
        again = run()
        for a, b in zip(first, again):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    jax.clear_caches()
    for a, b in zip(first, run()):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_split_kv_rule():
    q = jnp.zeros((1, 1, 32, 128), jnp.float32)
    k = jnp.zeros((1, 32768, 8, 128), jnp.float32)
    spec = canonicalize(q, k, k).spec
    assert split_kv.num_splits(spec, "cpu") == 1
    assert split_kv.num_splits(spec, "gpu") == 32  # ceil(256 / (B·K)) = 32 chunks of 1024
    assert split_kv.num_splits(dataclasses.replace(spec, batch=32), "gpu") == 1
    assert split_kv.num_splits(dataclasses.replace(spec, q_len=65), "gpu") == 1
    assert split_kv.num_splits(dataclasses.replace(spec, kv_len=1000), "gpu") == 1
    note = jax_flash.explain(q, k, k).notes["xla"]
    assert "no split-KV" in note and "T <= 64" in note  # the rule, stated


def test_paged_grad_raises():
    rng = np.random.default_rng(1)
    kp, vp, table = _paged_cache(rng, 1, 1, 32, 16, 2, "float32")
    q = jnp.ones((1, 1, 2, 32), jnp.float32)
    lengths = jnp.asarray([20], jnp.int32)
    with pytest.raises(NotImplementedError, match="inference op"):
        jax.grad(lambda q: jax_flash.paged_attention(q, kp, vp, table, lengths).sum())(q)


def test_paged_bad_inputs():
    rng = np.random.default_rng(2)
    kp, vp, table = _paged_cache(rng, 2, 2, 32, 16, 4, "float32", spare=0)
    q = jnp.ones((2, 1, 4, 32), jnp.float32)
    ok = jnp.asarray([5, 64], jnp.int32)
    call = lambda **over: jax_flash.paged_attention(
        *(over.get(n, d) for n, d in (("q", q), ("kp", kp), ("vp", vp), ("table", table), ("lengths", ok))),
        **over.get("kw", {}),
    )
    with pytest.raises(ValueError, match=r"kv_lengths\[1\] = 65"):
        call(lengths=jnp.asarray([5, 65], jnp.int32))
    with pytest.raises(ValueError, match=r"kv_lengths\[0\] = -1"):
        call(lengths=jnp.asarray([-1, 3], jnp.int32))
    with pytest.raises(ValueError, match=r"page_table\[0, 0\] = 8 is not a page id"):
        call(table=table.at[0, 0].set(8))
    call(table=table.at[0, 3].set(99))  # an unused entry (row 0 uses 1 page): any value
    with pytest.raises(ValueError, match="page_table must have shape"):
        call(table=table[:1])
    with pytest.raises(TypeError, match="page_table must be an integer"):
        call(table=table.astype(jnp.float32))
    with pytest.raises(ValueError, match="kv_lengths must have shape"):
        call(lengths=ok[:1])
    with pytest.raises(TypeError, match="value_pages must have the dtype"):
        call(vp=vp.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="key_pages must have the head dim"):
        call(kp=kp[..., :16], vp=vp[..., :16])
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        call(q=jnp.ones((2, 1, 3, 32), jnp.float32))
    with pytest.raises(ValueError, match="logits_soft_cap"):
        call(kw=dict(logits_soft_cap=-1.0))
    with pytest.raises(ValueError, match='implementation="cuda" cannot run paged_attention: '):
        call(kw=dict(implementation="cuda"))  # float32 (or no GPU)
    with pytest.raises(ValueError, match="implementation must be"):
        call(kw=dict(implementation="tpu"))


@pytest.mark.parametrize("impl", ["xla", "pallas", "cuda", "cpu"])
def test_paged_traced_bad_ids_and_lengths_are_masked(impl):
    """Under jit the values are not known at trace time: bad page ids read nothing (their
    keys are masked, never read out of bounds), a length beyond the table counts the table's
    keys only, a negative one counts as 0 — as the reference defines it."""
    rng = np.random.default_rng(3)
    dtype = "bfloat16" if impl == "cuda" else "float32"  # the cuda kernels are 16-bit
    kp, vp, table = _paged_cache(rng, 3, 2, 32, 16, 4, dtype, spare=0)
    why = jax_flash.explain_paged(
        jnp.zeros((3, 2, 4, 32), dtype), kp, vp, table, jnp.zeros((3,), jnp.int32), implementation=impl
    ).reasons[impl]
    if why is not None:
        pytest.skip(f"{impl}: {why}")
    table = table.at[0, 1].set(-7).at[1, 2].set(10_000)
    lengths = jnp.asarray([50, 1000, -4], jnp.int32)
    q = jnp.asarray(rng.normal(size=(3, 2, 4, 32)), dtype)
    out, lse = jax.jit(lambda *a: jax_flash.paged_attention(*a, return_residual=True, implementation=impl))(
        q, kp, vp, table, lengths
    )
    ref = _references(jax_flash.paged_reference, q, kp, vp, table, lengths)
    _check(out, lse, q, ref, dtype)
    assert np.all(np.asarray(out[2]) == 0)


def test_paged_cache_write_in_place_under_jit_with_donation():
    b, kh, h, ps, mp = 3, 2, 32, 16, 6
    rng = np.random.default_rng(4)
    kp, vp, table = _paged_cache(rng, b, kh, h, ps, mp, "float32", spare=0)
    lengths = jnp.asarray([0, 15, 40], jnp.int32)
    new_k = jnp.asarray(rng.normal(size=(b, 3, kh, h)), jnp.float32)
    new_v = jnp.asarray(rng.normal(size=(b, 3, kh, h)), jnp.float32)
    num_new = jnp.asarray([3, 2, 3], jnp.int32)
    expect_k = np.array(gather_pages(kp, table))
    expect_v = np.array(gather_pages(vp, table))
    for row, (length, count) in enumerate(zip([0, 15, 40], [3, 2, 3])):
        expect_k[row, length : length + count] = np.asarray(new_k[row, :count])
        expect_v[row, length : length + count] = np.asarray(new_v[row, :count])
    write = jax.jit(jax_flash.paged_cache_write, donate_argnums=(0, 1))
    k_ptr, v_ptr = kp.unsafe_buffer_pointer(), vp.unsafe_buffer_pointer()
    kp2, vp2 = write(kp, vp, table, lengths, new_k, new_v, num_new)
    assert kp.is_deleted() and vp.is_deleted()  # donated
    assert kp2.unsafe_buffer_pointer() == k_ptr and vp2.unsafe_buffer_pointer() == v_ptr  # in place
    np.testing.assert_array_equal(np.asarray(gather_pages(kp2, table)), expect_k)
    np.testing.assert_array_equal(np.asarray(gather_pages(vp2, table)), expect_v)
    # Concrete overflow is a trace-time error; traced, the tokens past the table are dropped.
    with pytest.raises(ValueError, match=r"kv_lengths\[2\] = 95 plus 3 new tokens"):
        jax_flash.paged_cache_write(kp2, vp2, table, jnp.asarray([0, 0, 95]), new_k, new_v)
    expect_k[:2, :3] = np.asarray(new_k[:2])
    expect_k[2, 95] = np.asarray(new_k[2, 0])  # tokens 1, 2 of row 2 fall past the table
    kp3, _ = jax.jit(jax_flash.paged_cache_write)(kp2, vp2, table, jnp.asarray([0, 0, 95]), new_k, new_v)
    np.testing.assert_array_equal(np.asarray(gather_pages(kp3, table)), expect_k)


PALLAS = [
    # (B, T, N, K, H, page_size, max_pages, lengths, dtype, kwargs): small, interpreted on a CPU
    (2, 1, 8, 1, 64, 16, 6, [0, 81], "float32", {}),
    (2, 3, 8, 2, 32, 64, 3, [150, 3], "bfloat16", dict(logits_soft_cap=5.0)),
    (1, 16, 2, 2, 16, 16, 4, [40], "float16", dict(local_window_size=(20, 0))),
]


@pytest.mark.parametrize("case", PALLAS, ids=lambda c: f"T{c[1]}G{c[2] // c[3]}P{c[5]}-{c[8]}")
def test_pallas_paged_decode_kernel(case):
    from jax_flash.pallas import _decode as pallas_decode

    b, t, n, kh, h, ps, mp, lengths, dtype, kw = case
    rng = np.random.default_rng(5)
    kp, vp, table = _paged_cache(rng, b, kh, h, ps, mp, dtype)
    q = jnp.asarray(rng.normal(size=(b, t, n, h)) + 0.1, dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    why = jax_flash.explain_paged(q, kp, vp, table, lengths, implementation="pallas", **kw).reasons["pallas"]
    if why is not None:
        pytest.skip(f"pallas: {why}")
    ref = _references(jax_flash.paged_reference, q, kp, vp, table, lengths, **kw)
    out, lse = jax.jit(lambda *a: jax_flash.paged_attention(*a, implementation="pallas", return_residual=True, **kw))(
        q, kp, vp, table, lengths
    )
    _check(out, lse, q, ref, dtype)
    pspec = paged.canonicalize_paged(q, kp, vp, table, lengths, **kw)[0]
    out_s, lse_s = jax.jit(lambda *a: pallas_decode.paged_forward(pspec, *a, splits=2))(q, kp, vp, table, lengths)
    _check(out_s, jnp.swapaxes(lse_s, 1, 2), q, ref, dtype)


def test_pallas_paged_limits_are_stated():
    kp = jnp.zeros((4, 8, 1, 32), jnp.float32)  # page_size 8: not a Triton tile
    q = jnp.zeros((1, 1, 2, 32), jnp.float32)
    table, lengths = jnp.zeros((1, 2), jnp.int32), jnp.asarray([3], jnp.int32)
    e = jax_flash.explain_paged(q, kp, kp, table, lengths, implementation="pallas")
    assert e.selected is None and "page_size a power of two" in e.reasons["pallas"]
    with pytest.raises(ValueError, match='implementation="pallas" cannot run paged_attention: needs page_size'):
        jax_flash.paged_attention(q, kp, kp, table, lengths, implementation="pallas")
    # None: cuda on a GPU, cpu on a CPU (the extension's host kernels), else xla.
    expected = {"cpu": "cpu", "gpu": "cuda"}.get(jax.default_backend(), "xla")
    assert jax_flash.explain_paged(q, kp, kp, table, lengths).selected == expected


@pytest.mark.parametrize(
    "impl", ["split", "cpu-split", "cuda-split", "pallas-split", "paged-xla", "paged-pallas", "paged-cuda", "paged-cpu"]
)
def test_decode_poison_reaches_exactly_the_rows_that_see_it(impl):
    """A NaN in a visible key or value makes that row NaN (out and lse, as the reference); a
    NaN beyond a sequence's length changes nothing — also through the split and the merge."""
    b, t, n, kh, h, ps, mp = 2, 2, 4, 2, 32, 16, 70  # S = 1120: split-KV has 2+ chunks
    rng = np.random.default_rng(6)
    lengths = jnp.asarray([900, 300], jnp.int32)
    k = rng.normal(size=(b, mp * ps, kh, h))
    v = rng.normal(size=(b, mp * ps, kh, h))
    k[0, 700, 1, 3] = np.nan  # visible to row 0 (kv head 1 only)
    v[1, 600, 0, 0] = np.inf  # beyond row 1's length: invisible
    k, v = jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32)
    q = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)
    if "cuda" in impl:  # 16-bit kernels: the reference sees the same bf16 inputs
        q, k, v = (x.astype(jnp.bfloat16).astype(jnp.float32) for x in (q, k, v))
    table = jnp.asarray(rng.permutation(b * mp).reshape(b, mp), jnp.int32)
    kp = jnp.zeros((b * mp, ps, kh, h), jnp.float32).at[table.reshape(-1)].set(k.reshape(b * mp, ps, kh, h))
    vp = jnp.zeros((b * mp, ps, kh, h), jnp.float32).at[table.reshape(-1)].set(v.reshape(b * mp, ps, kh, h))
    ref64, lse64 = jax_flash.paged_reference(q, kp, vp, table, lengths, return_residual=True, compute_dtype=jnp.float64)
    if impl == "split":
        kw = dict(is_causal=True, key_value_seq_lengths=lengths, query_offset=lengths - t)
        c = canonicalize(q, k, v, **kw)
        out, lse = restore(c, *jax.jit(lambda *a: split_kv.forward(xla.forward, c.spec, *a, 4))(c.q, c.k, c.v, c.masks))
    elif impl in ("cpu-split", "cuda-split", "pallas-split"):
        name = impl.split("-")[0]
        if name in ("cuda", "pallas"):
            from conftest import availability

            if availability(name) is not None:
                pytest.skip(f"{name} unavailable here: {availability(name)}")
        if name == "cuda":
            q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
        kw = dict(is_causal=True, key_value_seq_lengths=lengths, query_offset=lengths - t)
        with pytest.MonkeyPatch.context() as mp_env:
            mp_env.setenv(f"JAX_FLASH_{name.upper()}_SPLIT_KV", "4")
            out, lse = jax.jit(
                lambda q, k, v: jax_flash.attention(q, k, v, implementation=name, return_residual=True, **kw)
            )(q, k, v)
        if name == "cuda":
            out = out.astype(jnp.float32)
    elif impl == "paged-cuda":
        _cuda_or_skip()
        with pytest.MonkeyPatch.context() as mp_env:
            mp_env.setenv("JAX_FLASH_CUDA_SPLIT_KV", "3")
            out, lse = jax.jit(
                lambda *a: jax_flash.paged_attention(
                    *(x.astype(jnp.bfloat16) for x in a[:3]), *a[3:], return_residual=True, implementation="cuda"
                )
            )(q, kp, vp, table, lengths)
        out = out.astype(jnp.float32)
    elif impl == "paged-cpu":
        with pytest.MonkeyPatch.context() as mp_env:
            mp_env.setenv("JAX_FLASH_CPU_SPLIT_KV", "3")
            out, lse = jax.jit(lambda *a: jax_flash.paged_attention(*a, return_residual=True, implementation="cpu"))(
                q, kp, vp, table, lengths
            )
    else:
        name = impl.split("-")[1]
        pspec = paged.canonicalize_paged(q, kp, vp, table, lengths)[0]
        if paged.reason(name, pspec) is not None:
            pytest.skip(paged.reason(name, pspec))
        fwd = (
            xla.paged_forward if name == "xla" else __import__("jax_flash.pallas._decode", fromlist=["x"]).paged_forward
        )
        out, lse = jax.jit(lambda *a: fwd(pspec, *a, splits=3))(q, kp, vp, table, lengths)
        lse = jnp.swapaxes(lse, 1, 2)
    assert np.array_equal(np.isnan(np.asarray(out)), np.isnan(np.asarray(ref64)))
    assert np.array_equal(np.isnan(np.asarray(lse)), np.isnan(np.asarray(lse64)))
    assert np.isnan(np.asarray(out[0, :, 2:])).all() and not np.isnan(np.asarray(out[0, :, :2])).any()
    ok = ~np.isnan(np.asarray(ref64))
    tol = 2e-2 if "cuda" in impl else 1e-5  # bf16 outputs
    assert np.max(np.abs(np.asarray(out)[ok] - np.asarray(ref64)[ok])) < tol


def test_decode_with_sinks():
    """Sinks in decoding: paged_attention (xla and the pallas decode kernel, unsplit and split
    over page chunks) and the split-KV forward against the reference (a sequence of length 0:
    out 0, lse = the sink)."""
    rng = np.random.default_rng(4)
    b, t, n, kh, h, ps, mp = 3, 2, 4, 2, 32, 16, 6
    kp, vp, table = _paged_cache(rng, b, kh, h, ps, mp, "float32")
    q = jnp.asarray(rng.normal(size=(b, t, n, h)) + 0.1, jnp.float32)
    lengths = jnp.asarray([0, 37, 96], jnp.int32)
    sinks = jnp.asarray(np.log(50.0) + rng.normal(size=n), jnp.float32)
    kw = dict(sinks=sinks, logits_soft_cap=5.0)
    ref = _references(jax_flash.paged_reference, q, kp, vp, table, lengths, **kw)
    out, lse = jax.jit(lambda *a: jax_flash.paged_attention(*a, return_residual=True, **kw))(q, kp, vp, table, lengths)
    _check(out, lse, q, ref, "float32")
    np.testing.assert_allclose(np.asarray(lse)[0], np.broadcast_to(np.asarray(sinks), (t, n)), rtol=1e-6)
    pspec, *_, sinks_c = paged.canonicalize_paged(q, kp, vp, table, lengths, **kw)
    out_s, lse_s = jax.jit(lambda *a: xla.paged_forward(pspec, *a, splits=3, sinks=sinks_c))(q, kp, vp, table, lengths)
    _check(out_s, jnp.swapaxes(lse_s, 1, 2), q, ref, "float32")
    # The pallas decode kernel (interpreted here), unsplit and over 3 page chunks: the sink
    # joins the first chunk only.
    out_p, lse_p = jax.jit(
        lambda *a: jax_flash.paged_attention(*a, return_residual=True, implementation="pallas", **kw)
    )(q, kp, vp, table, lengths)
    _check(out_p, lse_p, q, ref, "float32")
    from jax_flash.pallas import _decode as pallas_decode

    out_p, lse_p = jax.jit(lambda *a: pallas_decode.paged_forward(pspec, *a, splits=3, sinks=sinks_c))(
        q, kp, vp, table, lengths
    )
    _check(out_p, jnp.swapaxes(lse_p, 1, 2), q, ref, "float32")
    # Split-KV over a contiguous cache (the xla path of attention on a GPU): the sink is
    # merged once, as one more partial.
    q, k, v, dkw = _decode_inputs(2, 1, 1100, 4, 2, 32, [1100, 0], "float32")
    dkw["sinks"] = sinks
    c = canonicalize(q, k, v, **dkw)
    ref = _references(jax_flash.reference, q, k, v, **dkw)
    fn = jax.jit(lambda q, k, v, m: split_kv.forward(xla.forward, c.spec, q, k, v, m, 2))
    _check(*restore(c, *fn(c.q, c.k, c.v, c.masks)), q, ref, "float32")
