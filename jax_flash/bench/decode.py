"""Decode benchmark: `python -m jax_flash.bench --decode`.

One decode step (T=1 new query per sequence) against a full KV cache of S positions, for
B in --batch and S in --seq-lens (default B 1, 8, 32; S 4k, 32k; N=32 query heads, K=8 kv
heads, H=128; bfloat16 on a GPU, float32 on a CPU). Measured in the same run, interleaved:

* jax.nn: `jax.nn.dot_product_attention` on the contiguous cache (implementation="xla";
  "jax.nn-cudnn" on a GPU);
* each jax_flash implementation that serves `attention` here, as a decode step
  (key_value_seq_lengths = S, query_offset = S - 1, is_causal);
* xla-split: the xla forward forced to split-KV (the GPU rule's number of chunks), and
  xla-unsplit, to show what the split does on this machine;
* paged-xla, paged-cpu (on a CPU), paged-cuda (on a GPU): `jax_flash.paged_attention` on the
  same cache as pages of --page-size in shuffled order.

For each: the median time, the K/V read bandwidth (bytes of K and V read / time) and its
fraction of the machine's memory bandwidth: on a CPU the copy bandwidth (the row "copy":
`x + 1` over a float32 buffer as large as the cell's K and V, bytes read + written / time)
measured in the same cell, its repetitions interleaved with the others' so that a change of
load on a shared machine hits both alike; on a GPU the device's nominal figure (--peak-gbs;
H200: 4800 GB/s). A cell whose cache would exceed --max-cache-gib is skipped and says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import xla
from jax_flash._normalize import canonicalize
from jax_flash.bench.common import (
    device_memory_bytes,
    environment,
    fmt_seq,
    int_list,
    is_oom,
    physical_memory_bytes,
    short,
)
from jax_flash.inference import split_kv

NOMINAL_GBS = {"H200": 4800.0, "H100": 3350.0, "B200": 8000.0, "A100": 2039.0}


def _cache(b, s, kh, h, dtype, seed=0):
    kk, kv = jax.random.split(jax.random.PRNGKey(seed))
    k = jax.random.normal(kk, (b, s, kh, h), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (b, s, kh, h), jnp.float32).astype(dtype)
    return k, v


def _paged(k, v, page_size: int, seed=0):
    """The same cache as pages of `page_size` in shuffled order, and its page table."""
    b, s, kh, h = k.shape
    mp = -(-s // page_size)
    perm = np.random.default_rng(seed).permutation(b * mp)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, mp * page_size - s), (0, 0), (0, 0)))
    as_pages = lambda x: pad(x).reshape(b * mp, page_size, kh, h)
    inverse = np.argsort(perm)
    kp = as_pages(k)[inverse]  # page perm[i] holds logical page i
    vp = as_pages(v)[inverse]
    return kp, vp, jnp.asarray(perm.reshape(b, mp), jnp.int32)


def _step_fns(names, k, n, dtype):
    """(q, {name: (operand kind, fn)}) of one decode step over the cache k (and v)."""
    b, s, _kh, h = k.shape
    lengths = jnp.full((b,), s, jnp.int32)
    q = jax.random.normal(jax.random.PRNGKey(1), (b, 1, n, h), jnp.float32).astype(dtype)
    decode_kw: dict[str, Any] = dict(is_causal=True, key_value_seq_lengths=lengths, query_offset=lengths - 1)
    fns: dict[str, tuple[str | None, Callable[..., Any]]] = {}
    for name in names:
        if name == "jax.nn":
            fns[name] = (None, lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"))
        elif name == "jax.nn-cudnn":
            fns[name] = (None, lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
        elif name in ("xla-split", "xla-unsplit"):
            c = canonicalize(q, k, k, **decode_kw)
            splits = split_kv.num_splits(c.spec, "gpu") if name == "xla-split" else 1
            spec, masks = c.spec, c.masks
            fns[name] = (
                None,
                lambda q, k, v, spec=spec, masks=masks, splits=splits: split_kv.forward(
                    xla.forward, spec, q, k, v, masks, splits
                )[0],
            )
        elif name == "copy":
            fns[name] = ("copy", lambda x: x + 1)
        elif name.startswith("paged-"):
            paged_impl = name[len("paged-") :]
            fns[name] = (
                "paged",
                lambda q, kp, vp, table, impl=paged_impl: jax_flash.paged_attention(
                    q, kp, vp, table, lengths, implementation=impl
                ),
            )
        else:
            fns[name] = (
                None,
                lambda q, k, v, impl=name: jax_flash.attention(q, k, v, implementation=impl, **decode_kw),
            )
    return q, fns


def main(argv) -> list[dict]:
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    p = argparse.ArgumentParser(
        prog="python -m jax_flash.bench --decode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--decode", action="store_true", help="run this section")
    p.add_argument("--batch", type=int_list, default=[1, 8, 32])
    p.add_argument("--seq-lens", type=int_list, default=[4096, 32768])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16" if on_gpu else "float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=5 if on_gpu else 3)
    p.add_argument(
        "--max-cache-gib",
        type=float,
        default=None,
        help="skip cells whose K+V cache is larger (default: a quarter of memory)",
    )
    p.add_argument("--peak-gbs", type=float, default=None, help="the device's memory bandwidth, GB/s")
    p.add_argument("--impls", default=None, help="comma list (default: all that run here)")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)

    env = environment()
    print(
        f"jax_flash {env['jax_flash']}, jax {env['jax']}, backend {env['backend']} "
        f"({env['device']}, {env['cpu_count']} CPUs), {env['date']}"
    )
    itemsize = jnp.dtype(args.dtype).itemsize
    kv_bytes = lambda b, s: 2 * b * s * args.kv_heads * args.head_dim * itemsize
    if args.max_cache_gib is not None:
        max_cache = int(args.max_cache_gib * 2**30)
    else:
        mem = device_memory_bytes() or physical_memory_bytes() or 2**34
        max_cache = mem // 4 if on_gpu else mem // 8  # the paged copy and the copy test too
    if on_gpu:
        peak = args.peak_gbs or next((v for k, v in NOMINAL_GBS.items() if k in env["device"]), None)
        peak = None if peak is None else peak * 1e9
        peak_what = "nominal" if peak else "unknown (--peak-gbs)"
    else:
        peak = None  # measured per cell: the "copy" row
        peak_what = "copy bandwidth of the same cell"
    print(
        f"decode: T=1, N={args.heads}, K={args.kv_heads}, H={args.head_dim}, {args.dtype}, "
        f"page_size {args.page_size}; memory bandwidth: "
        + (f"{peak / 1e9:.1f} GB/s ({peak_what})" if peak else peak_what)
    )

    probe = jnp.zeros((1, 64, args.kv_heads, args.head_dim), args.dtype)
    reasons = jax_flash.explain(probe[:, :1].repeat(args.heads // args.kv_heads, 2), probe, probe).reasons
    names = ["jax.nn"] + (["jax.nn-cudnn"] if on_gpu else [])
    names += [n for n in ("cuda", "cpu") if reasons.get(n) is None]
    if on_gpu and reasons.get("pallas") is None:
        names.append("pallas")
    names += ["xla", "xla-unsplit", "xla-split", "paged-xla"]
    names += [f"paged-{n}" for n in ("cuda", "cpu") if reasons.get(n) is None]
    if args.impls:
        names = [n.strip() for n in args.impls.split(",") if n.strip()]
    if not on_gpu:
        names.append("copy")
    results = []
    header = f"{'B':>3} {'S':>6} {'impl':13} {'time ms':>9} {'K/V GB/s':>9} {'of peak':>8} {'x jax.nn':>9}"
    print(header)
    for s in args.seq_lens:
        for b in args.batch:
            rows = _measure_cell(names, b, s, args, kv_bytes(b, s), max_cache, peak)
            results.extend(rows)
            for r in rows:
                print(_format(r), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    shape = {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim}
                    json.dump({"environment": env, "peak": peak_what, "shape": shape, "results": results}, f, indent=1)
    print(
        "\nK/V GB/s: bytes of K and V read (2·B·S·K·H·itemsize) / time (copy: bytes read + "
        f"written / time); of peak: that over the memory bandwidth ({peak_what}); x jax.nn: "
        "jax.nn.dot_product_attention(xla) time / this time."
    )
    return results


def _format(r) -> str:
    if r["status"] != "ok":
        return f"{r['batch']:>3} {fmt_seq(r['seq_len']):>6} {r['impl']:13} {r['status']}"
    frac = "" if r["peak_fraction"] is None else f"{100 * r['peak_fraction']:.0f}%"
    ratio = "" if r["vs_jax_nn"] is None else f"{r['vs_jax_nn']:.2f}"
    return (
        f"{r['batch']:>3} {fmt_seq(r['seq_len']):>6} {r['impl']:13} "
        f"{1e3 * r['time_s']:9.2f} {r['kv_bytes_per_s'] / 1e9:9.1f} {frac:>8} {ratio:>9}"
    )


def _measure_cell(names, b, s, args, nbytes, max_cache, peak) -> list[dict]:
    rows = [
        dict(
            impl=n,
            batch=b,
            seq_len=s,
            status="ok",
            time_s=None,
            kv_bytes=nbytes,
            kv_bytes_per_s=None,
            peak_fraction=None,
            vs_jax_nn=None,
        )
        for n in names
    ]
    if nbytes > max_cache:
        for r in rows:
            r["status"] = f"skipped: K+V {nbytes / 2**30:.1f} GiB > --max-cache-gib {max_cache / 2**30:.1f}"
        return rows
    k, v = _cache(b, s, args.kv_heads, args.head_dim, args.dtype)
    q, fns = _step_fns(names, k, args.heads, args.dtype)
    paged = None
    cells: list[tuple[dict[str, Any], Any, tuple[Any, ...], list[float]]] = []
    for r in rows:
        kind, fn = fns[r["impl"]]
        operands: tuple[Any, ...] = (q, k, v)
        if kind == "paged":
            if paged is None:
                paged = _paged(k, v, args.page_size)
            operands = (q, *paged)
        if kind == "copy":
            operands = (jnp.zeros((nbytes // 4,), jnp.float32),)
        try:
            compiled = jax.jit(fn).lower(*operands).compile()
            jax.block_until_ready(compiled(*operands))  # warm-up
        except Exception as e:  # reported in the table
            r["status"] = "OOM" if is_oom(e) else f"failed: {short(e)}"
            compiled = None
        cells.append((r, compiled, operands, []))
    for _ in range(max(1, args.reps)):  # interleaved, so load changes hit every row alike
        for _r, compiled, operands, times in cells:
            if compiled is not None:
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(*operands))
                times.append(time.perf_counter() - t0)
    for r, _, _, times in cells:
        if times:
            r["time_s"] = statistics.median(times)
            r["kv_bytes_per_s"] = (2 if r["impl"] == "copy" else 1) * nbytes / r["time_s"]
    copy = next((r for r in rows if r["impl"] == "copy" and r["time_s"]), None)
    if copy is not None:
        peak = copy["kv_bytes_per_s"]
    for r in rows:
        if r["time_s"] and peak:
            r["peak_fraction"] = r["kv_bytes_per_s"] / peak
            r["peak_bytes_per_s"] = peak
    base = next((r["time_s"] for r in rows if r["impl"] == "jax.nn" and r["time_s"]), None)
    for r in rows:
        if base and r["time_s"] and r["impl"] != "copy":
            r["vs_jax_nn"] = base / r["time_s"]
    return rows
