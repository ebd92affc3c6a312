"""Flex benchmark: `python -m jax_flash.bench --flex`.

Two masks that the built-in kinds do not (quite) express, at T = S = --seq-len (default
16k, as in the issue; on a 2-core CPU --seq-len 4096 takes about 2-3 minutes and 16k, by
the 4k run's figures, about 15-20 minutes, most of it in the dense rows; jax.nn's rows are
skipped there, their T×S logits exceeding the default --max-temp-gib):

* documents: --docs (16) packed documents of seeded random lengths, causal within each
  document (PyTorch's document masking);
* prefix+window: a sliding window of --window keys (causal) plus a prefix of --prefix keys
  that every query sees (prefix-LM with a window).

For each mask, measured in the same run, repetitions interleaved (the first three rows on
--implementation, xla by default; pallas on a GPU):

* flex: `jax_flash.flex_attention(mask_mod=..., block_mask=...)`, the block mask made once
  by `create_block_mask` (its build time is printed under the table);
* built-in: `jax_flash.attention` with the built-in mask closest to it: segment ids +
  is_causal for the documents (the same mask), the window alone for prefix+window (there
  is no built-in prefix: a different, sparser mask, said in the row);
* dense mask: `jax_flash.attention(mask=...)` with the [T, S] boolean mask;
* jax.nn: `jax.nn.dot_product_attention(mask=...)` with the same boolean mask (xla).

Columns: median time of the forward and of forward+backward (--passes), the compiled
temporary memory (`memory_analysis().temp_size_in_bytes`), the fraction of (head, query
block, key block) that the block mask calls non-empty (flex's row; the others compute every
block or skip by their own rules), and each time as a ratio against the built-in row and
against jax.nn (peer time / this time: > 1 is faster than the peer). A row whose compiled
temporary memory exceeds --max-temp-gib, or whose dense mask exceeds --max-mask-gib, is not
run and says why.
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
from jax_flash.bench.common import device_memory_bytes, environment, fmt_seq, is_oom, short

PATTERNS = ("documents", "prefix+window")
ROWS = ("flex", "built-in", "dense mask", "jax.nn")
PASSES = ("fwd", "fwdbwd")


def doc_lengths(t: int, docs: int, seed: int = 0) -> list[int]:
    """`docs` positive lengths summing to t (seeded; each at least t // (4 * docs))."""
    docs = max(1, min(docs, t))
    floor = max(1, t // (4 * docs))
    w = np.random.default_rng(seed).random(docs) + 0.5
    extra = np.floor(w / w.sum() * (t - floor * docs)).astype(int)
    extra[-1] += t - floor * docs - int(extra.sum())
    return [int(floor + e) for e in extra]


def pattern(name: str, t: int, args) -> dict[str, Any]:
    """The mask_mod, its dense [T, T] numpy form, the built-in call's keywords (with arrays
    made from the same numbers) and what the built-in row measures."""
    q = np.arange(t)[:, None]
    kv = np.arange(t)[None, :]
    if name == "documents":
        lengths = doc_lengths(t, args.docs)
        doc_np = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
        doc = jnp.asarray(doc_np)

        def mask_mod(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

        dense = (doc_np[:, None] == doc_np[None, :]) & (kv <= q)
        builtin = dict(segment_ids=doc[None], is_causal=True)
        note = "segment ids + causal (the same mask)"
        extra = dict(doc_lengths=lengths)
    elif name == "prefix+window":
        w, p = min(args.window, t), min(args.prefix, t)

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx - kv_idx < w) | (kv_idx < p)

        dense = (kv <= q) & (q - kv < w) | (kv < p)
        builtin = dict(is_causal=True, local_window_size=(w - 1, 0))
        note = "window only: no built-in prefix (a sparser mask)"
        extra = dict(window=w, prefix=p)
    else:
        raise ValueError(f"unknown pattern {name!r}")
    return dict(mask_mod=mask_mod, dense=dense, builtin=builtin, note=note, **extra)


def block_fraction(dense: np.ndarray, block: int) -> float:
    """The fraction of block×block tiles of a [T, S] boolean mask with a visible pair."""
    t, s = dense.shape
    nq, nk = -(-t // block), -(-s // block)
    padded = np.zeros((nq * block, nk * block), bool)
    padded[:t, :s] = dense
    return float(padded.reshape(nq, block, nk, block).any(axis=(1, 3)).mean())


def _fn(row: str, pat: dict, pass_: str, impl: str = "xla") -> Callable[..., Any]:
    """f(q, k, v, do, *extra): the forward (do unused) or forward+backward in q, k, v; the
    flex, built-in and dense-mask rows run implementation `impl`."""
    mask_mod = pat["mask_mod"]

    def attn(q, k, v, *extra):
        if row == "flex":
            return jax_flash.flex_attention(q, k, v, mask_mod=mask_mod, block_mask=extra[0], implementation=impl)
        if row == "built-in":
            return jax_flash.attention(q, k, v, implementation=impl, **pat["builtin"])
        if row == "dense mask":
            return jax_flash.attention(q, k, v, mask=extra[0], implementation=impl)
        return jax.nn.dot_product_attention(q, k, v, mask=extra[0], implementation="xla")

    if pass_ == "fwd":
        return lambda q, k, v, do, *extra: attn(q, k, v, *extra)

    def fwdbwd(q, k, v, do, *extra):
        out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, *extra), q, k, v)
        return out, vjp(do)

    return fwdbwd


def main(argv) -> list[dict]:
    p = argparse.ArgumentParser(
        prog="python -m jax_flash.bench --flex",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--flex", action="store_true", help="run this section")
    p.add_argument(
        "--seq-len",
        type=int,
        default=16384,
        help="T = S (default 16k: about 15-20 minutes on a 2-core CPU; 4096: about 2-3)",
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--docs", type=int, default=16, help="packed documents (documents mask)")
    p.add_argument("--window", type=int, default=1024, help="sliding window, keys (prefix+window mask)")
    p.add_argument("--prefix", type=int, default=1024, help="prefix every query sees (prefix+window mask)")
    p.add_argument("--block-size", type=int, default=128, help="create_block_mask's block size")
    p.add_argument(
        "--implementation",
        default="xla",
        help="the implementation of the flex, built-in and dense-mask rows (default xla; jax.nn's is xla)",
    )
    p.add_argument("--patterns", default=",".join(PATTERNS), help="comma list of " + ", ".join(PATTERNS))
    p.add_argument("--rows", default=",".join(ROWS), help="comma list of " + ", ".join(ROWS))
    p.add_argument("--passes", default=",".join(PASSES), help="comma list of fwd, fwdbwd")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--max-temp-gib",
        type=float,
        default=None,
        help="skip a row whose compiled temporary memory exceeds this (default: a quarter of memory)",
    )
    p.add_argument("--max-mask-gib", type=float, default=1.0, help="skip dense-mask rows whose mask exceeds this")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)
    split = lambda text: [x.strip() for x in text.split(",") if x.strip()]
    patterns, rows, passes = split(args.patterns), split(args.rows), split(args.passes)
    for name, got, allowed in (
        ("--patterns", patterns, PATTERNS),
        ("--rows", rows, ROWS),
        ("--passes", passes, PASSES),
    ):
        bad = [x for x in got if x not in allowed]
        if bad:
            p.error(f"{name}: unknown {bad}; choose from {', '.join(allowed)}")
    max_temp: int | None
    if args.max_temp_gib is not None:
        max_temp = int(args.max_temp_gib * 2**30)
    else:
        mem = device_memory_bytes()
        max_temp = None if mem is None else mem // 4
    max_mask = int(args.max_mask_gib * 2**30)

    env = environment()
    t = args.seq_len
    print(
        f"jax_flash {env['jax_flash']}, jax {env['jax']}, backend {env['backend']} "
        f"({env['device']}, {env['cpu_count']} CPUs), {env['date']}"
    )
    print(
        f"flex: B={args.batch}, T=S={fmt_seq(t)}, N={args.heads}, H={args.head_dim}, {args.dtype}, "
        f"block {args.block_size}, implementation {args.implementation}"
    )
    results: list[dict] = []
    header = (
        f"{'mask':14} {'row':11} {'pass':7} {'time ms':>10} {'x built-in':>10} {'x jax.nn':>9} "
        f"{'temp MiB':>10} {'blocks':>7}  note"
    )
    print(header)
    notes = []
    for name in patterns:
        cell, note = _measure(name, rows, passes, args, max_temp, max_mask)
        notes.append(note)
        results.extend(cell)
        for r in cell:
            print(_format(r), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"environment": env, "args": vars(args), "results": results}, f, indent=1)
    for note in notes:
        print(note)
    print(
        "x built-in / x jax.nn: that row's time / this time, same mask and pass (> 1: faster). "
        "blocks: the fraction of (head, query block, key block) the block mask calls non-empty."
    )
    return results


