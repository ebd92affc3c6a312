"""The Mosaic GPU forward (jax_flash/pallas/_mosaic.py) on a GPU: build/device_check.sh's mosaic step.

    python build/mosaic_check.py              # on an sm_90 GPU
    python build/mosaic_check.py --dry-run    # on a CPU: lower each case for cuda, say it lowered

On the GPU, first correctness: the kernel's out and lse against jax_flash.reference (float32) at
B = 1, T = S = 1024, N = 4 over K = 2, bf16, H = 64 and 128, causal or not. Then speed: the
forward at B = 2, N = 16, T = S = 8192, bf16, H = 64 and 128, causal or not, beside cuDNN
(jax.nn.dot_product_attention(implementation="cudnn")), JAX's own FlashAttention-3 kernel
(jax.experimental.pallas.ops.gpu.attention_mgpu, where it imports) and the cuda forward, in the
same process: the median of 10 timed calls after 2 untimed, as ms, TFLOP/s (4·B·N·T·S·H,
halved when causal) and the ratio to cuDNN; then the wired path
(jax_flash.attention(implementation="pallas") with pallas_backend="mosaic_gpu") against the
reference on finite inputs, gradients included, and with a NaN in v; then the features beyond
the band (a query offset, lengths, a soft cap, segment ids, Hv != H) through jax_flash.attention,
forward and gradients against the reference; then, at H = 128 non-causal, other tiles (keys per
step, ring slots) than the default. One JSON line per result; a failure is a result.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax_flash
from jax_flash.pallas import _mosaic


def emit(**fields):
    print(json.dumps(fields), flush=True)


def median_seconds(fn, *args) -> float:
    """The median of 10 timed calls of jit(fn), after 2 untimed."""
    f = jax.jit(fn)
    for _ in range(2):
        jax.block_until_ready(f(*args))
    runs = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def correctness():
    for h in (64, 128):
        for causal in (False, True):
            keys = jax.random.split(jax.random.PRNGKey(h + causal), 3)
            q = jax.random.normal(keys[0], (1, 1024, 4, h), jnp.bfloat16)
            k, v = (jax.random.normal(key, (1, 1024, 2, h), jnp.bfloat16) for key in keys[1:])
            scale = 1 / math.sqrt(h)
            try:
                fn = jax.jit(
                    lambda q, k, v, scale=scale, causal=causal: _mosaic.forward(q, k, v, scale=scale, causal=causal)
                )
                out, lse = fn(q, k, v)
                ref, ref_lse = jax_flash.reference(
                    q, k, v, is_causal=causal, scale=scale, return_residual=True, compute_dtype=jnp.float32
                )
                err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
                lse_err = float(jnp.max(jnp.abs(lse - ref_lse) / jnp.maximum(1, jnp.abs(ref_lse))))
                ok = bool(err <= 2.0**-6 and lse_err <= 1e-4)
                emit(check="mosaic_forward", h=h, causal=causal, max_rel_error=err, lse_error=lse_err, ok=ok)
            except Exception as e:  # a result, not a crash
                emit(check="mosaic_forward", h=h, causal=causal, ok=False, error=str(e)[:300])


def wired():
    """jax_flash.attention(..., implementation="pallas", pallas_backend="mosaic_gpu"): finite inputs
    (the Mosaic GPU forward, Triton's backward) and a NaN in v (Triton's general forward) against
    the reference, NaN rows and gradients included."""
    cfg = jax_flash.Config(pallas_backend="mosaic_gpu")
    keys = jax.random.split(jax.random.PRNGKey(7), 3)
    q = jax.random.normal(keys[0], (1, 1024, 4, 128), jnp.bfloat16)
    k, v = (jax.random.normal(key, (1, 1024, 2, 128), jnp.bfloat16) for key in keys[1:])
    for bad in (False, True):
        v_in = v.at[0, 700, 1, 3].set(jnp.nan) if bad else v
        try:
            attend = lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True, implementation="pallas", config=cfg)
            refer = lambda q, k, v: jax_flash.reference(q, k, v, is_causal=True, compute_dtype=jnp.float32)
            out, ref = jax.jit(attend)(q, k, v_in).astype(jnp.float32), refer(q, k, v_in)
            finite = jnp.isfinite(ref)
            nan_rows = bool(jnp.array_equal(jnp.isnan(out), jnp.isnan(ref)))
            err = float(jnp.max(jnp.where(finite, jnp.abs(out - ref), 0)) / jnp.max(jnp.where(finite, jnp.abs(ref), 0)))
            fields = dict(nan_rows_match=nan_rows, max_rel_error=err)
            ok = nan_rows and err <= 2.0**-6
            if not bad:
                loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2)
                grads = jax.jit(jax.grad(loss(attend), argnums=(0, 1, 2)))(q, k, v)
                refs = jax.grad(loss(refer), argnums=(0, 1, 2))(q, k, v)
                gerr = max(
                    float(jnp.max(jnp.abs(g.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
                    for g, r in zip(grads, refs)
                )
                fields["grad_max_rel_error"] = gerr
                ok = ok and gerr <= 2.0**-5
            emit(check="pallas_mosaic_wired", nan_in_v=bad, ok=bool(ok), **fields)
        except Exception as e:  # a result, not a crash
            emit(check="pallas_mosaic_wired", nan_in_v=bad, ok=False, error=str(e)[:300])


# The features the Mosaic GPU kernels serve beyond the plain band, through jax_flash.attention:
# (name, B, T, S, N, K, H, Hv, the call's keywords as numpy-free Python values).
FEATURES = [
    (
        "offset_lengths_soft_cap",
        2,
        384,
        512,
        4,
        2,
        128,
        128,
        dict(
            is_causal=True,
            query_offset=[128, -64],
            query_seq_lengths=[384, 200],
            key_value_seq_lengths=[512, 300],
            logits_soft_cap=20.0,
        ),
    ),
    (
        "segments_hv64",
        1,
        512,
        512,
        4,
        2,
        128,
        64,
        dict(is_causal=True, segment_ids=[[0] * 200 + [1] * 250 + [2] * 62]),
    ),
]


def _feature_kwargs(kwargs: dict) -> dict:
    out = {}
    for name, value in kwargs.items():
        if name in ("query_offset", "query_seq_lengths", "key_value_seq_lengths", "segment_ids"):
            value = jnp.asarray(value, jnp.int32)
        out[name] = value
    return out


def _squares(fn):
    """The loss whose gradients the checks compare: the sum of fn's squared outputs."""
    return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2)


