"""Benchmark: `python -m jax_flash.bench`.

Measures every jax_flash implementation that can run here and the peers, in the same run:
`jax.nn.dot_product_attention` (implementation="xla", and "cudnn" on a GPU), JAX's own
Pallas attention (`jax.experimental.pallas.ops.gpu.attention.mha`, GPU only) and, on a CPU
when it imports, PyTorch's `torch.nn.functional.scaled_dot_product_attention` (its CPU
FlashAttention kernels; an optional peer, never a dependency) in the same process with
the same number of threads. For each
head dim, sequence length, causal or not, forward and forward+backward it reports the
median time, the throughput in model FLOP/s (forward 4·B·N·T·S·H, halved for causal at
T == S; forward+backward 3.5× the forward: the backward's five products are 2.5× the
forward's two — `AttentionSpec.flops`), the ratio to jax.nn's xla path
and to torch measured in the same run, the compiled temporary memory
(`jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes`) and, on a CPU,
the fraction of the machine's peak for the dtype (`cpu_peaks`: threads × FLOP per cycle
from the CPU flags × the clock measured by jax_flash's extension), with a probe of whether
the threads had a core each during the case (`cores`, `_core_share`).

A case that fails, runs out of memory, or whose compiled temporary memory exceeds
`--max-temp-gib` is reported as such in the table; the run goes on. With `--time-budget`
no case starts once that many seconds have passed: the cases left are reported as
"cut: --time-budget". `--json` is rewritten after every case, so a run that is killed
still leaves the cases it finished. The last line counts the cells by status.

    python -m jax_flash.bench                                   # CPU defaults: f32, T=1k,4k
    python -m jax_flash.bench --impls xla,jax.nn --seq-lens 1024,4096,16384 --json out.json
    python -m jax_flash.bench --seq-lens 8k --head-dims 128,64 --time-budget 120 --json b.json
    python -m jax_flash.bench --impls cpu,jax.nn,torch --dtype bfloat16 --seq-lens 4k,16k
    python -m jax_flash.bench --impls cpu,jax.nn --bias t5,alibi    # dense biases (BIASES)

`--bias` adds cases with a dense additive bias in the input dtype, differentiated in the
forward+backward pass like q, k, v (a learned bias): `t5` [1, N, T, S] (T5's relative
position bias, shared by the batch), `alibi` [1, N, 1, S] (a per-head bias of the key
position, ALiBi's slope · s, which equals -slope · (t - s) up to a per-row constant the
softmax ignores) and `keys` [B, 1, 1, S] (an additive key-padding bias). torch is not
measured with a bias.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import gc
import json
import math
import os
import platform as _platform
import statistics
import subprocess
import sys
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash._spec import AttentionSpec

# Seconds between two timed calls on a CPU (measure_case).
SETTLE_S = 0.1

# Peers (not jax_flash) by name; jax_flash implementations are named as in `implementation=`.
PEER_JAX_NN = "jax.nn"
PEER_JAX_NN_CUDNN = "jax.nn-cudnn"
PEER_JAX_PALLAS = "jax-pallas"
PEER_TORCH = "torch"
PEERS = (PEER_JAX_NN, PEER_JAX_NN_CUDNN, PEER_JAX_PALLAS, PEER_TORCH)
FLASH = ("cuda", "pallas", "cpu", "xla")
# --bias: the dense bias of a case, one letter per dim of [B, N, T, S] (1: broadcast).
BIASES = {"none": None, "t5": "1NTS", "alibi": "1N1S", "keys": "B11S"}


@dataclasses.dataclass
class Result:
    impl: str
    pass_: str  # "fwd" or "fwdbwd"
    causal: bool
    head_dim: int
    seq_len: int
    batch: int
    heads: int
    dtype: str
    flops: float
    status: str = "ok"  # "ok", "skipped: ...", "OOM", "failed: ..."
    time_s: Optional[float] = None
    flops_per_s: Optional[float] = None
    temp_bytes: Optional[int] = None
    compile_s: Optional[float] = None  # lowering + compilation
    vs_jax_nn: Optional[float] = None  # jax.nn time / this time (>1: faster than jax.nn)
    vs_torch: Optional[float] = None  # torch time / this time (>1: faster than torch)
    peak_fraction: Optional[float] = None  # flops_per_s / the CPU's peak for the dtype
    core_share: Optional[float] = None  # CPU: _core_share before and after the case, the lower
    reps: int = 0
    bias: str = "none"  # BIASES


    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["pass"] = d.pop("pass_")
        return d


# ----------------------------------------------------------------------------- callables


def _attention_fn(impl: str, causal: bool, head_dim: int, bias: str = "none") -> Callable:
    """(q, k, v[, bias]) -> out [B, T, N, H] for one implementation, or raises why it cannot
    run."""
    if impl in FLASH:
        return lambda q, k, v, *b: jax_flash.attention(q, k, v, *b, is_causal=causal, implementation=impl)
    if impl == PEER_JAX_NN:
        return lambda q, k, v, *b: jax.nn.dot_product_attention(
            q, k, v, *b, is_causal=causal, implementation="xla"
        )
    if impl == PEER_JAX_NN_CUDNN:
        return lambda q, k, v, *b: jax.nn.dot_product_attention(
            q, k, v, *b, is_causal=causal, implementation="cudnn"
        )
    if bias != "none":
        raise ValueError(f"{impl} is not measured with a dense bias")
    if impl == PEER_JAX_PALLAS:
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention

        scale = 1.0 / math.sqrt(head_dim)
        return lambda q, k, v: pallas_attention.mha(q, k, v, None, sm_scale=scale, causal=causal)
    raise ValueError(f"unknown implementation {impl!r}; known: {FLASH + PEERS}")


def _threads() -> int:
    """The threads the cpu kernels use (JAX_FLASH_CPU_THREADS, else every CPU): torch gets
    as many."""
    try:
        n = int(os.environ.get("JAX_FLASH_CPU_THREADS", "0"))
    except ValueError:
        n = 0
    return n if n > 0 else (os.cpu_count() or 1)


def _torch_fn(pass_: str, causal: bool, args: list) -> Callable:
    """A no-argument callable running torch's CPU scaled_dot_product_attention on copies of
    `args` (BTNH jax arrays, transposed to torch's BNTH), forward or forward+backward."""
    import torch

    torch.set_num_threads(_threads())
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        str(args[0].dtype)
    ]

    def tensor(a, grad):
        t = torch.from_numpy(np.asarray(a, np.float32)).to(dtype).transpose(1, 2).contiguous()
        return t.requires_grad_(grad)

    sdpa = torch.nn.functional.scaled_dot_product_attention
    if pass_ == "fwd":
        q, k, v = (tensor(a, False) for a in args[:3])

        def run():
            with torch.no_grad():
                sdpa(q, k, v, is_causal=causal)

        return run
    q, k, v = (tensor(a, True) for a in args[:3])
    do = tensor(args[3], False)

    def run():
        for t in (q, k, v):
            t.grad = None
        sdpa(q, k, v, is_causal=causal).backward(do)

    return run