def _format(r) -> str:
    head = f"{r['pattern']:14} {r['row']:11} {r['pass']:7}"
    if r["status"] != "ok":
        return f"{head} {r['status']}"
    ratio = lambda x: "" if x is None else f"{x:.2f}"
    temp = "" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2**20:.1f}"
    blocks = "" if r["block_fraction"] is None else f"{r['block_fraction']:.3f}"
    return (
        f"{head} {1e3 * r['time_s']:10.2f} {ratio(r['vs_builtin']):>10} {ratio(r['vs_jax_nn']):>9} "
        f"{temp:>10} {blocks:>7}  {r['note']}"
    )


def _measure(name, rows, passes, args, max_temp, max_mask) -> tuple[list[dict], str]:
    b, t, n, h = args.batch, args.seq_len, args.heads, args.head_dim
    pat = pattern(name, t, args)
    keys = jax.random.split(jax.random.key(0), 4)
    qkvdo = [jax.random.normal(kk, (b, t, n, h), jnp.float32).astype(args.dtype) for kk in keys]
    t0 = time.perf_counter()
    make = jax.jit(lambda: jax_flash.create_block_mask(pat["mask_mod"], None, None, t, t, block_size=args.block_size))
    block_mask = jax.block_until_ready(make())
    build_s = time.perf_counter() - t0
    fraction = float(block_mask.num_nonempty()) / float(np.prod(block_mask.shape))
    mask_bytes = t * t  # one [T, S] bool, broadcast over batch and heads
    dense_mask = None
    out: list[tuple[dict, Any, tuple, list[float]]] = []
    for row in rows:
        for pass_ in passes:
            r: dict[str, Any] = dict(
                pattern=name,
                row=row,
                pass_name=pass_,
                status="ok",
                time_s=None,
                temp_bytes=None,
                block_fraction=fraction if row == "flex" else None,
                vs_builtin=None,
                vs_jax_nn=None,
                note={
                    "flex": "flex_attention + block mask",
                    "built-in": pat["note"],
                    "dense mask": "attention(mask=[T, S] bool)",
                    "jax.nn": "jax.nn.dot_product_attention(mask=[T, S] bool)",
                }[row],
                seq_len=t,
                **{k: v for k, v in pat.items() if k in ("doc_lengths", "window", "prefix")},
            )
            r["pass"] = r.pop("pass_name")
            extra: tuple = ()
            if row == "flex":
                extra = (block_mask,)
            elif row in ("dense mask", "jax.nn"):
                if mask_bytes > max_mask:
                    r["status"] = (
                        f"skipped: [T, S] mask {mask_bytes / 2**30:.1f} GiB > --max-mask-gib {max_mask / 2**30:.1f}"
                    )
                    out.append((r, None, (), []))
                    continue
                if dense_mask is None:
                    dense_mask = jnp.asarray(pat["dense"])[None, None]
                extra = (dense_mask,)
            operands = (*qkvdo, *extra)
            compiled = None
            try:
                compiled = jax.jit(_fn(row, pat, pass_, args.implementation)).lower(*operands).compile()
                analysis = compiled.memory_analysis()
                r["temp_bytes"] = None if analysis is None else int(analysis.temp_size_in_bytes)
                if max_temp is not None and r["temp_bytes"] is not None and r["temp_bytes"] > max_temp:
                    r["status"] = (
                        f"skipped: needs {r['temp_bytes'] / 2**30:.1f} GiB temp > --max-temp-gib {max_temp / 2**30:.1f}"
                    )
                    compiled = None
                else:
                    jax.block_until_ready(compiled(*operands))  # warm-up
            except Exception as e:  # reported in the table
                r["status"] = "OOM" if is_oom(e) else f"failed: {short(e)}"
                compiled = None
            out.append((r, compiled, operands, []))
    for _ in range(max(1, args.reps)):  # interleaved, so load changes hit every row alike
        for _r, compiled, operands, times in out:
            if compiled is not None:
                t1 = time.perf_counter()
                jax.block_until_ready(compiled(*operands))
                times.append(time.perf_counter() - t1)
    cell = []
    for r, _, _, times in out:
        if times:
            r["time_s"] = statistics.median(times)
        cell.append(r)
    for r in cell:
        peers = {x["row"]: x["time_s"] for x in cell if x["pass"] == r["pass"] and x["time_s"]}
        if r["time_s"]:
            if "built-in" in peers:
                r["vs_builtin"] = peers["built-in"] / r["time_s"]
            if "jax.nn" in peers:
                r["vs_jax_nn"] = peers["jax.nn"] / r["time_s"]
    note = (
        f"{name}: block mask built in {1e3 * build_s:.0f} ms (jit, first call), "
        f"{fraction:.3f} of blocks non-empty; "
        + (
            f"{len(pat['doc_lengths'])} documents"
            if "doc_lengths" in pat
            else f"window {pat['window']}, prefix {pat['prefix']}"
        )
    )
    return cell, note
