"""The pallas forward on Mosaic GPU (jax_flash/pallas/_mosaic.py), proved without a GPU in two
layers (the third, mutations, is build/mutation_check.py's `MOSAIC` group):

- *lowering*: the kernel lowers for the `cuda` platform on a CPU (`jax.export`), and the Mosaic
  GPU module it carries holds what the design promises, counted op by op: every key and value
  tile and the query tile come by TMA (`cp.async.bulk.tensor`), both products are wgmma, the
  consumers wait on mbarriers where the schedule says (ready, free, the two consumers' turns),
  the producer gives registers up and the consumers take them (`setmaxnreg`), one ex2 per score;
- *interpretation*: JAX's GPU interpret mode runs the kernel on the CPU, warpgroups as
  threads, TMA copies and barriers simulated, races detected, against a float64 reference at
  small shapes (ring wrap-around, GQA, the causal diagonal and the epilogue that frees the
  steps one consumer does not see), in a subprocess with a hard timeout: a warpgroup that
  fails leaves the others waiting on barriers forever.

Both read private JAX through tests/mosaic_interpret.py (pinned to one JAX version; skipped,
with the reason, on another).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
import mosaic_interpret
from jax_flash.pallas import _mosaic, _mosaic_backward

pytestmark = pytest.mark.skipif(mosaic_interpret.available() is not None, reason=str(mosaic_interpret.available()))

TESTS = Path(__file__).resolve().parents[1]


def _interpreted(script: str, cases, path: str) -> dict:
    """Run `script` (CASES as JSON, the module or package file under test) in a subprocess with a
    hard timeout: a warpgroup that fails under the interpreter leaves the others waiting on
    barriers. Its report (the last line of stdout), checked for races."""
    run = subprocess.run(
        [sys.executable, "-c", script, str(TESTS), json.dumps(cases), path],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert not report["races"], report
    return report


def _module_ops(h: int, causal: bool, tiles: _mosaic.ForwardTiles | None = None):
    q = jax.ShapeDtypeStruct((2, 1024, 4, h), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 1024, 2, h), jnp.bfloat16)
    fn = jax.jit(lambda q, k, v: _mosaic.forward(q, k, v, scale=0.1, causal=causal, tiles=tiles))
    (ops,) = mosaic_interpret.module_ops(jax.export.export(fn, platforms=["cuda"])(q, k, k).mlir_module())
    return ops


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("h", _mosaic.HEAD_DIMS)
def test_forward_lowers_to_the_fa3_schedule(h, causal):
    """The kernel's Mosaic GPU module, op by op (the counts follow from the kernel's structure:
    one copy of each key loop body; causal has two, the interior and the diagonal)."""
    tiles = _mosaic.default_tiles(h)
    ops = _module_ops(h, causal)
    op = lambda name: ops["stable_mosaic_gpu.nvvm." + name]
    loops = 2 if causal else 1
    # TMA: Q once per consumer (one op), K and V in the ring's first fill and in the loop.
    assert op("cp.async.bulk.tensor.shared.cluster.global") == 1 + 2 * (tiles.stages + 1), ops
    assert op("cp.async.bulk.tensor.global.shared.cta") == 1, ops  # O leaves by TMA
    # mbarrier waits: Q; per key step K ready, two turns of the schedule, V ready; one turn
    # before and one after the loops; the producer's two free slots, in its loop and for the last
    # steps; causal: the epilogue's two turns and the two copies it observes.
    assert op("mbarrier.try_wait.parity") == 1 + 4 * loops + 2 + 2 * 2 + (4 if causal else 0), ops
    # Both products are wgmma, each one commit group per key step.
    assert ops["asm:wgmma.mma_async"] >= 2 * loops and op("wgmma.commit.group.sync.aligned") == 2 * loops, ops
    assert op("setmaxregister") == 2, ops  # the producer's decrease, the consumers' increase
    # One ex2 per score of the thread's share of the [64, block_kv] tile, and one per row for α.
    assert ops["asm:ex2.approx.ftz.f32"] == loops * (64 * tiles.block_kv // 128 + 2), ops


def test_lowering_counts_can_fail():
    """The counts above see a change of schedule: three ring slots add a TMA pair."""
    ops = _module_ops(64, False, _mosaic.ForwardTiles(stages=3))
    assert ops["stable_mosaic_gpu.nvvm.cp.async.bulk.tensor.shared.cluster.global"] == 1 + 2 * 4


def _backward_ops(h: int, causal: bool):
    q = jax.ShapeDtypeStruct((2, 1024, 4, h), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 1024, 2, h), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((2, 4, 1024), jnp.float32)
    fn = jax.jit(lambda q, k, v, o, lse, do: _mosaic_backward.backward(q, k, v, o, lse, do, scale=0.1, causal=causal))
    return mosaic_interpret.module_ops(jax.export.export(fn, platforms=["cuda"])(q, k, k, q, lse, q).mlir_module())


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("h", _mosaic_backward.HEAD_DIMS)
def test_backward_lowers_to_two_warp_specialised_kernels(h, causal):
    """The dQ kernel and the dK/dV kernel, op by op (one copy of each loop body; causal: the
    masked steps peeled into a loop of their own)."""
    stages = _mosaic_backward.BackwardTiles().stages
    dq, dkv = _backward_ops(h, causal)
    for ops in (dq, dkv):
        assert ops["stable_mosaic_gpu.nvvm.setmaxregister"] == 2, ops
    op = lambda ops, name: ops["stable_mosaic_gpu.nvvm." + name]
    loops = 2 if causal else 1
    per_step = 64 * 64 // 128  # one ex2 per probability of the thread's share of a [64, 64] tile
    # dQ: Q, dO and (lse₂, δ) once per consumer, K and V through the ring; waits: those three, K
    # and V per step, the producer's free slots (loop, last steps), causal: the epilogue's K, V.
    assert op(dq, "cp.async.bulk.tensor.shared.cluster.global") == 3 + 2 * (stages + 1), dq
    assert op(dq, "mbarrier.try_wait.parity") == 3 + 2 * loops + 2 + (2 if causal else 0), dq
    assert op(dq, "wgmma.commit.group.sync.aligned") == 3 * loops, dq  # S, dP, dQ
    assert dq["asm:ex2.approx.ftz.f32"] == per_step * loops, dq
    assert op(dq, "cp.async.bulk.tensor.global.shared.cta") == 1, dq  # dQ leaves by TMA
    # dK/dV: K and V once per consumer, Q, dO and (lse₂, δ) through the ring.
    assert op(dkv, "cp.async.bulk.tensor.shared.cluster.global") == 2 + 3 * (stages + 1), dkv
    assert op(dkv, "mbarrier.try_wait.parity") == 2 + 3 * loops + 2, dkv
    assert op(dkv, "wgmma.commit.group.sync.aligned") == 4 * loops, dkv  # Sᵀ, dV, dPᵀ, dK
    assert dkv["asm:ex2.approx.ftz.f32"] == per_step * loops, dkv
    assert op(dkv, "cp.async.bulk.tensor.global.shared.cta") == 2, dkv


# The subprocesses' reference mask: numpy [B, 1, T, S], key j visible from row r of batch row
# b (the band of jax_flash.pallas._mosaic.band, lo <= j - (r + q_offset[b]) <= hi, r below
# q_lengths[b], j below kv_lengths[b]; `extra` holds the [B] arrays a case gives), and the
# keyword arguments of the kernels for `extra`.
_BAND_MASK = r"""
def band_mask(b, t, s, causal, window, extra):
    lo, hi = (None if window[0] is None else -window[0]), (0 if causal else window[1])
    d = np.arange(s)[None, None, :] - np.arange(t)[None, :, None] - np.asarray(extra.get("q_offset", [0] * b))[:, None, None]
    vis = np.ones((b, t, s), bool)
    if lo is not None:
        vis &= d >= lo
    if hi is not None:
        vis &= d <= hi
    if "q_lengths" in extra:
        vis &= np.arange(t)[None, :, None] < np.asarray(extra["q_lengths"])[:, None, None]
    if "kv_lengths" in extra:
        vis &= np.arange(s)[None, None, :] < np.asarray(extra["kv_lengths"])[:, None, None]
    if "q_segment_ids" in extra:
        vis &= np.asarray(extra["q_segment_ids"])[:, :, None] == np.asarray(extra["kv_segment_ids"])[:, None, :]
    return vis[:, None]

