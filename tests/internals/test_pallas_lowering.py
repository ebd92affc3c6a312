"""The Pallas kernels lower to Triton for the `cuda` platform, checked on any machine.

Lowering the jitted forward and backward with `lowering_platforms=("cuda",)` runs the whole
Pallas -> Triton IR translation without a GPU, so a shape or op Triton rejects fails CI
instead of a user's first GPU run. Every (head dim, dtype) entry of the tile table is
lowered, causal and not, plus every optional input at one configuration.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flash import pallas
from jax_flash._spec import AttentionSpec, MaskInputs
from jax_flash.pallas._table import DTYPES, TABLE

TRITON_CALL = "__gpu$xla.gpu.triton"
KERNELS = ("jax_flash_fwd", "jax_flash_bwd_dkdv", "jax_flash_bwd_dq")


def _spec(h, dtype, causal=False, **kw):
    base = dict(
        batch=1,
        q_len=200,
        kv_len=300,
        num_heads=4,
        num_kv_heads=2,
        head_dim=h,
        dtype=dtype,
        scale=h**-0.5,
        window_left=None,
        window_right=0 if causal else None,
    )
    base.update(kw)
    return AttentionSpec(**base)


def _lowered_text(spec: AttentionSpec, masks: MaskInputs) -> str:
    dt = jnp.dtype(spec.dtype)
    b, t, s, n, kh, h = (spec.batch, spec.q_len, spec.kv_len, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    q = jax.ShapeDtypeStruct((b, t, n, h), dt)
    kv = jax.ShapeDtypeStruct((b, s, kh, h), dt)

    def fwd_bwd(q, k, v, masks):
        out, lse = pallas.forward(spec, q, k, v, masks, interpret=False)
        grads = pallas.backward(spec, q, k, v, masks, out, lse, out, lse, interpret=False)
        return out, lse, grads

    lowered = jax.jit(fwd_bwd).trace(q, kv, kv, masks).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


def _check(text: str):
    assert text.count(TRITON_CALL) >= 3, "expected three Triton custom calls (fwd, dK/dV, dQ)"
    for name in KERNELS:
        assert name in text, f"kernel {name} missing from the lowered module"


HEAD_DIMS = sorted({h for h, _, _ in TABLE})


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_table_entries_lower(head_dim, dtype, causal):
    _check(_lowered_text(_spec(head_dim, dtype, causal), MaskInputs()))


def test_unpadded_head_dim_lowers():
    _check(_lowered_text(_spec(40, "bfloat16", True), MaskInputs()))


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


MASK_CASES = {
    "window": (dict(window_left=7, window_right=3), {}),
    "lengths": (
        dict(has_q_lengths=True, has_kv_lengths=True),
        dict(q_lengths=_sds((2,), np.int32), kv_lengths=_sds((2,), np.int32)),
    ),
    "segments": (
        dict(has_segment_ids=True),
        dict(q_segment_ids=_sds((2, 200), np.int32), kv_segment_ids=_sds((2, 300), np.int32)),
    ),
    "softcap_bias": (dict(soft_cap=5.0, bias_shape=(2, 1, 200, 300)), dict(bias=_sds((2, 1, 200, 300), np.float32))),
    "key_bias": (dict(bias_shape=(1, 4, 1, 300)), dict(bias=_sds((1, 4, 1, 300), np.float32))),
    "mask": (dict(mask_shape=(2, 4, 200, 300)), dict(mask=_sds((2, 4, 200, 300), np.bool_))),
    "row_mask": (dict(mask_shape=(1, 1, 200, 1)), dict(mask=_sds((1, 1, 200, 1), np.bool_))),
    # A runtime query offset per batch row moves the band (and the skipped tiles); a huge
    # window exercises the saturating band arithmetic.
    "offset_window": (dict(window_left=7, window_right=3, has_q_offset=True), dict(q_offset=_sds((2,), np.int32))),
    "offset_huge_window": (
        dict(window_left=2**31 - 1, window_right=2**33, has_q_offset=True),
        dict(q_offset=_sds((2,), np.int32)),
    ),
    # G = 1: one dK/dV program per kv head, no partial sums.
    "mha_bias": (dict(num_kv_heads=4, bias_shape=(2, 4, 200, 300)), dict(bias=_sds((2, 4, 200, 300), np.float32))),
}


@pytest.mark.parametrize("kind", list(MASK_CASES))
def test_optional_inputs_lower(kind):
    spec_kw, mask_kw = MASK_CASES[kind]
    spec = _spec(128, "bfloat16", causal=kind == "segments", batch=2, **spec_kw)
    _check(_lowered_text(spec, MaskInputs(**mask_kw)))


def test_table_complete():
    from jax_flash.pallas._table import HEAD_DIMS as TABLE_HEAD_DIMS, PASSES

    for h in TABLE_HEAD_DIMS:
        for dtype in DTYPES:
            for pass_ in PASSES:
                c = TABLE[(h, dtype, pass_)]
                for block in (c.block_q, c.block_k):
                    assert block >= 16 and block & (block - 1) == 0, (h, dtype, pass_, c)
                assert c.num_warps in (1, 2, 4, 8, 16) and c.num_stages >= 1


def test_gpu_tiles_interpreted(monkeypatch):
    """The GPU table's tiles (not the small interpret-mode ones), run interpreted.

    On a GPU the shared suite runs these tiles for real; this covers them on a CPU.
    """
    if jax.default_backend() != "cpu":
        pytest.skip("interpret-mode check; on a GPU the shared suite runs the real kernels")
    from jax_flash import xla
    from jax_flash.pallas import _table

    for pass_ in _table.PASSES:
        monkeypatch.setitem(_table.INTERPRET_CONFIG, pass_, TABLE[(64, "bfloat16", pass_)])
    spec = _spec(64, "float32", causal=True, q_len=130, kv_len=200, bias_shape=(1, 4, 130, 200))
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    q = jax.random.normal(keys[0], (1, 130, 4, 64), jnp.float32)
    k = jax.random.normal(keys[1], (1, 200, 2, 64), jnp.float32)
    v = jax.random.normal(keys[2], (1, 200, 2, 64), jnp.float32)
    masks = MaskInputs(bias=jax.random.normal(keys[3], (1, 4, 130, 200), jnp.float32))
    do = jax.random.normal(keys[4], q.shape, jnp.float32)

    def run(impl):
        out, lse = impl.forward(spec, q, k, v, masks)
        return (out, lse, *impl.backward(spec, q, k, v, masks, out, lse, do, lse))

    got = jax.jit(lambda: run(pallas))()
    want = jax.jit(lambda: run(xla))()
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias"), got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-4, rtol=2e-4, err_msg=name)


@pytest.mark.parametrize("dense_bytes", [0, 5])
def test_tiles_fit_shared_memory(dense_bytes):
    """sm_90's table is unchanged there, except that with a dense bias and mask (5 bytes per
    element, double-buffered) the 128 x 128 forward tiles at H = 64 and 128 (16 bits) take 64
    keys; on 99 KB / 163 KB GPUs every entry shrinks to fit."""
    from jax_flash.pallas._table import fit, smem_budget, smem_estimate

    assert smem_budget(None) is None
    for (h, dtype, pass_), cfg in TABLE.items():
        got = fit(cfg, h, dtype, pass_, smem_budget((9, 0)), dense_bytes)
        if dense_bytes and pass_ == "fwd" and h in (64, 128) and dtype != "float32":
            assert (cfg.block_q, cfg.block_k) == (128, 128) and got == dataclasses.replace(cfg, block_k=64), got
        else:
            assert got == cfg, (h, dtype, pass_, got)
        assert smem_estimate(got, h, dtype, pass_, dense_bytes) <= smem_budget((9, 0))
        for cc in ((12, 0), (8, 6), (8, 0)):
            budget = smem_budget(cc)
            small = fit(cfg, h, dtype, pass_, budget, dense_bytes)
            assert smem_estimate(small, h, dtype, pass_, dense_bytes) <= budget, (h, dtype, small)
            assert min(small.block_q, small.block_k) >= 16