def _pass_fn(attn: Callable, pass_: str) -> Callable:
    """The forward, or forward+backward in every argument but the last (dO): q, k, v and the
    bias if there is one."""
    if pass_ == "fwd":
        return attn

    def fwdbwd(*args):
        out, vjp = jax.vjp(attn, *args[:-1])
        return out, vjp(args[-1])

    return fwdbwd


def bias_shape(kind: str, batch: int, heads: int, seq_len: int) -> Optional[tuple]:
    """The [B|1, N|1, T|1, S|1] shape of a --bias kind (None: no bias)."""
    dims = BIASES[kind]
    if dims is None:
        return None
    full = dict(B=batch, N=heads, T=seq_len, S=seq_len)
    return tuple(1 if c == "1" else full[c] for c in dims)


def _is_oom(e: BaseException) -> bool:
    text = f"{type(e).__name__}: {e}"
    return any(
        s in text for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "MemoryError")
    )


def _short(e: BaseException, limit: int = 90) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _physical_memory_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _device_memory_bytes() -> Optional[int]:
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return _physical_memory_bytes()
    try:
        stats = dev.memory_stats() or {}
        return stats.get("bytes_limit")
    except Exception:  # noqa: BLE001 - not every backend has memory stats
        return None


def _cell(impl, pass_, causal, head_dim, seq_len, batch, heads, dtype, bias="none") -> Result:
    """The not yet measured Result of one cell (its model FLOPs filled in)."""
    spec = AttentionSpec(
        batch=batch,
        q_len=seq_len,
        kv_len=seq_len,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype=dtype,
        scale=1.0 / math.sqrt(head_dim),
        window_right=0 if causal else None,
    )
    return Result(
        impl, pass_, causal, head_dim, seq_len, batch, heads, dtype, spec.flops(pass_ == "fwdbwd"),
        bias=bias,
    )


def _prepare(impl, pass_, causal, head_dim, seq_len, batch, heads, dtype, max_temp_bytes, bias="none"):
    """Compile one cell: (Result, compiled or None, args). A failure is the result's status."""
    r = _cell(impl, pass_, causal, head_dim, seq_len, batch, heads, dtype, bias)
    shape = (batch, seq_len, heads, head_dim)
    keys = jax.random.split(jax.random.key(0), 5)
    args = [jax.random.normal(kk, shape, jnp.float32).astype(dtype) for kk in keys[:3]]
    b_shape = bias_shape(bias, batch, heads, seq_len)
    if b_shape is not None:
        args.append(jax.random.normal(keys[4], b_shape, jnp.float32).astype(dtype))
    if pass_ == "fwdbwd":
        args.append(jax.random.normal(keys[3], shape, jnp.float32).astype(dtype))
    if impl == PEER_TORCH and b_shape is not None:
        r.status = "skipped: not measured with a dense bias"
        return r, None, None
    if impl == PEER_TORCH:
        try:
            return r, _torch_fn(pass_, causal, args), []
        except Exception as e:  # noqa: BLE001 - reported in the table
            r.status = f"failed: {_short(e)}"
            return r, None, None
    try:
        fn = _pass_fn(_attention_fn(impl, causal, head_dim, bias), pass_)
        t0 = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        r.compile_s = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - reported in the table
        r.status = "OOM" if _is_oom(e) else f"failed: {_short(e)}"
        return r, None, None
    try:
        r.temp_bytes = int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - some backends have no memory analysis
        r.temp_bytes = None
    if max_temp_bytes is not None and r.temp_bytes is not None and r.temp_bytes > max_temp_bytes:
        r.status = (
            f"skipped: needs {r.temp_bytes / 2**30:.1f} GiB temp > --max-temp-gib "
            f"{max_temp_bytes / 2**30:.1f}"
        )
        return r, None, None
    return r, compiled, args


def _run_once(r: Result, compiled, args) -> Optional[float]:
    """Seconds for one call, or None (and r.status set) when it fails."""
    try:
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        return time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - reported in the table
        r.status = "OOM" if _is_oom(e) else f"failed: {_short(e)}"
        return None