def extra_args(extra):
    return {name: value if name == "soft_cap" else jnp.asarray(value, jnp.int32) for name, value in extra.items()}

def logits(scores, scale, extra):
    x = scores * scale
    cap = extra.get("soft_cap")
    return x if cap is None else cap * np.tanh(x / cap)
"""

# Segment ids, the forward's and the backward's cases alike: a segment of rows no key belongs to
# (empty rows), keys of a segment no row has, with a value head dim above the head dim (O in a
# buffer of its own), laid out so that every kernel skips steps by segment (`segment_steps`: the
# forward's and dQ's first query tile needs only the first keys, its second none; dK/dV's second
# key tile no query); packed causal self-attention with GQA.
SEGMENT_CASES = [
    (
        1,
        200,
        256,
        2,
        1,
        64,
        "bfloat16",
        False,
        0.125,
        None,
        {
            "q_segment_ids": [[0] * 100 + [1] * 28 + [2] * 72],
            "kv_segment_ids": [[0] * 100 + [1] * 28 + [3] * 128],
            "v_head_dim": 128,
        },
    ),
    (
        2,
        192,
        192,
        4,
        2,
        64,
        "float16",
        True,
        0.125,
        None,
        {"q_segment_ids": [[0] * 50 + [1] * 142, [5] * 192], "kv_segment_ids": [[0] * 50 + [1] * 142, [5] * 192]},
    ),
]

# (B, T, S, N, K, H, dtype, causal, scale, window): a ring that wraps (3 steps over 2 slots) with
# GQA; causal over two query tiles, whose first consumers see fewer steps than the CTA copies.
# Ragged: T and S one past or short of a tile (the rows past T dropped, the key tail masked);
# at H = 256 (64-key steps) a causal query tile whose rows reach past the last key step. Sliding
# windows (left, right): both edges masked, steps skipped before and after (rows whose window
# starts past a whole masked step), causal with a left edge, a right edge alone, ragged. T != S
# (top-left, as jax.nn): causal with keys no row sees, causal with rows past the last key under a
# soft cap that most logits reach (scale 0.3 at H = 128), and a window whose rows past S + left
# see no key (out 0, lse -inf; a whole CTA of them). Per batch row (the bounds operand): query
# offsets, one placing rows before every key (whole consumers and a CTA that see nothing); a
# window moved by offsets with query and key lengths cutting it; lengths alone (a batch row with
# no query, one whose rows past its query length see keys: their out must stay 0, one with no
# key). Then SEGMENT_CASES.
CASES = [
    (1, 128, 256, 2, 1, 64, "bfloat16", False, 0.125, None),
    (1, 128, 384, 4, 2, 128, "bfloat16", False, 0.3, None),
    (2, 256, 256, 1, 1, 64, "float16", True, 0.125, None),
    (1, 128, 128, 1, 1, 256, "bfloat16", True, 0.0625, None),
    (1, 129, 255, 2, 2, 64, "bfloat16", False, 0.125, None),
    (1, 127, 129, 1, 1, 128, "float16", False, 0.2, None),
    (1, 130, 130, 1, 1, 256, "bfloat16", True, 0.0625, None),
    (1, 384, 384, 2, 1, 64, "bfloat16", False, 0.125, (100, 30)),
    (1, 384, 384, 1, 1, 64, "bfloat16", True, 0.125, (70, None)),
    (1, 255, 255, 1, 1, 128, "float16", False, 0.125, (None, 5)),
    (1, 200, 200, 1, 1, 256, "bfloat16", False, 0.125, (3, 200)),
    (1, 128, 320, 2, 1, 64, "bfloat16", True, 0.125, None),
    (1, 320, 128, 1, 1, 128, "float16", True, 0.3, None, {"soft_cap": 5.0}),
    (1, 300, 100, 1, 1, 64, "bfloat16", False, 0.125, (20, 10)),
    (2, 200, 300, 2, 1, 64, "bfloat16", True, 0.125, None, {"q_offset": [100, -150]}),
    (
        2,
        190,
        250,
        2,
        2,
        128,
        "float16",
        False,
        0.2,
        (30, 40),
        {"q_offset": [60, 0], "q_lengths": [150, 190], "kv_lengths": [250, 77]},
    ),
    (3, 70, 130, 1, 1, 64, "bfloat16", False, 0.125, None, {"q_lengths": [0, 40, 70], "kv_lengths": [130, 50, 0]}),
    *SEGMENT_CASES,
]


_INTERPRET = (
    _BAND_MASK
    + r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import mosaic_interpret
params = mosaic_interpret.install()(detect_races=True)
import importlib.util
import jax, jax.numpy as jnp
# The very file the test process imported (a scratch copy under the mutation check), by path.
spec = importlib.util.spec_from_file_location("jax_flash_mosaic_under_test", sys.argv[3])
_mosaic = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = _mosaic
spec.loader.exec_module(_mosaic)

results = []
for b, t, s, n, kh, h, dtype, causal, scale, window, *extra in json.loads(sys.argv[2]):
    extra = extra[0] if extra else {}
    hv = extra.pop("v_head_dim", h)
    rng = np.random.default_rng(t + s + h)
    q, k, v = (jnp.asarray(rng.standard_normal(shape) + 0.25, dtype)
               for shape in ((b, t, n, h), (b, s, kh, h), (b, s, kh, hv)))
    window = tuple(window or (None, None))
    out, lse = _mosaic.forward(q, k, v, scale=scale, causal=causal, window=window, interpret=params, **extra_args(extra))
    out, lse = np.asarray(out.astype(jnp.float32), np.float64), np.asarray(lse, np.float64)
    qf, kf, vf = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v))
    kf, vf = np.repeat(kf, n // kh, axis=2), np.repeat(vf, n // kh, axis=2)
    x = np.where(band_mask(b, t, s, causal, window, extra), logits(np.einsum("btnh,bsnh->bnts", qf, kf), scale, extra), -np.inf)
    m = x.max(-1, keepdims=True)
    empty = m == -np.inf  # rows that see no key: out 0, lse -inf
    p = np.exp(x - np.where(empty, 0.0, m))
    l = p.sum(-1, keepdims=True)
    ref = np.einsum("bnts,bsnh->btnh", p / np.where(empty, 1.0, l), vf)
    ref_lse = (m + np.log(l))[..., 0]
    seen = ~empty[..., 0]
    results.append(dict(
        out_error=float(np.max(np.abs(out - ref)) / np.max(np.abs(ref))),
        lse_error=float(np.max(np.abs(lse - ref_lse)[seen] / np.maximum(1, np.abs(ref_lse[seen])))),
        empty_rows_exact=bool(np.all(lse[~seen] == -np.inf) and np.all(out.transpose(0, 2, 1, 3)[~seen] == 0)),
        empty_rows=int((~seen).sum()),
        nan=bool(np.isnan(out).any() or np.isnan(lse).any()),
    ))
print(json.dumps(dict(results=results, races=mosaic_interpret.races_found())))
"""
)


