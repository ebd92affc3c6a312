"""flex_attention on a GPU: the pallas kernels compiled by Triton against the same call on xla
and, where a built-in mask or soft cap says the same, against the built-in pallas path.

    python build/flex_check.py [--json PATH] [--seq-len 1000] [--reps 5]

The test suite runs the pallas kernels interpreted on a CPU; this is the check of the same
kernels compiled, at a size with many blocks (T = S = --seq-len, ragged against the 128-wide
blocks), B = 2, N = 8 query heads on K = 2 kv heads, H = 64, in bfloat16 and float32, forward
and backward (out, lse, dq, dk, dv; a random dout). Per case and dtype it prints the largest
error relative to the peer's largest magnitude, and the median time of forward+backward of
each path. xla runs at matmul precision "highest"; the pallas kernels run float32 products as
Triton's default (TF32 inputs), so their float32 error against xla is TF32's, and against the
built-in pallas path (the same products) only the order of the sums. Exit status 1 when an
error exceeds its bound or a result holds a NaN.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash

B, N, K, H, BLOCK = 2, 8, 2, 64, 128
# Largest error relative to the peer's largest magnitude: (against xla, against built-in pallas).
# float32 against the built-in pallas path: both round the products' inputs to TF32, but P is
# rounded relative to each path's running maxima, which differ with the tiles (up to 1.5e-4
# measured on an H200 at T = 1000).
BOUNDS = {"bfloat16": (3e-2, 2e-2), "float32": (1e-2, 1e-3)}


def cases(t: int):
    """(name, mask_mod, score_mod, the built-in keywords that say the same or None)."""
    rng = np.random.default_rng(0)
    lengths = np.diff(np.sort(np.concatenate([[0, t], rng.choice(np.arange(1, t), 7, replace=False)])))
    docs_np = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
    docs = jnp.asarray(docs_np)
    slopes = jnp.asarray(2.0 ** -np.arange(1, N + 1), jnp.float32)
    table = jnp.asarray(rng.normal(size=(N, 32)), jnp.float32)
    cap = jnp.asarray([5.0], jnp.float32)
    window = 200
    return [
        (
            "documents",
            lambda b, h, qi, ki: (docs[qi] == docs[ki]) & (ki <= qi),
            None,
            dict(segment_ids=jnp.broadcast_to(docs, (B, t)), is_causal=True),
        ),
        (
            "window",
            lambda b, h, qi, ki: (ki <= qi) & (qi - ki <= window),
            None,
            dict(local_window_size=(window, 0)),
        ),
        ("softcap", None, lambda s, b, h, qi, ki: cap[0] * jnp.tanh(s / cap[0]), dict(logits_soft_cap=5.0)),
        (
            "alibi+causal",
            lambda b, h, qi, ki: ki <= qi,
            lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki).astype(jnp.float32),
            None,
        ),
        (
            "t5+prefix",
            lambda b, h, qi, ki: (ki <= qi) | (ki < 300),
            lambda s, b, h, qi, ki: s + table[h, jnp.clip(jnp.abs(qi - ki) // 16, 0, 31)],
            None,
        ),
    ]


def run(fn, q, k, v, dout):
    out, pull = jax.vjp(lambda q, k, v: fn(q, k, v), q, k, v)
    return out, pull(dout)


def flex_path(impl, score_mod, mask_mod, bm):
    """jit(q, k, v, dout -> (out, (dq, dk, dv))) of flex_attention on `impl`."""

    def attn(q, k, v):
        return jax_flash.flex_attention(
            q, k, v, score_mod=score_mod, mask_mod=mask_mod, block_mask=bm, implementation=impl
        )

    return jax.jit(lambda q, k, v, dout: run(attn, q, k, v, dout))


def builtin_path(builtin):
    """The same for jax_flash.attention with built-in keywords, on pallas."""
    return jax.jit(
        lambda q, k, v, dout: run(
            lambda q, k, v: jax_flash.attention(q, k, v, implementation="pallas", **builtin), q, k, v, dout
        )
    )


def rel_err(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    fin = np.isfinite(ref)
    if not np.array_equal(fin, np.isfinite(a)):
        return float("inf")
    scale = max(float(np.max(np.abs(ref[fin]), initial=0)), 1e-30)
    return float(np.max(np.abs(a[fin] - ref[fin]), initial=0)) / scale


def timed(f, args, reps: int) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=1000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    t = args.seq_len
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; B={B} T=S={t} N={N} K={K} H={H} block {BLOCK}")
    results, failed = [], False
    for dtype in ("bfloat16", "float32"):
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        q = jax.random.normal(keys[0], (B, t, N, H), dtype)
        k = jax.random.normal(keys[1], (B, t, K, H), dtype)
        v = jax.random.normal(keys[2], (B, t, K, H), dtype)
        dout = jax.random.normal(keys[3], (B, t, N, H), dtype)
        for name, mask_mod, score_mod, builtin in cases(t):
            bm = None if mask_mod is None else jax_flash.create_block_mask(mask_mod, None, None, t, t, block_size=BLOCK)
            paths = {impl: flex_path(impl, score_mod, mask_mod, bm) for impl in ("pallas", "xla")}
            if builtin is not None:
                paths["built-in pallas"] = builtin_path(builtin)
            got = {}
            for path, f in paths.items():
                with jax.default_matmul_precision("highest" if path == "xla" else "default"):
                    got[path] = jax.block_until_ready(f(q, k, v, dout))
            row = dict(case=name, dtype=dtype)
            flat = lambda r: (r[0], *r[1])
            nan = any(bool(jnp.isnan(x).any()) for x in flat(got["pallas"]))
            row["nan"] = nan
            failed |= nan
            for peer, bound in zip(("xla", "built-in pallas"), BOUNDS[dtype]):
                if peer not in got:
                    continue
                errs = [rel_err(a, r) for a, r in zip(flat(got["pallas"]), flat(got[peer]))]
                row[f"vs {peer}"] = dict(zip(("out", "dq", "dk", "dv"), errs))
                failed |= max(errs) > bound
            for path, f in paths.items():
                with jax.default_matmul_precision("highest" if path == "xla" else "default"):
                    row[f"{path} ms"] = 1e3 * timed(f, (q, k, v, dout), args.reps)
            results.append(row)
            errs = "  ".join(
                f"{peer}: " + " ".join(f"{x:.1e}" for x in row[f"vs {peer}"].values())
                for peer in ("xla", "built-in pallas")
                if f"vs {peer}" in row
            )
            times = "  ".join(f"{path} {row[f'{path} ms']:.2f} ms" for path in paths)
            print(f"{dtype:9} {name:13} nan={nan}  err(out dq dk dv) {errs}  |  {times}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind, t=t, results=results), f, indent=1)
    print("flex_check:", "FAILED" if failed else "passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