def measure_case(
    impls: list[str],
    pass_: str,
    causal: bool,
    head_dim: int,
    seq_len: int,
    batch: int,
    heads: int,
    dtype: str,
    reps: int,
    max_temp_bytes: Optional[int],
    max_seconds: float,
    bias: str = "none",
) -> list[Result]:
    """One case (pass, causal, H, T) for every implementation. Never raises.

    The timed repetitions are interleaved across implementations (round robin), so a change
    of machine load during the case affects all of them alike and the ratios stay fair.
    Each implementation stops repeating once its timed runs took `max_seconds`. On a CPU each
    call starts SETTLE_S after the previous one ended: a call that follows a large one at
    once (jax.nn's T×S scores) runs up to 1.5× slower while the machine settles (measured:
    0.1 s removes it), which would charge one implementation for another.
    """
    on_cpu = jax.default_backend() == "cpu"
    settle = len(impls) > 1 and on_cpu
    shares = [_core_share()] if on_cpu else []
    cells = []  # [result, compiled or None, args, times]
    for impl in impls:
        r, compiled, args = _prepare(
            impl, pass_, causal, head_dim, seq_len, batch, heads, dtype, max_temp_bytes, bias
        )
        cells.append([r, compiled, args, []])
    for cell in cells:  # warm-up
        if cell[1] is not None and _run_once(cell[0], cell[1], cell[2]) is None:
            cell[1] = None
    for _ in range(max(1, reps)):
        for r, compiled, args, times in cells:
            if compiled is None or r.status != "ok" or sum(times) > max_seconds:
                continue
            if settle:
                time.sleep(SETTLE_S)
            dt = _run_once(r, compiled, args)
            if dt is not None:
                times.append(dt)
    if on_cpu:
        shares.append(_core_share())
    for r, _, _, times in cells:
        if shares and None not in shares:
            r.core_share = min(shares)
        if r.status == "ok" and times:
            r.time_s = statistics.median(times)
            r.reps = len(times)
            r.flops_per_s = r.flops / r.time_s
    return [c[0] for c in cells]


def _core_share() -> Optional[float]:
    """Each thread's FMA rate with all the threads running FMAs at once, over one thread's
    alone (the extension's `cpu_core_share`): about 1 when every thread has a core, about 1/2
    when two share one (a virtual machine's CPUs placed on one core), when every peer runs at
    up to half speed and `% peak` is out of reach. None where it cannot be measured."""
    try:
        from jax_flash import _jax_flash_ext
    except ImportError:
        return None
    if not hasattr(_jax_flash_ext, "cpu_core_share"):
        return None
    share = _jax_flash_ext.cpu_core_share(_threads())
    return share if share > 0 else None


def measure(impl: str, *args, **kwargs) -> Result:
    """One cell of the table (see measure_case)."""
    return measure_case([impl], *args, **kwargs)[0]


# ----------------------------------------------------------------------------- which impls


def _torch_unavailable(on_gpu: bool) -> Optional[str]:
    """None if torch's CPU SDPA can be measured here, else why not."""
    if on_gpu:
        return "the torch peer is PyTorch's CPU kernel, measured on a CPU backend only"
    try:
        import torch  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"does not import ({_short(e, 60)}); pip install torch"
    return None


def available_impls(requested: Optional[list[str]], dtype: str) -> tuple[list[str], dict]:
    """(implementations to run, {name: why skipped}) for this machine."""
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    probe = jnp.zeros((1, 128, 1, 64), dtype)
    reasons = dict(jax_flash.explain(probe, probe, probe).reasons)
    skipped = {}
    if not on_gpu and reasons.get("pallas") is None:
        reasons["pallas"] = "runs on CPU only interpreted (far too slow to benchmark)"
    names = []
    for name in FLASH:
        if reasons.get(name) is None:
            names.append(name)
        else:
            skipped[name] = reasons[name]
    names.append(PEER_JAX_NN)
    if on_gpu:
        names.append(PEER_JAX_NN_CUDNN)
        try:
            from jax.experimental.pallas.ops.gpu import attention  # noqa: F401

            names.append(PEER_JAX_PALLAS)
        except Exception as e:  # noqa: BLE001
            skipped[PEER_JAX_PALLAS] = f"does not import: {_short(e)}"
    else:
        skipped[PEER_JAX_NN_CUDNN] = "needs a GPU"
        skipped[PEER_JAX_PALLAS] = "needs a GPU"
    why_not_torch = _torch_unavailable(on_gpu)
    if why_not_torch is None:
        names.append(PEER_TORCH)
    else:
        skipped[PEER_TORCH] = why_not_torch
    if requested:
        unknown = [n for n in requested if n not in FLASH + PEERS]
        if unknown:
            raise SystemExit(f"--impls: unknown {unknown}; known: {', '.join(FLASH + PEERS)}")
        # A requested implementation runs even if it looks unavailable: the table then says
        # why it failed.
        names = list(requested)
        skipped = {k: v for k, v in skipped.items() if k not in requested}
    return names, skipped


# ----------------------------------------------------------------------------- report


def _fmt_seq(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)