# Each list of interpreted cases runs in PARTS subprocesses, one test each (pytest-xdist spreads them).
PARTS = 2


def test_forward_cases_hold_empty_rows():
    """The forward's cases include rows that see no key (out 0, lse -inf), a whole CTA of them."""
    namespace: dict = {}
    exec(_BAND_MASK, {"np": np, "jnp": jnp}, namespace)
    empty = 0
    for b, t, s, _, _, _, _, causal, _, window, *extra in CASES:
        vis = namespace["band_mask"](b, t, s, causal, tuple(window or (None, None)), extra[0] if extra else {})
        empty += int((~vis.any(-1)).sum())
    assert empty > 128, empty


@pytest.mark.parametrize("part", range(PARTS))
def test_forward_interpreted_against_float64(part):
    """Each case's out within a few roundings of its 16-bit type of the float64 reference,
    lse within float32 rounding, the rows that see no key exactly out 0 and lse -inf, nothing
    left unwritten (the interpreter fills fresh memory with NaN), no race."""
    cases = CASES[part::PARTS]
    report = _interpreted(_INTERPRET, cases, _mosaic.__file__)
    for case, result in zip(cases, report["results"], strict=True):
        eps = 2.0**-8 if case[6] == "bfloat16" else 2.0**-11
        assert not result["nan"], (case, result)
        assert result["out_error"] <= 4 * eps, (case, result)
        assert result["lse_error"] <= 1e-5, (case, result)
        assert result["empty_rows_exact"], (case, result)