def features():
    """jax_flash.attention on Mosaic GPU with a query offset, lengths, a soft cap, segment ids and
    Hv != H: out and the gradients against the reference (float32)."""
    cfg = jax_flash.Config(pallas_backend="mosaic_gpu")
    for name, b, t, s, n, kh, h, hv, kwargs in FEATURES:
        keys = jax.random.split(jax.random.PRNGKey(len(name)), 3)
        q = jax.random.normal(keys[0], (b, t, n, h), jnp.bfloat16)
        k = jax.random.normal(keys[1], (b, s, kh, h), jnp.bfloat16)
        v = jax.random.normal(keys[2], (b, s, kh, hv), jnp.bfloat16)
        kw = _feature_kwargs(kwargs)
        try:
            attend = lambda q, k, v, kw=kw: jax_flash.attention(q, k, v, **kw, implementation="pallas", config=cfg)
            refer = lambda q, k, v, kw=kw: jax_flash.reference(q, k, v, **kw, compute_dtype=jnp.float32)
            out, ref = jax.jit(attend)(q, k, v).astype(jnp.float32), refer(q, k, v)
            err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
            grads = jax.jit(jax.grad(_squares(attend), argnums=(0, 1, 2)))(q, k, v)
            refs = jax.grad(_squares(refer), argnums=(0, 1, 2))(q, k, v)
            gerr = max(
                float(jnp.max(jnp.abs(g.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r))) for g, r in zip(grads, refs)
            )
            ok = bool(err <= 2.0**-6 and gerr <= 2.0**-5 and jnp.isfinite(out).all())
            emit(check="pallas_mosaic_features", case=name, max_rel_error=err, grad_max_rel_error=gerr, ok=ok)
        except Exception as e:  # a result, not a crash
            emit(check="pallas_mosaic_features", case=name, ok=False, error=str(e)[:300])


def peers(causal: bool, h: int) -> dict:
    scale = 1 / math.sqrt(h)
    fns = {
        "mosaic": lambda q, k, v: _mosaic.forward(q, k, v, scale=scale, causal=causal)[0],
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"),
    }
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu

        config = attention_mgpu.TuningConfig(
            block_q=64, block_kv=128 if h <= 128 else 64, max_concurrent_steps=2, causal=causal
        )
        fns["jax_attention_mgpu"] = lambda q, k, v: attention_mgpu.attention(q, k, v, config)
    except Exception as e:
        emit(peer="jax_attention_mgpu", status=f"does not import: {str(e)[:200]}")
    fns["cuda"] = lambda q, k, v: jax_flash.attention(q, k, v, is_causal=causal, implementation="cuda")
    return fns