def format_table(results: list[Result], on_gpu: bool) -> str:
    unit, div = ("TFLOP/s", 1e12) if on_gpu else ("GFLOP/s", 1e9)
    header = (
        f"{'impl':13s} {'pass':6s} {'causal':6s} {'bias':5s} {'H':>4s} {'T=S':>6s} {'time ms':>10s} "
        f"{unit:>9s} {'x jax.nn':>9s} {'x torch':>8s} {'% peak':>7s} {'cores':>5s} {'temp MiB':>10s} "
        f"{'compile s':>9s}  status"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        time_ms = "" if r.time_s is None else f"{r.time_s * 1e3:.2f}"
        tput = "" if r.flops_per_s is None else f"{r.flops_per_s / div:.2f}"
        ratio = "" if r.vs_jax_nn is None else f"{r.vs_jax_nn:.2f}"
        vs_torch = "" if r.vs_torch is None else f"{r.vs_torch:.2f}"
        peak = "" if r.peak_fraction is None else f"{100 * r.peak_fraction:.0f}"
        cores = "" if r.core_share is None else f"{r.core_share:.2f}"
        temp = "" if r.temp_bytes is None else f"{r.temp_bytes / 2**20:.1f}"
        comp = "" if r.compile_s is None else f"{r.compile_s:.1f}"
        lines.append(
            f"{r.impl:13s} {r.pass_:6s} {'yes' if r.causal else 'no':6s} {r.bias:5s} {r.head_dim:4d} "
            f"{_fmt_seq(r.seq_len):>6s} {time_ms:>10s} {tput:>9s} {ratio:>9s} {vs_torch:>8s} "
            f"{peak:>7s} {cores:>5s} {temp:>10s} {comp:>9s}  "
            f"{r.status}"
        )
    return "\n".join(lines)


def _attach_ratios(results: list[Result], peaks: Optional[dict] = None) -> None:
    for peer, attr in ((PEER_JAX_NN, "vs_jax_nn"), (PEER_TORCH, "vs_torch")):
        base = {}
        for r in results:
            if r.impl == peer and r.time_s is not None:
                base[(r.pass_, r.causal, r.bias, r.head_dim, r.seq_len)] = r.time_s
        for r in results:
            t = base.get((r.pass_, r.causal, r.bias, r.head_dim, r.seq_len))
            if t is not None and r.time_s is not None:
                setattr(r, attr, t / r.time_s)
    for r in results:
        peak = (peaks or {}).get(r.dtype)
        if peak is not None and r.flops_per_s is not None:
            r.peak_fraction = r.flops_per_s / peak[1]


# ----------------------------------------------------------------------------- CPU peak
# FLOP per cycle per core of the widest unit each flag brings (two 512-bit FMA pipes on
# AVX-512 cores, except AMD family 19h (Zen 3/4), which runs 512-bit operations on two
# 256-bit pipes): f32 FMA, AVX512-BF16 vdpbf16ps (a pair per lane), AMX tiles
# (TDPBF16PS / TDPFP16PS: 16·16·32 multiply-adds per 16 cycles).
_AMX_FLOP_PER_CYCLE = 1024


def _cpu_flags() -> tuple[set, dict]:
    flags, info = set(), {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "flags" and not flags:
                    flags = set(value.split())
                elif key in ("vendor_id", "cpu family", "model name") and key not in info:
                    info[key] = value.strip()
    except OSError:
        pass
    return flags, info


def cpu_peaks(threads: Optional[int] = None) -> dict:
    """{dtype: (path, FLOP/s)}: the peak of the widest path this CPU has for each dtype,
    over `threads` cores; also "paths" ({path: FLOP/s}), "clock_ghz", "threads" and "cpu".
    Empty when the flags or the clock cannot be read (not Linux on x86-64)."""
    flags, info = _cpu_flags()
    if not flags:
        return {}
    from jax_flash import _jax_flash_ext

    clock = _jax_flash_ext.cpu_clock_ghz() if hasattr(_jax_flash_ext, "cpu_clock_ghz") else 0.0
    if clock <= 0:
        return {}
    threads = threads or _threads()
    half = info.get("vendor_id") == "AuthenticAMD" and info.get("cpu family") == "25"
    if "avx512f" in flags:
        fma = 32 if half else 64
    elif "avx2" in flags and "fma" in flags:
        fma = 32
    else:
        fma = 8
    per_cycle = {"FMA f32": fma}
    if "avx512_bf16" in flags:
        per_cycle["AVX512-BF16"] = 2 * fma
    if "amx_bf16" in flags and "amx_tile" in flags:
        per_cycle["AMX-BF16"] = _AMX_FLOP_PER_CYCLE
    if "amx_fp16" in flags and "amx_tile" in flags:
        per_cycle["AMX-FP16"] = _AMX_FLOP_PER_CYCLE
    paths = {name: threads * c * clock * 1e9 for name, c in per_cycle.items()}
    best = lambda names: next(((n, paths[n]) for n in names if n in paths), None)
    return {
        "float32": best(["FMA f32"]),
        "bfloat16": best(["AMX-BF16", "AVX512-BF16", "FMA f32"]),
        "float16": best(["AMX-FP16", "FMA f32"]),
        "paths": paths,
        "clock_ghz": clock,
        "threads": threads,
        "cpu": info.get("model name", ""),
    }


def format_peaks(peaks: dict) -> str:
    if not peaks:
        return "CPU peak: unknown here"
    parts = ", ".join(f"{name} {v / 1e9:.0f} GFLOP/s" for name, v in peaks["paths"].items())
    return (
        f"CPU peak ({peaks['cpu']}; {peaks['threads']} threads × FLOP/cycle from the flags × "
        f"{peaks['clock_ghz']:.2f} GHz measured): {parts}; '% peak' is against "
        + ", ".join(f"{d}: {peaks[d][0]}" for d in ("float32", "bfloat16", "float16"))
    )


def _require_matplotlib() -> None:
    """Exits with a message (status 1) if `--plot` cannot work here."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        sys.exit(f"--plot needs matplotlib ({e}): pip install \".[bench]\" (or matplotlib)")


def write_plot(results: list[Result], path: str, on_gpu: bool) -> None:
    import matplotlib  # lazily: only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, div = ("TFLOP/s", 1e12) if on_gpu else ("GFLOP/s", 1e9)
    passes = sorted({r.pass_ for r in results}, key=("fwd", "fwdbwd").index)
    causals = sorted({r.causal for r in results})
    fig, axes = plt.subplots(
        len(passes), len(causals), figsize=(5.5 * len(causals), 4 * len(passes)), squeeze=False
    )
    panels = [(ax, p, c) for row, p in zip(axes, passes) for ax, c in zip(row, causals)]
    for ax, pass_, causal in panels:
        series = {}
        for r in results:
            if (r.pass_, r.causal) == (pass_, causal) and r.flops_per_s is not None:
                series.setdefault((r.impl, r.head_dim), []).append((r.seq_len, r.flops_per_s / div))
        for (impl, h), pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{impl} H={h}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length T = S")
        ax.set_ylabel(unit)
        ax.set_title(f"{pass_}, {'causal' if causal else 'not causal'}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def environment() -> dict:
    dev = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "jax_flash": jax_flash.__version__,
        "backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)),
        "cpu_count": os.cpu_count(),
        "machine": _platform.machine(),
        "python": _platform.python_version(),
    }


# ----------------------------------------------------------------------------- main


def _int_list(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1024 if part.endswith("k") else 1
        out.append(int(part.rstrip("k")) * mult)
    return out


def _tune_pallas(args) -> None:
    try:
        import jax_flash.pallas as pallas_mod
    except ImportError as e:
        print(f"--tune-pallas: jax_flash.pallas is not available ({e})")
        return
    tune = getattr(pallas_mod, "tune", None)
    if tune is None:
        print("--tune-pallas: this version of jax_flash.pallas has no tune()")
        return
    import inspect

    offered = dict(
        head_dims=args.head_dims,
        seq_lens=args.seq_lens,
        dtype=args.dtype,
        batch=args.batch,
        heads=args.heads,
        num_heads=args.heads,
    )
    params = inspect.signature(tune).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in offered.items() if takes_any or k in params}
    print(f"tuning Pallas block sizes: jax_flash.pallas.tune({kwargs})")
    result = tune(**kwargs)
    if result is not None:
        print(result)


def parse_args(argv=None):
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    p = argparse.ArgumentParser(
        prog="python -m jax_flash.bench",
        description="Throughput and compiled temporary memory of jax_flash.attention and its "
        "peers (jax.nn.dot_product_attention, JAX's Pallas attention), measured in one run.",
    )
    p.add_argument(
        "--impls",
        default=None,
        help=f"comma list among {', '.join(FLASH + PEERS)} (default: every one available)",
    )
    p.add_argument(
        "--seq-lens",
        default="1k,4k,16k" if on_gpu else "1k,4k",
        help="comma list of T = S (suffix k = 1024)",
    )
    p.add_argument("--head-dims", default="64,128" if on_gpu else "64", help="comma list of H")
    p.add_argument("--batch", type=int, default=1 if not on_gpu else 4)
    p.add_argument("--heads", type=int, default=8, help="number of heads N (= K)")
    p.add_argument(
        "--dtype",
        default="bfloat16" if on_gpu else "float32",
        choices=["float32", "bfloat16", "float16"],
    )
    p.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    p.add_argument(
        "--bias",
        default="none",
        help=f"comma list among {', '.join(BIASES)}: cases with a dense bias, t5 [1, N, T, S], "
        "alibi [1, N, 1, S], keys [B, 1, 1, S] (differentiated in fwdbwd; default: none)",
    )
    p.add_argument("--passes", default="both", choices=["fwd", "fwdbwd", "both"])
    p.add_argument("--reps", type=int, default=5 if on_gpu else 3, help="timed repetitions")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=30.0,
        help="stop repeating a case once its timed runs took this long",
    )
    p.add_argument(
        "--max-temp-gib",
        type=float,
        default=None,
        help="skip a case whose compiled temporary memory exceeds this "
        "(default: 25%% of the memory of the device, or of the host on CPU)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start no case after this many seconds from the start; the cases left are "
        "reported as cut (default: no limit)",
    )
    p.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="write the results as JSON (rewritten after every case)",
    )
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG plot (matplotlib)")
    p.add_argument(
        "--tune-pallas",
        action="store_true",
        help="first tune the Pallas block sizes with jax_flash.pallas.tune(...)",
    )
    args = p.parse_args(argv)
    args.seq_lens = _int_list(args.seq_lens)
    args.head_dims = _int_list(args.head_dims)
    args.impls = [s.strip() for s in args.impls.split(",") if s.strip()] if args.impls else None
    args.bias = [s.strip() for s in args.bias.split(",") if s.strip()]
    for kind in args.bias:
        if kind not in BIASES:
            p.error(f"--bias: {kind!r} is not one of {', '.join(BIASES)}")
    return args


CUT = "cut: --time-budget"


def status_counts(results: list[Result]) -> dict[str, int]:
    """{"ok": n, "failed": n, "OOM": n, "skipped": n, "cut": n} over the cells."""
    counts = {"ok": 0, "failed": 0, "OOM": 0, "skipped": 0, "cut": 0}
    for r in results:
        key = r.status.split(":")[0]
        counts[key if key in counts else "failed"] += 1
    return counts


def _write_json(path: str, env: dict, args, skipped: dict, results: list[Result], done: bool):
    data = {
        "environment": env,
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
        "not_measured": skipped,
        "complete": done,
        "counts": status_counts(results),
        "results": [r.to_json() for r in results],
    }
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)  # a reader (or a kill) never sees half a file


# ----------------------------------------------------------------------------- many devices
#
# `python -m jax_flash.bench --multi-device`: context parallelism at a fixed global T over
# P devices (host devices on a CPU: the flag sets XLA_FLAGS before JAX starts), compared with
# one device computing everything and with the all-gather fallback (every device gathers
# the whole K/V and attends its query chunk to it): per-device compiled temporary memory,
# per-device arguments, time, the collectives in the compiled program, and the causal
# block counts per device of the ring with and without zigzag.

MD_VARIANTS = ("one device", "ring contiguous", "ring zigzag", "all-gather K/V")
_COLLECTIVE_OPS = ("collective-permute", "all-gather", "all-reduce", "all-to-all", "reduce-scatter")


@dataclasses.dataclass
class DeviceResult:
    variant: str
    pass_: str
    causal: bool
    devices: int
    seq_len: int
    status: str = "ok"
    time_s: Optional[float] = None
    temp_bytes: Optional[int] = None  # compiled temporary memory of one device
    arg_bytes: Optional[int] = None  # arguments held by one device
    collectives: Optional[dict] = None  # op -> count in the compiled program

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["pass"] = d.pop("pass_")
        return d


def count_collectives(hlo_text: str) -> dict:
    """{op: count} of the collective ops of a compiled HLO module (sync and -start forms;
    op names only, not metadata)."""
    import re

    return {
        op: len(re.findall(rf"\b{op}(?:-start)?\(", hlo_text)) for op in _COLLECTIVE_OPS
    }


def _md_fn(variant: str, mesh, causal: bool, impl: Optional[str]) -> Callable:
    from jax import lax
    from jax.sharding import PartitionSpec as P

    if variant == "one device":
        return lambda q, k, v: jax_flash.attention(q, k, v, is_causal=causal, implementation=impl)
    seq = P(None, "seq")
    if variant.startswith("ring"):
        layout = variant.split()[1]

        def local(q, k, v):
            return jax_flash.ring_attention(
                q, k, v, axis_name="seq", is_causal=causal, layout=layout, implementation=impl
            )

    else:

        def local(q, k, v):
            k_all = lax.all_gather(k, "seq", axis=1, tiled=True)
            v_all = lax.all_gather(v, "seq", axis=1, tiled=True)
            offset = lax.axis_index("seq") * q.shape[1]
            return jax_flash.attention(
                q, k_all, v_all, is_causal=causal, query_offset=offset, implementation=impl
            )

    # The gathered K/V are replicated over the axis while the queries vary: without the
    # varying-type check the gradient of the gather is the usual reduce-scatter.
    check_vma = variant.startswith("ring")
    return jax.shard_map(local, mesh=mesh, in_specs=(seq,) * 3, out_specs=seq,
                         check_vma=check_vma)


def measure_multi_device(
    devices: int,
    seq_len: int,
    *,
    batch: int = 1,
    heads: int = 8,
    head_dim: int = 64,
    dtype: str = "float32",
    causals=(True,),
    passes=("fwd", "fwdbwd"),
    reps: int = 3,
    impl: Optional[str] = None,
    variants=MD_VARIANTS,
) -> list[DeviceResult]:
    """Every variant at global T = S = seq_len over `devices` devices. Never raises."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:devices]), ("seq",))
    shape = (batch, seq_len, heads, head_dim)
    keys = jax.random.split(jax.random.key(0), 4)
    host = [jax.random.normal(kk, shape, jnp.float32).astype(dtype) for kk in keys]
    results = []
    for causal in causals:
        for pass_ in passes:
            for variant in variants:
                r = DeviceResult(variant, pass_, causal, 1 if variant == "one device" else devices,
                                 seq_len)
                results.append(r)
                where = (jax.devices()[0] if variant == "one device"
                         else NamedSharding(mesh, P(None, "seq")))
                args = [jax.device_put(x, where) for x in host[: 4 if pass_ == "fwdbwd" else 3]]
                try:
                    fn = _pass_fn(_md_fn(variant, mesh, causal, impl), pass_)
                    compiled = jax.jit(fn).lower(*args).compile()
                    mem = compiled.memory_analysis()
                    r.temp_bytes = int(mem.temp_size_in_bytes)
                    r.arg_bytes = int(mem.argument_size_in_bytes)
                    r.collectives = count_collectives(compiled.as_text())
                    jax.block_until_ready(compiled(*args))  # warm-up
                    times = []
                    for _ in range(max(1, reps)):
                        t0 = time.perf_counter()
                        jax.block_until_ready(compiled(*args))
                        times.append(time.perf_counter() - t0)
                    r.time_s = statistics.median(times)
                except Exception as e:  # noqa: BLE001 - reported in the table
                    r.status = "OOM" if _is_oom(e) else f"failed: {_short(e)}"
    return results


def format_multi_device(results: list[DeviceResult]) -> str:
    head = (f"{'variant':16s} {'pass':6s} {'causal':6s} {'devices':>7s} {'time ms':>9s} "
            f"{'temp MiB/dev':>12s} {'args MiB/dev':>12s}  collectives")
    lines = [head, "-" * len(head)]
    for r in results:
        if r.status != "ok":
            lines.append(f"{r.variant:16s} {r.pass_:6s} {str(r.causal):6s} {r.devices:7d} "
                         f"{r.status}")
            continue
        coll = ", ".join(f"{n} {op}" for op, n in r.collectives.items() if n) or "none"
        lines.append(
            f"{r.variant:16s} {r.pass_:6s} {str(r.causal):6s} {r.devices:7d} "
            f"{r.time_s * 1e3:9.2f} {r.temp_bytes / 2**20:12.2f} {r.arg_bytes / 2**20:12.2f}"
            f"  {coll}"
        )
    return "\n".join(lines)


def _md_parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m jax_flash.bench --multi-device",
        description="Context parallelism at a fixed global T: ring attention (contiguous, "
        "zigzag) vs one device vs the all-gather fallback, per-device memory and time.",
    )
    p.add_argument("--multi-device", action="store_true", help="run this section")
    p.add_argument("--devices", type=int, default=8,
                   help="devices of the sequence axis (host devices on a CPU)")
    p.add_argument("--seq-len", type=_int_list, default=None,
                   help="global T = S (suffix k = 1024; default 4k on a CPU, 32k on a GPU)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--causal", default="yes", choices=["both", "yes", "no"])
    p.add_argument("--passes", default="both", choices=["fwd", "fwdbwd", "both"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--impl", default=None, choices=FLASH,
                   help="implementation of every attention call (default: jax_flash's choice)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    return p.parse_args(argv)


def multi_device_main(argv) -> list[DeviceResult]:
    """`python -m jax_flash.bench --multi-device [...]`."""
    args = _md_parse_args(argv)
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # Read when the CPU backend starts (not yet, unless JAX was used before this call).
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    seq_len = (args.seq_len or [32768 if on_gpu else 4096])[0]
    dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    p = args.devices
    print(f"jax_flash {jax_flash.__version__}, jax {jax.__version__}, backend "
          f"{jax.default_backend()}, {jax.device_count()} devices ({jax.devices()[0].device_kind})")
    if jax.device_count() < p:
        print(f"multi-device: needs {p} devices, have {jax.device_count()} "
              f"(on a CPU run it in a fresh process, or set XLA_FLAGS={flag})")
        return []
    if seq_len % (2 * p):
        raise SystemExit(f"--seq-len must be a multiple of 2 * devices = {2 * p}")
    print(f"global T = S = {seq_len}, B={args.batch} N={args.heads} H={args.head_dim} {dtype}, "
          f"sequence over {p} devices ({seq_len // p} each), implementation "
          f"{args.impl or 'auto'}")
    if jax.default_backend() == "cpu":
        print("(host devices share this machine's cores: times add up over the devices)")
    print()
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    passes = {"both": ("fwd", "fwdbwd"), "fwd": ("fwd",), "fwdbwd": ("fwdbwd",)}[args.passes]
    results = measure_multi_device(
        p, seq_len, batch=args.batch, heads=args.heads, head_dim=args.head_dim, dtype=dtype,
        causals=causals, passes=passes, reps=args.reps, impl=args.impl,
    )
    print(format_multi_device(results))
    print()
    from jax_flash.parallel.ring import block_counts

    counts = {}
    for layout in ("contiguous", "zigzag"):
        counts[layout] = block_counts(p, layout=layout, is_causal=True)
        print(f"causal blocks per device, {layout:10s}: {counts[layout]} "
              f"(max {max(counts[layout])}, total {sum(counts[layout])})")
    print(f"(units: one (T/{2 * p}) x (S/{2 * p}) block; the step time follows the max)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "config": vars(args),
                       "results": [r.to_json() for r in results],
                       "causal_block_counts": counts}, f, indent=1)
        print(f"wrote {args.json}")
    return results


def _status_kib(field: str) -> Optional[int]:
    """A field of /proc/self/status in KiB (VmRSS: resident now, VmHWM: its peak), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_memory_probe(argv) -> dict:
    """One cell in this (fresh) process: `impl pass causal H T B N dtype`. Compiles it (jax),
    then resets the peak resident size (/proc/self/clear_refs) and runs it once: the peak
    during the call, the resident size before it (inputs, runtime, compiled code) and the
    difference, the call's own memory. Prints and returns them as JSON."""
    impl, pass_, causal, head_dim, seq_len, batch, heads, dtype = argv
    cell = (impl, pass_, causal == "yes", int(head_dim), int(seq_len), int(batch), int(heads), dtype)
    r, fn, args = _prepare(*cell, None)
    row = {"impl": impl, "pass": pass_, "causal": causal == "yes", "head_dim": int(head_dim),
           "seq_len": int(seq_len), "dtype": dtype, "status": r.status}
    if fn is not None:
        run = fn if impl == PEER_TORCH else (lambda: jax.block_until_ready(fn(*args)))
        if args:
            jax.block_until_ready(args)
        gc.collect()
        try:  # hand freed heap (the compiler's) back, so that "before" is what is held
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
        before = _status_kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError as e:
            row["status"] = f"failed: cannot reset the peak resident size ({e})"
            before = None
        if before is not None:
            run()
            peak = _status_kib("VmHWM")
            row.update(before_mib=before / 1024, peak_mib=peak / 1024, call_mib=(peak - before) / 1024)
    print(json.dumps(row), flush=True)
    return row


def peak_memory_main(argv) -> list[dict]:
    """--peak-memory: each (implementation, case) of the usual options in a process of its own
    (Linux): the peak resident memory during one call and the call's own share (above what
    was resident before it), side by side, with each implementation's ratio to torch's."""
    argv = [a for a in argv if a != "--peak-memory"]
    args = parse_args(argv)
    impls, skipped = available_impls(args.impls, args.dtype)
    for name, why in skipped.items():
        print(f"  not measured: {name}: {why}")
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    passes = {"both": ("fwd", "fwdbwd"), "fwd": ("fwd",), "fwdbwd": ("fwdbwd",)}[args.passes]
    rows = []
    print("| impl | dtype | H | T = S | causal | pass | peak MiB | before MiB | call MiB | peak x torch | call x torch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for h in args.head_dims:
        for t in args.seq_lens:
            for c in causals:
                for p_ in passes:
                    case = []
                    for impl in impls:
                        cmd = [sys.executable, "-m", "jax_flash.bench", "--peak-memory-probe", impl, p_,
                               "yes" if c else "no", str(h), str(t), str(args.batch), str(args.heads), args.dtype]
                        done = subprocess.run(cmd, capture_output=True, text=True)
                        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
                        row = json.loads(lines[-1]) if lines else {
                            "impl": impl, "status": f"failed: {_short(RuntimeError(done.stderr.strip()[-300:]))}"}
                        case.append(row)
                    peer = next((r for r in case if r["impl"] == PEER_TORCH and "peak_mib" in r), None)
                    for row in case:
                        if "peak_mib" not in row:
                            print(f"| {row['impl']} | {args.dtype} | {h} | {_fmt_seq(t)} | {'yes' if c else 'no'} "
                                  f"| {p_} | {row['status']} | | | | |")
                            continue
                        ratio = lambda key: f"{row[key] / peer[key]:.2f}" if peer and peer[key] > 0 else ""
                        print(f"| {row['impl']} | {args.dtype} | {h} | {_fmt_seq(t)} | {'yes' if c else 'no'} | {p_} "
                              f"| {row['peak_mib']:.0f} | {row['before_mib']:.0f} | {row['call_mib']:.0f} "
                              f"| {ratio('peak_mib')} | {ratio('call_mib')} |", flush=True)
                    rows.extend(case)
    print("\npeak: the process's peak resident memory during one call (after compiling it); before: "
          "resident before the call (inputs, runtime, compiled code); call: peak - before.")
    return rows


def main(argv=None) -> list[Result]:
    start = time.monotonic()
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--peak-memory-probe" in argv:
        return peak_memory_probe(argv[argv.index("--peak-memory-probe") + 1:])
    if "--peak-memory" in argv:
        return peak_memory_main(argv)
    if "--multi-device" in argv:
        return multi_device_main(argv)
    if "--decode" in argv:  # one decode step against a KV cache (jax_flash/inference/bench_decode.py)
        from jax_flash.inference import bench_decode

        return bench_decode.main(argv)
    args = parse_args(argv)
    if args.plot:
        _require_matplotlib()  # before a run of minutes, not after it
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    env = environment()
    print(
        f"jax_flash {env['jax_flash']}, jax {env['jax']}, backend {env['backend']} "
        f"({env['device']}, {env['cpu_count']} CPUs), {env['date']}"
    )
    if args.tune_pallas:
        _tune_pallas(args)
    impls, skipped = available_impls(args.impls, args.dtype)
    print(f"implementations: {', '.join(impls)}")
    for name, why in skipped.items():
        print(f"  not measured: {name}: {why}")
    peaks = {} if on_gpu else cpu_peaks()
    if not on_gpu:
        print(format_peaks(peaks))
        if "cpu" in impls:
            from jax_flash import _jax_flash_ext

            if hasattr(_jax_flash_ext, "cpu_isa"):
                isa = _jax_flash_ext.cpu_isa()
                print(f"cpu kernels: ISA {isa}, {_threads()} threads"
                      + (f"; torch: {_threads()} threads" if PEER_TORCH in impls else ""))
                for h in args.head_dims:
                    b = _jax_flash_ext.cpu_blocking(h, args.dtype, isa in ("amx", "avx512bf16", "amx_emulated"))
                    print(f"  blocking H={h}: {b['block_q']} x {b['block_k']}, tile step "
                          f"forward {b['forward_bytes'] / 2**10:.0f} KiB, backward "
                          f"{b['backward_bytes'] / 2**10:.0f} KiB")
    env["peaks"] = {k: v for k, v in peaks.items()}
    if args.max_temp_gib is not None:
        max_temp = int(args.max_temp_gib * 2**30)
    else:
        mem = _device_memory_bytes()
        max_temp = None if mem is None else mem // 4
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    passes = {"both": ("fwd", "fwdbwd"), "fwd": ("fwd",), "fwdbwd": ("fwdbwd",)}[args.passes]
    print(
        f"B={args.batch} N={args.heads} dtype={args.dtype} H={args.head_dims} "
        f"T=S={args.seq_lens} bias={','.join(args.bias)} reps={args.reps}"
        + ("" if max_temp is None else f" max temp {max_temp / 2**30:.1f} GiB")
    )
    print(flush=True)

    # jax.nn first: the others are compared with it.
    ordered = sorted(impls, key=lambda n: n != PEER_JAX_NN)
    results = []
    cases = [(h, t, c, p, b) for h in args.head_dims for t in args.seq_lens for c in causals
             for b in args.bias for p in passes]
    for head_dim, seq_len, causal, pass_, bias in cases:
        config = (pass_, causal, head_dim, seq_len, args.batch, args.heads, args.dtype)
        if args.time_budget is not None and time.monotonic() - start >= args.time_budget:
            case = [_cell(impl, *config, bias) for impl in ordered]
            for r in case:
                r.status = CUT
        else:
            case = measure_case(
                ordered, *config, args.reps, max_temp, args.max_seconds, bias
            )
        results.extend(case)
        _attach_ratios(results, peaks)
        for line in format_table(case, on_gpu).splitlines()[2:]:
            print(line, flush=True)
        if args.json:
            _write_json(args.json, env, args, skipped, results, done=False)
    _attach_ratios(results, peaks)
    print()
    print(format_table(results, on_gpu))
    print(
        "\nx jax.nn: jax.nn.dot_product_attention(implementation='xla') time / this time "
        "(> 1 is faster); x torch: the same for torch's scaled_dot_product_attention. % peak: "
        "of the CPU's peak for the dtype (above). cores (CPU): each thread's FMA rate with all "
        "threads at once over one thread's alone, probed before and after the case (the lower): "
        "~1 = a core each; ~0.5 = two threads shared a core, every peer ran at up to half "
        "speed and % peak is a floor. temp: compiled temporary memory (not torch's). compile: "
        "lowering + compilation."
    )
    if args.json:
        _write_json(args.json, env, args, skipped, results, done=True)
        print(f"wrote {args.json}")
    if args.plot:
        write_plot(results, args.plot, on_gpu)
        print(f"wrote {args.plot}")
    counts = status_counts(results)
    print(
        f"bench: {counts['ok']} of {len(results)} cells measured"
        + "".join(f", {n} {k}" for k, n in counts.items() if k != "ok" and n),
        f"in {time.monotonic() - start:.0f} s",
        flush=True,
    )
    return results


if __name__ == "__main__":
    main()