# The backward: (B, T, S, N, K, H, dtype, causal, scale, window): GQA with both rings wrapping (6
# key steps of the dQ kernel, 2 heads x 2 query steps of the dK/dV kernel, over 2 slots); causal
# over two tiles; ragged T and S; ragged causal with GQA; sliding windows (both edges, causal with
# a left edge, a right edge alone and ragged); T != S: causal with keys no row sees, a window
# whose rows past S + left see no key (lse -inf: their dq 0, nothing sent to dk, dv), the causal
# one under a soft cap most logits reach (dS carries the cap's slope); query offsets, and a window
# moved by offsets with query and key lengths (a batch row with no query, one whose rows past its
# query length see keys: they must send nothing, one with no key); SEGMENT_CASES.
BACKWARD_CASES = [
    (1, 128, 384, 4, 2, 128, "bfloat16", False, 0.3, None),
    (2, 256, 256, 1, 1, 64, "float16", True, 0.125, None),
    (1, 129, 255, 2, 2, 64, "bfloat16", False, 0.125, None),
    (1, 130, 130, 2, 1, 64, "bfloat16", True, 0.125, None),
    (1, 384, 384, 2, 1, 64, "bfloat16", False, 0.125, (100, 30)),
    (1, 384, 384, 1, 1, 128, "bfloat16", True, 0.125, (70, None)),
    (1, 255, 255, 1, 1, 64, "float16", False, 0.125, (None, 5)),
    (1, 128, 320, 2, 1, 64, "bfloat16", True, 0.3, None, {"soft_cap": 4.0}),
    (1, 300, 100, 1, 1, 64, "bfloat16", False, 0.125, (20, 10)),
    (2, 200, 300, 2, 1, 64, "bfloat16", True, 0.125, None, {"q_offset": [100, -150]}),
    (
        3,
        70,
        130,
        2,
        1,
        64,
        "bfloat16",
        False,
        0.125,
        (30, 40),
        {"q_offset": [0, 5, -20], "q_lengths": [0, 40, 70], "kv_lengths": [130, 50, 0]},
    ),
    *SEGMENT_CASES,
]