def speed():
    b, n, t, dtype = 2, 16, 8192, jnp.bfloat16
    for h in (128, 64):
        keys = jax.random.split(jax.random.PRNGKey(0), 3)
        q, k, v = (jax.random.normal(key, (b, t, n, h), dtype) for key in keys)
        for causal in (False, True):
            flops = 4 * b * n * t * t * h / (2 if causal else 1)
            times = {}
            for name, fn in peers(causal, h).items():
                try:
                    times[name] = median_seconds(fn, q, k, v)
                except Exception as e:
                    emit(bench="forward", impl=name, h=h, causal=causal, status=f"failed: {str(e)[:200]}")
            for name, sec in times.items():
                emit(
                    bench="forward",
                    impl=name,
                    h=h,
                    causal=causal,
                    ms=round(sec * 1e3, 3),
                    tflops=round(flops / sec / 1e12, 1),
                    vs_cudnn=round(times["cudnn"] / sec, 3) if "cudnn" in times else None,
                )


def tiles_sweep():
    """The forward at H = 128, 8k, non-causal, over other tiles than the default: keys per step
    and ring slots (how a first device run tunes them)."""
    b, n, t, h = 2, 16, 8192, 128
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    q, k, v = (jax.random.normal(key, (b, t, n, h), jnp.bfloat16) for key in keys)
    flops = 4 * b * n * t * t * h
    for block_kv, stages in ((128, 3), (64, 2), (64, 4)):
        tiles = _mosaic.ForwardTiles(block_kv=block_kv, stages=stages)
        try:
            fn = lambda q, k, v, tiles=tiles: _mosaic.forward(q, k, v, scale=h**-0.5, tiles=tiles)[0]
            sec = median_seconds(fn, q, k, v)
            emit(
                sweep="forward",
                block_kv=block_kv,
                stages=stages,
                ms=round(sec * 1e3, 3),
                tflops=round(flops / sec / 1e12, 1),
            )
        except Exception as e:
            emit(sweep="forward", block_kv=block_kv, stages=stages, status=f"failed: {str(e)[:200]}")


def dry_run():
    """On a CPU: the kernel lowered for cuda, case by case, and its Mosaic GPU custom calls counted."""
    for h in (64, 128, 256):
        for causal in (False, True):
            q = jax.ShapeDtypeStruct((2, 1024, 4, h), jnp.bfloat16)
            k = jax.ShapeDtypeStruct((2, 1024, 2, h), jnp.bfloat16)
            fn = jax.jit(lambda q, k, v, causal=causal: _mosaic.forward(q, k, v, scale=0.1, causal=causal))
            text = jax.export.export(fn, platforms=["cuda"])(q, k, k).mlir_module()
            emit(dry_run="lowered", h=h, causal=causal, mosaic_gpu_calls=text.count("custom_call @mosaic_gpu"))
    for name, b, t, s, n, kh, h, hv, kwargs in FEATURES:  # the kernels alone, with every feature's operand
        kw = _feature_kwargs(kwargs)
        ids = kw.get("segment_ids")
        fn = jax.jit(
            lambda q, k, v, kw=kw, ids=ids: _mosaic.forward(
                q,
                k,
                v,
                scale=0.1,
                causal=True,
                soft_cap=kw.get("logits_soft_cap"),
                q_offset=kw.get("query_offset"),
                q_lengths=kw.get("query_seq_lengths"),
                kv_lengths=kw.get("key_value_seq_lengths"),
                q_segment_ids=ids,
                kv_segment_ids=ids,
            )
        )
        shapes = ((b, t, n, h), (b, s, kh, h), (b, s, kh, hv))
        args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16) for shape in shapes]
        text = jax.export.export(fn, platforms=["cuda"])(*args).mlir_module()
        emit(dry_run="lowered", case=name, mosaic_gpu_calls=text.count("custom_call @mosaic_gpu"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="on a CPU: lower for cuda only")
    args = parser.parse_args(argv)
    emit(jax=jax.__version__, backend=jax.default_backend(), numpy=np.__version__)
    if args.dry_run:
        dry_run()
        return
    correctness()
    speed()
    wired()
    features()
    tiles_sweep()


if __name__ == "__main__":
    main()
