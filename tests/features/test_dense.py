"""The CUDA kernels' dense bias and mask (emulated here, the same source on a GPU): every way
the main backward kernel writes dbias (cuda/kernels/bias.h) and every kernel that reads them.

- dbias by store (a full-size bias), by owned add (broadcast over T only: one thread sums its
  query blocks), and by atomics after the in-warp sums over T, S or both (broadcast over B, N
  or S); in deterministic mode the [B, N, Tb, S] workspace and its fixed-order sum;
- both backward grids (kv_heads: a CTA loops over its group's query heads; q_heads: one
  head per CTA), the deterministic dQ kernel, H = 192 (two warps share each 16 keys: one of
  them writes dbias) and Hv != H;
- deterministic mode gives the same bits under two orders of the CTAs and warps (the
  emulation's shuffled and reversed schedules).

Shapes are ragged at the kernels' tiles (128 query rows forward, 64 keys backward; 32 keys at
H = 192) and held to the shared tolerance against the float64 reference (test_dense_bias).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cases import Shape
from test_dense_bias import BiasCase, _compare, _inputs


def _cuda_or_skip():
    import jax_flash

    q = jnp.zeros((1, 1, 1, 32), jnp.bfloat16)
    why = jax_flash.explain(q, q, q, implementation="cuda").reasons["cuda"]
    if why is not None:
        pytest.skip(f"cuda: {why}")


SHAPE = Shape(2, 33, 65, 4, 2, 32)  # GQA, T = 32 + 1, S = 64 + 1
BROADCASTS = [
    # (bias dims, mask dims, structured masks, what dbias exercises)
    ("BNTS", None, "causal"),        # store
    ("BN1S", "B11S", "window"),      # owned add (T summed in the quad, query blocks in order)
    ("1N1S", None, "none"),          # ALiBi: atomics after the sum over T
    ("B1T1", "1NTS", "softcap"),     # atomics after the sum over S (8 lanes of a column)
    ("1111", None, "causal"),        # atomics after the sum over the whole warp
    ("1NTS", "BNTS", "none"),        # T5: atomics per element (summed over B)
]
# Deterministic mode differs where dbias needs atomics: the workspace with B, N and S at full
# size (store or owned add into it), then the fixed-order sum (a bias full over B, N and S is
# written the same way in both modes).
CASES = [pytest.param(*b, "kv_heads", id=f"{b[0]}-kv_heads") for b in BROADCASTS] + [
    pytest.param(*b, "q_heads_deterministic", id=f"{b[0]}-q_heads_deterministic")
    for b in BROADCASTS if b[0] in ("1N1S", "B1T1", "1111", "1NTS")]


@pytest.mark.parametrize("bias_dims, mask_dims, kind, mode", CASES)
def test_dbias_every_write(bias_dims, mask_dims, kind, mode, monkeypatch):
    _cuda_or_skip()
    if mode == "q_heads_deterministic":
        monkeypatch.setenv("JAX_FLASH_CUDA_BWD_GRID", "q_heads")
        monkeypatch.setenv("JAX_FLASH_DETERMINISTIC", "1")
    else:
        monkeypatch.setenv("JAX_FLASH_CUDA_BWD_GRID", "kv_heads")
    dtype = "float16" if bias_dims in ("B1T1", "1111") else "bfloat16"
    case = BiasCase(bias_dims, SHAPE, dtype, bias_dims, "float32", mask_dims, kind)
    _compare("cuda", *_inputs(case))


@pytest.mark.parametrize(
    "shape, bias_dims",
    [
        pytest.param(Shape(1, 17, 33, 2, 1, 192), "1NTS", id="h192"),  # 32 keys per CTA, 2 warps per 16
        pytest.param(Shape(1, 17, 33, 2, 2, 192, 128), "BN1S", id="h192_hv128"),
    ],
)
def test_wide_heads(shape, bias_dims, monkeypatch):
    _cuda_or_skip()
    monkeypatch.setenv("JAX_FLASH_DETERMINISTIC", "1")
    case = BiasCase("wide", shape, "bfloat16", bias_dims, "bfloat16", "11TS", "causal")
    _compare("cuda", *_inputs(case))


@pytest.mark.parametrize(
    "shape, bias_dims",
    [
        # S = 1: every warp of the CTA maps to dbias' one column; only the warp that holds the key
        # may store it (T = 1 too: the whole warp's sum).
        pytest.param(Shape(1, 1, 1, 2, 1, 32), "1N11", id="t1_s1_store"),
        pytest.param(Shape(2, 33, 1, 2, 2, 32), "BN11", id="s1_owned_add"),
        pytest.param(Shape(2, 1, 65, 2, 1, 32), "BNTS", id="t1_store"),
    ],
)
def test_single_query_or_key(shape, bias_dims):
    # Each bias is full over B, N and S (S = 1 is full): written the same in both modes.
    _cuda_or_skip()
    case = BiasCase("one", shape, "bfloat16", bias_dims, "float32", None, "none")
    _compare("cuda", *_inputs(case))


def test_deterministic_reruns_are_bitwise(monkeypatch):
    """Two orders of the CTAs and warps (the emulation reads its schedule at each launch): the
    atomics' sums differ in their last bits, deterministic mode's do not."""
    _cuda_or_skip()
    import jax_flash
    from test_dense_bias import run

    case = BiasCase("rerun", SHAPE, "bfloat16", "11T1", "float32", None, "causal")
    q, k, v, bias, kw, cot, dlse = _inputs(case)

    def dbias_under(schedule):
        monkeypatch.setenv("JAX_FLASH_EMU_SCHEDULE", schedule)
        return np.asarray(run(jax_flash.attention, q, k, v, bias, kw, cot, dlse, implementation="cuda")[5])

    atomic = [dbias_under(s) for s in ("shuffle:1", "reverse")]
    assert not np.array_equal(*atomic), "the two schedules do not change the order of the atomics"
    monkeypatch.setenv("JAX_FLASH_DETERMINISTIC", "1")
    fixed = [dbias_under(s) for s in ("shuffle:1", "reverse")]
    np.testing.assert_array_equal(*fixed)