_INTERPRET_BACKWARD = (
    _BAND_MASK
    + r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import mosaic_interpret
params = mosaic_interpret.install()(detect_races=True)
import importlib.util
import jax, jax.numpy as jnp
spec = importlib.util.spec_from_file_location("jax_flash_mosaic_backward_under_test", sys.argv[3])
under_test = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = under_test
spec.loader.exec_module(under_test)

results = []
for b, t, s, n, kh, h, dtype, causal, scale, window, *extra in json.loads(sys.argv[2]):
    extra = extra[0] if extra else {}
    hv = extra.pop("v_head_dim", h)
    window = tuple(window or (None, None))
    rng = np.random.default_rng(t + s + h)
    q, k, v, do = (jnp.asarray(rng.standard_normal(shape) + 0.25, dtype)
                   for shape in ((b, t, n, h), (b, s, kh, h), (b, s, kh, hv), (b, t, n, hv)))
    qf, kf, vf, dof = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v, do))
    g = n // kh
    kr, vr = np.repeat(kf, g, axis=2), np.repeat(vf, g, axis=2)
    y = logits(np.einsum("btnh,bsnh->bnts", qf, kr), scale, extra)
    slope = 1.0 - (y / extra["soft_cap"]) ** 2 if "soft_cap" in extra else 1.0  # d logit / d(scale·score)
    x = np.where(band_mask(b, t, s, causal, window, extra), y, -np.inf)
    m = x.max(-1, keepdims=True)
    empty = m == -np.inf  # rows that see no key: lse -inf, P = 0
    lse = m + np.log(np.exp(x - np.where(empty, 0.0, m)).sum(-1, keepdims=True))
    p = np.exp(x - np.where(empty, 0.0, lse))
    out = np.einsum("bnts,bsnh->btnh", p, vr)
    dp = np.einsum("btnh,bsnh->bnts", dof, vr)
    ds = p * (dp - np.einsum("btnh,btnh->bnt", dof, out)[..., None]) * slope
    dq = np.einsum("bnts,bsnh->btnh", ds, kr) * scale
    dk = np.einsum("bnts,btnh->bsnh", ds, qf).reshape(b, s, kh, g, h).sum(3) * scale
    dv = np.einsum("bnts,btnh->bsnh", p, dof).reshape(b, s, kh, g, hv).sum(3)
    grads = under_test.backward(q, k, v, jnp.asarray(out, dtype), jnp.asarray(lse[..., 0], jnp.float32), do,
                                scale=scale, causal=causal, window=window, interpret=params, **extra_args(extra))
    errors = {}
    for name, got, ref in zip(("dq", "dk", "dv"), grads, (dq, dk, dv)):
        got = np.asarray(got.astype(jnp.float32), np.float64)
        errors[name] = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        errors[name + "_nan"] = bool(np.isnan(got).any())
    results.append(errors)
