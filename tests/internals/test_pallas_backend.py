"""Which compiler a `pallas` forward goes through (`Config.pallas_backend`, jax_flash/pallas/_backend.py):
the rule, its refusals with their reasons, `explain`'s words, and the wired forward lowered for
the `cuda` platform on a CPU (the Mosaic GPU plain kernel and the Triton general kernel, gated,
no conditional). tests/internals/test_pallas_mosaic.py runs the wired forward interpreted.

The architecture is stubbed (`_registry.device_arch`): the rule is a pure function of it, the
call and the measured table.
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import _heuristics, _registry, pallas
from jax_flash._spec import AttentionSpec, MaskInputs
from jax_flash.pallas import _backend

MOSAIC = jax_flash.Config(pallas_backend="mosaic_gpu")


def _spec(config=MOSAIC, h=128, t=8192, s=8192, causal=False, dtype="bfloat16", **kw):
    base = dict(
        batch=2,
        q_len=t,
        kv_len=s,
        num_heads=16,
        num_kv_heads=8,
        head_dim=h,
        dtype=dtype,
        scale=h**-0.5,
        window_left=None,
        window_right=0 if causal else None,
        config=jax_flash.current_config(config),  # resolved, as a call's spec holds it
    )
    base.update(kw)
    return AttentionSpec(**base)


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setattr(_registry, "device_arch", lambda: "sm_90")
    monkeypatch.setattr(_registry, "measured_entries", list)


def test_forced_mosaic_serves_plain_calls(sm90):
    for spec in (
        _spec(),
        _spec(causal=True, h=64),
        _spec(h=256, t=1000, s=1000, dtype="float16"),
        _spec(window_left=256, window_right=0),
        _spec(window_left=100, window_right=30, has_sinks=True),
        _spec(q_len=100, window_right=0),
        _spec(q_len=100, window_left=128, window_right=0),
        _spec(has_q_lengths=True, has_kv_lengths=True),
        _spec(has_q_offset=True, window_right=0, has_kv_lengths=True),
        _spec(soft_cap=30.0, causal=True),
        _spec(has_segment_ids=True, causal=True),
        _spec(value_head_dim=64),
    ):
        assert _backend.choose(spec)[0] == "mosaic_gpu", spec


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(bias_shape=(1, 1, 8192, 8192)), "a dense bias"),
        (dict(mask_shape=(1, 1, 8192, 8192)), "a dense mask"),
        (dict(dropout_rate=0.1), "dropout"),
        (dict(value_head_dim=96), "a value head dim 96"),
        (dict(head_dim=96, scale=0.1), "head dim 96"),
        (dict(dtype="float32"), "dtype float32"),
        (dict(scale=0.0), "a scale outside"),
    ],
)
def test_forced_mosaic_refuses_what_it_cannot_serve(sm90, change, words):
    spec = _spec(**change)
    with pytest.raises(ValueError, match=re.escape(words)):
        _backend.choose(spec)
    assert words in pallas.IMPLEMENTATION.unsupported(spec)  # implementation="pallas" names it too
    # auto takes Triton for it, saying why.
    backend, why = _backend.choose(_spec(config=jax_flash.Config(pallas_backend="auto"), **change))
    assert backend == "triton" and words in why


def test_mosaic_needs_sm90():
    """Off sm_90 (here: a CPU), forced Mosaic GPU is an error naming the platform; auto is Triton."""
    with pytest.raises(ValueError, match="runs on sm_90 GPUs only, not on the cpu platform"):
        _backend.choose(_spec())
    assert _backend.choose(_spec(config=jax_flash.Config()))[0] == "triton"
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="runs on sm_90 GPUs only"):
        jax_flash.attention(q, q, q, implementation="pallas", config=MOSAIC)


def _entry(times, pass_="fwd", **cls):
    c = dict(head_dim=128, causal=False, seq="<=8k", decode=False)
    c.update(cls)
    return dict(arch="sm_90", device="NVIDIA H100", date="2026-12-06", jax="0.11.2", source="test", **{"class": c})


def test_auto_takes_mosaic_where_measured_faster(monkeypatch):
    monkeypatch.setattr(_registry, "device_arch", lambda: "sm_90")
    auto = jax_flash.Config(pallas_backend="auto")
    faster = dict(_entry(None), times_ms={"pallas": 3.0, "pallas-mosaic": 2.0, "cuda": 2.5}, **{"pass": "fwd"})
    slower = dict(faster, times_ms={"pallas": 3.0, "pallas-mosaic": 4.0})
    monkeypatch.setattr(_registry, "measured_entries", lambda: [faster])
    backend, why = _backend.choose(_spec(config=auto))
    assert backend == "mosaic_gpu" and "1.50x Triton's speed" in why and "NVIDIA H100" in why
    assert _backend.choose(_spec(config=jax_flash.Config(pallas_backend="triton")))[0] == "triton"
    assert _backend.choose(_spec(config=auto, h=64))[0] == "triton"  # another class: not measured
    # implementation=None counts the faster of the two as pallas's time.
    order, _ = _heuristics.measured_choice(_spec(config=auto), "sm_90", [faster])
    assert order == ("pallas", "cuda")
    monkeypatch.setattr(_registry, "measured_entries", lambda: [slower])
    backend, why = _backend.choose(_spec(config=auto))
    assert backend == "triton" and "0.75x Triton's speed" in why


def test_explain_names_the_backend(sm90):
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    text = str(jax_flash.explain(q, q, q, implementation="pallas", config=MOSAIC, verbose=True))
    assert "forward on Mosaic GPU" in text and "FlashAttention-3's schedule" in text
    assert "backward on Mosaic GPU too" in text
    q256 = jnp.zeros((1, 128, 2, 256), jnp.bfloat16)
    text = str(jax_flash.explain(q256, q256, q256, implementation="pallas", config=MOSAIC, verbose=True))
    assert "backward on Triton (the Mosaic GPU backward does not serve head dim 256 in the backward" in text
    text = str(jax_flash.explain(q, q, q, implementation="pallas", verbose=True))
    assert "forward compiled by Triton" in text and "no device run on sm_90 measured" in text


def test_wired_forward_lowers_without_a_conditional(sm90):
    """The Mosaic GPU plain kernel and the Triton general kernel, each gated, no case/if; ragged
    T too (its padded copy)."""
    for t, causal in ((256, True), (200, False)):
        spec = _spec(t=t, s=t, num_heads=2, num_kv_heads=1, batch=1, causal=causal)
        q = jax.ShapeDtypeStruct((1, t, 2, 128), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((1, t, 1, 128), jnp.bfloat16)
        fn = jax.jit(lambda q, k, v, spec=spec: pallas.forward(spec, q, k, v, MaskInputs(), interpret=False))
        text = fn.trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
        calls = collections.Counter(re.findall(r"custom_call @([A-Za-z0-9_$.]+)", text))
        assert calls == {"mosaic_gpu_v2": 1, "__gpu$xla.gpu.triton": 1}, calls
        assert "jax_flash_fwd" in text and "jax_flash_fwd_plain" not in text
        assert "stablehlo.case" not in text and "stablehlo.if" not in text


def test_wired_backward_lowers_without_a_conditional(sm90):
    """The gradient of a Mosaic GPU call: the forward's two kernels and the backward's Mosaic GPU dQ
    and dK/dV kernels beside Triton's general two, each gated, no case/if."""
    spec = _spec(t=256, s=256, num_heads=2, num_kv_heads=1, batch=1, causal=True)
    q = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 256, 1, 128), jnp.bfloat16)

    def fwd_bwd(q, k, v):
        out, lse = pallas.forward(spec, q, k, v, MaskInputs(), interpret=False)
        return pallas.backward(spec, q, k, v, MaskInputs(), out, lse, out, lse, interpret=False)

    text = jax.jit(fwd_bwd).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    calls = collections.Counter(re.findall(r"custom_call @([A-Za-z0-9_$.]+)", text))
    assert calls == {"mosaic_gpu_v2": 3, "__gpu$xla.gpu.triton": 3}, calls
    assert "stablehlo.case" not in text and "stablehlo.if" not in text


def test_wired_forward_lowering_can_fail(sm90):
    """The check above sees the Triton route: forced Triton lowers two Triton kernels, no Mosaic."""
    spec = _spec(config=jax_flash.Config(pallas_backend="triton"), t=256, s=256, num_heads=2, num_kv_heads=1, batch=1)
    q = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 256, 1, 128), jnp.bfloat16)
    fn = jax.jit(lambda q, k, v: pallas.forward(spec, q, k, v, MaskInputs(), interpret=False))
    text = fn.trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert collections.Counter(re.findall(r"custom_call @([A-Za-z0-9_$.]+)", text)) == {"__gpu$xla.gpu.triton": 2}