print(json.dumps(dict(results=results, races=mosaic_interpret.races_found())))
"""
)


@pytest.mark.parametrize("part", range(PARTS))
def test_backward_interpreted_against_float64(part):
    """dQ, dK and dV of each case within a few roundings of the 16-bit type of the float64
    gradients (given the forward's out rounded to that type), nothing unwritten, no race."""
    cases = BACKWARD_CASES[part::PARTS]
    report = _interpreted(_INTERPRET_BACKWARD, cases, _mosaic_backward.__file__)
    for case, result in zip(cases, report["results"], strict=True):
        eps = 2.0**-8 if case[6] == "bfloat16" else 2.0**-11
        for name in ("dq", "dk", "dv"):
            assert not result[name + "_nan"], (case, result)
            assert result[name] <= 4 * eps, (case, name, result)


# The wired forward (jax_flash.pallas._backend): jax_flash.attention(..., implementation="pallas",
# pallas_backend="mosaic_gpu") with the Mosaic GPU kernel interpreted and the Triton general kernel
# interpreted beside it. (B, T, S, N, K, H, causal, where a non-finite input goes: None, "v", "q",
# a sliding window (left, right) or None, and optionally the call's [B] query offset and lengths,
# its soft cap and its segment ids).
WIRED = [
    (1, 128, 256, 2, 1, 64, False, None, None),
    (1, 256, 256, 1, 1, 128, True, "v", None),
    (1, 200, 200, 2, 2, 64, False, "q", None),
    (
        1,
        256,
        256,
        2,
        1,
        64,
        False,
        None,
        (60, 10),
        {
            "query_offset": [40],
            "query_seq_lengths": [200],
            "key_value_seq_lengths": [230],
            "logits_soft_cap": 3.0,
            "segment_ids": [[[0] * 100 + [1] * 156], [[0] * 90 + [1] * 166]],
        },
    ),
]

_WIRED = r"""
import importlib.util, json, os, sys
import numpy as np
want = sys.argv[3]  # the test process's jax_flash (a scratch copy's under the mutation check)
if os.path.realpath(importlib.util.find_spec("jax_flash").origin) != os.path.realpath(want):
    sys.meta_path[:] = [f for f in sys.meta_path if "jax_flash" not in getattr(f, "known_source_files", {})
                        and "jax_flash" not in getattr(f, "known_packages", ())]
    sys.path.insert(0, os.path.dirname(os.path.dirname(want)))
sys.path.insert(0, sys.argv[1])
import mosaic_interpret
params = mosaic_interpret.install()(detect_races=True)
import jax, jax.numpy as jnp
import jax_flash
from jax_flash.pallas import _backend, _mosaic, _mosaic_backward
from jax_flash.reference import attention_reference
assert os.path.realpath(jax_flash.__file__) == os.path.realpath(want), jax_flash.__file__
_backend.INTERPRET = params
cfg = jax_flash.Config(pallas_backend="mosaic_gpu")
f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32), np.float64)
results = []
for b, t, s, n, kh, h, causal, bad, window, *extra in json.loads(sys.argv[2]):
    extra = {name: x if name == "logits_soft_cap" else jnp.asarray(x, jnp.int32)
             for name, x in (extra[0] if extra else {}).items()}
    if "segment_ids" in extra:  # (q ids [B, T], kv ids [B, S])
        extra["segment_ids"] = tuple(extra["segment_ids"])
    masking = dict(local_window_size=tuple(window)) if window else dict(is_causal=causal)
    masking.update(extra)
    band = dict(causal=causal, window=tuple(window or (None, None)), q_offset=extra.get("query_offset"),
                q_lengths=extra.get("query_seq_lengths"), kv_lengths=extra.get("key_value_seq_lengths"),
                soft_cap=extra.get("logits_soft_cap"), q_segment_ids=extra.get("segment_ids", (None, None))[0],
                kv_segment_ids=extra.get("segment_ids", (None, None))[1])
    rng = np.random.default_rng(t + s + h)
    q, k, v = (jnp.asarray(rng.standard_normal(shape) + 0.25, jnp.bfloat16)
               for shape in ((b, t, n, h), (b, s, kh, h), (b, s, kh, h)))
    if bad == "v":
        v = v.at[0, s - 56, 0, 5].set(jnp.nan)  # the rows that see that key: NaN
    if bad == "q":
        q = q.at[0, 7, 1, 0].set(jnp.inf)  # that row: NaN
    attend = lambda q, k, v: jax_flash.attention(q, k, v, **masking, implementation="pallas", config=cfg)
    out = f32(attend(q, k, v))
    ref = f32(attention_reference(q, k, v, **masking, compute_dtype=jnp.float32))
    both = np.isfinite(ref)
    result = dict(
        nan_rows_match=bool(np.array_equal(np.isnan(out), np.isnan(ref))),
        out_error=float(np.max(np.abs(out - ref)[both]) / np.max(np.abs(ref[both]))),
    )
    if bad is None:
        # The Mosaic GPU kernel's own bits: it ran, and the general kernel did not write over it.
        out_m, lse_m = _mosaic.forward(q, k, v, scale=h**-0.5, **band, interpret=params)
        result["mosaic_bits"] = bool(np.array_equal(out, f32(out_m)))
        loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * jnp.cos(jnp.arange(h)))
        ref_attend = lambda q, k, v: attention_reference(q, k, v, **masking, compute_dtype=jnp.float32)
        grads = jax.grad(loss(attend), argnums=(0, 1, 2))(q, k, v)
        ref_grads = jax.grad(loss(ref_attend), argnums=(0, 1, 2))(q, k, v)
        result["grad_error"] = max(float(np.max(np.abs(f32(g) - f32(r))) / np.max(np.abs(f32(r))))
                                   for g, r in zip(grads, ref_grads))
        # The Mosaic GPU backward's own bits, given the forward's out and lse (above) and the cotangent.
        dout = jnp.broadcast_to(jnp.cos(jnp.arange(h)), out_m.shape).astype(out_m.dtype)
        alone = _mosaic_backward.backward(q, k, v, out_m, lse_m, dout, jnp.zeros_like(lse_m),
                                          scale=h**-0.5, **band, interpret=params)
        result["mosaic_backward_bits"] = all(bool(np.array_equal(f32(g), f32(a))) for g, a in zip(grads, alone))
        # Sinks: one finite (joined after the key loop), one -inf (no sink: the call without it, bit
        # for bit); their gradient through the lse.
        sinks = jnp.array([6.0, -jnp.inf] * (n // 2), jnp.float32)  # about half of a row's weight
        sunk = lambda q, k, v, sinks: jax_flash.attention(
            q, k, v, sinks=sinks, **masking, implementation="pallas", config=cfg)
        with_sinks = f32(sunk(q, k, v, sinks))
        ref_sinks = f32(attention_reference(q, k, v, sinks=sinks, **masking, compute_dtype=jnp.float32))
        result["sinks_error"] = float(np.max(np.abs(with_sinks - ref_sinks)) / np.max(np.abs(ref_sinks)))
        result["no_sink_bits"] = bool(np.array_equal(with_sinks[:, :, 1::2], out[:, :, 1::2]))
        dsinks = jax.grad(lambda s: jnp.sum(sunk(q, k, v, s).astype(jnp.float32) ** 2))(sinks)
        ref_dsinks = jax.grad(lambda s: jnp.sum(attention_reference(
            q, k, v, sinks=s, **masking, compute_dtype=jnp.float32) ** 2))(sinks)
        result["dsinks_error"] = float(np.max(np.abs(f32(dsinks) - f32(ref_dsinks))) / np.max(np.abs(f32(ref_dsinks))))
        if "query_seq_lengths" in extra:  # the rows past it (lse = the sink's) send no gradient
            sunk_grads = jax.grad(loss(lambda q, k, v: sunk(q, k, v, sinks)), argnums=(0, 1, 2))(q, k, v)
            ref_sunk = lambda q, k, v: attention_reference(q, k, v, sinks=sinks, **masking, compute_dtype=jnp.float32)
            ref_sunk_grads = jax.grad(loss(ref_sunk), argnums=(0, 1, 2))(q, k, v)
            result["sink_grad_error"] = max(float(np.max(np.abs(f32(g) - f32(r))) / np.max(np.abs(f32(r))))
                                            for g, r in zip(sunk_grads, ref_sunk_grads))
    results.append(result)
print(json.dumps(dict(results=results, races=mosaic_interpret.races_found())))
"""


@pytest.mark.parametrize("part", range(len(WIRED)))  # one case each: each runs forward and backward
def test_wired_forward_interpreted(part):
    """jax_flash.attention's pallas on Mosaic GPU: finite inputs give the Mosaic GPU kernels' own
    bits, forward and backward (the Triton general kernels, gated off, leave them), and the
    gradients match the reference, with sinks too (a -inf one: the call without it, bit for bit;
    with a query length, the rows past it send no gradient); a query offset, lengths and a soft
    cap reach the kernels; a NaN in v or an inf in q goes to the general
    kernel, whose NaN rows are the reference's, the other rows within a few roundings."""
    cases = WIRED[part : part + 1]
    report = _interpreted(_WIRED, cases, jax_flash.__file__)
    for case, result in zip(cases, report["results"], strict=True):
        assert result["nan_rows_match"], (case, result)
        assert result["out_error"] <= 4 * 2.0**-8, (case, result)
        if case[7] is None:
            assert result["mosaic_bits"], (case, result)
            assert result["grad_error"] <= 4 * 2.0**-8, (case, result)
            assert result["mosaic_backward_bits"], (case, result)
            assert result["sinks_error"] <= 4 * 2.0**-8 and result["no_sink_bits"], (case, result)
            assert result["dsinks_error"] <= 4 * 2.0**-8, (case, result)
            if len(case) > 9 and "query_seq_lengths" in case[9]:
                assert result["sink_grad_error"] <= 4 * 2.0**-8, (case, result)


def test_segment_steps_hold_every_step_a_row_sees():
    """`_mosaic.segment_steps` against loops over the ids: per tile, [first, last) spans exactly
    the steps whose real ids' range meets the tile's real rows' (so every step with a key of a
    row's segment), (0, 0) where none does; unsorted ids, ragged lengths, padding of other ids.
    And the SEGMENT_CASES layout skips what its comment says."""
    rng = np.random.default_rng(7)
    for _ in range(30):
        rows, block = int(rng.choice([4, 8])), int(rng.choice([2, 4]))
        tiles, steps = int(rng.integers(1, 5)), int(rng.integers(1, 7))
        t, s = int(rng.integers(1, tiles * rows + 1)), int(rng.integers(1, steps * block + 1))
        q_ids = rng.integers(0, 6, (2, tiles * rows)).astype(np.int32)
        kv_ids = rng.integers(3, 9, (2, steps * block)).astype(np.int32)
        got = np.asarray(_mosaic.segment_steps(jnp.asarray(q_ids), jnp.asarray(kv_ids), rows, block, t, s))
        for b in range(2):
            for tile in range(tiles):
                r = q_ids[b, tile * rows : min((tile + 1) * rows, t)]
                meets = []
                for j in range(steps):
                    c = kv_ids[b, j * block : min((j + 1) * block, s)]
                    meets.append(r.size > 0 and c.size > 0 and c.max() >= r.min() and c.min() <= r.max())
                    shares = r.size > 0 and bool(np.isin(c, r).any())
                    assert not shares or meets[-1], (b, tile, j)
                hit = [j for j, m in enumerate(meets) if m]
                want = (hit[0], hit[-1] + 1) if hit else (0, 0)
                assert tuple(got[b, tile]) == want, (b, tile, got[b, tile], want, r, kv_ids[b])
    case = SEGMENT_CASES[0][10]
    q_ids = jnp.pad(jnp.asarray(case["q_segment_ids"], jnp.int32), ((0, 0), (0, 56)))  # 200 rows to 256
    kv_ids = jnp.asarray(case["kv_segment_ids"], jnp.int32)
    forward = _mosaic.segment_steps(q_ids, kv_ids, 128, 128, 200, 256)
    assert np.asarray(forward).tolist() == [[[0, 1], [0, 0]]]
    dkv = _mosaic.segment_steps(kv_ids, q_ids, 128, 64, 256, 200)
    assert np.asarray(dkv).tolist() == [[[0, 2], [0, 0]]]


@pytest.mark.parametrize("causal", [False, True])
def test_band_is_clipped_for_any_window_size(causal):
    """A window as wide as int32 allows sees what an unbounded one sees: the band is clipped to
    [-T, S] of the padded lengths, so the kernels' step arithmetic (r0 + rows + hi) cannot wrap
    around."""
    t, s, huge = 384, 256, 2**31 - 1  # T = 300, S = 200 padded to whole tiles
    lo, hi = _mosaic.band(causal, huge, huge, t, s)
    assert (lo, hi) == (-t, 0 if causal else s)
    for r0 in (0, 128, 256):
        got = _mosaic.visible_steps(lo, hi, s, jnp.int32(r0), 64, 128, 2)
        want = _mosaic.visible_steps(None, 0 if causal else None, s, jnp.int32(r0), 64, 128, 2)
        assert [int(x) for x in got] == [int(x) for x in want], (r0, got, want)
