"""The attention table: `python -m jax_flash.bench` (with no section flag).

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
the threads had a core each during the case (`cores`, `core_share`).

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
import json
import math
import os
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import _heuristics
from jax_flash._spec import AttentionSpec
from jax_flash.bench.common import (
    Result,
    device_memory_bytes,
    environment,
    fmt_seq,
    int_list,
    is_oom,
    short,
    thread_count,
)
from jax_flash.bench.cpu_peak import core_share, cpu_peaks, format_peaks
from jax_flash.bench.pallas_tuning import tune_pallas
from jax_flash.bench.plot import require_matplotlib, write_plot

# Seconds between two timed calls on a CPU (measure_case).
SETTLE_S = 0.1

# Peers (not jax_flash) by name; jax_flash implementations are named as in `implementation=`.
PEER_JAX_NN = "jax.nn"
PEER_JAX_NN_CUDNN = "jax.nn-cudnn"
PEER_JAX_PALLAS = "jax-pallas"
PEER_TORCH = "torch"
PEERS = (PEER_JAX_NN, PEER_JAX_NN_CUDNN, PEER_JAX_PALLAS, PEER_TORCH)
FLASH = ("cuda", "pallas", "cpu", "xla")
# `pallas` is measured on each of its forward compilers: "pallas" on Triton, "pallas-mosaic" with
# the forward on Mosaic GPU (sm_90; the backward is Triton's), so that the measured table can say
# which is faster (`_heuristics.measured_pallas_backend`).
PALLAS_MOSAIC = _heuristics.MEASURED_PALLAS_MOSAIC
PALLAS_BACKENDS = {"pallas": "triton", PALLAS_MOSAIC: "mosaic_gpu"}
KNOWN = (*FLASH, PALLAS_MOSAIC, *PEERS)  # every name --impls takes
# --bias: the dense bias of a case, one letter per dim of [B, N, T, S] (1: broadcast).
BIASES = {"none": None, "t5": "1NTS", "alibi": "1N1S", "keys": "B11S"}


# ----------------------------------------------------------------------------- callables


def _attention_fn(impl: str, causal: bool, head_dim: int, bias: str = "none") -> Callable:
    """(q, k, v[, bias]) -> out [B, T, N, H] for one implementation, or raises why it cannot
    run."""
    if impl in PALLAS_BACKENDS:
        cfg = jax_flash.Config(pallas_backend=PALLAS_BACKENDS[impl])
        return lambda q, k, v, *b: jax_flash.attention(
            q, k, v, *b, is_causal=causal, implementation="pallas", config=cfg
        )
    if impl in FLASH:
        return lambda q, k, v, *b: jax_flash.attention(q, k, v, *b, is_causal=causal, implementation=impl)
    if impl == PEER_JAX_NN:
        return lambda q, k, v, *b: jax.nn.dot_product_attention(q, k, v, *b, is_causal=causal, implementation="xla")
    if impl == PEER_JAX_NN_CUDNN:
        return lambda q, k, v, *b: jax.nn.dot_product_attention(q, k, v, *b, is_causal=causal, implementation="cudnn")
    if bias != "none":
        raise ValueError(f"{impl} is not measured with a dense bias")
    if impl == PEER_JAX_PALLAS:
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention

        scale = 1.0 / math.sqrt(head_dim)
        return lambda q, k, v: pallas_attention.mha(q, k, v, None, sm_scale=scale, causal=causal)
    raise ValueError(f"unknown implementation {impl!r}; known: {KNOWN}")


def _torch_fn(pass_: str, causal: bool, args: list) -> Callable:
    """A no-argument callable running torch's CPU scaled_dot_product_attention on copies of
    `args` (BTNH jax arrays, transposed to torch's BNTH), forward or forward+backward."""
    import torch

    torch.set_num_threads(thread_count())
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[str(args[0].dtype)]

    def tensor(a, grad):
        t = torch.from_numpy(np.asarray(a, np.float32)).to(dtype).transpose(1, 2).contiguous()
        return t.requires_grad_(grad)

    sdpa = torch.nn.functional.scaled_dot_product_attention
    if pass_ == "fwd":
        q, k, v = (tensor(a, False) for a in args[:3])

        def run_forward():
            with torch.no_grad():
                sdpa(q, k, v, is_causal=causal)

        return run_forward
    q, k, v = (tensor(a, True) for a in args[:3])
    do = tensor(args[3], False)

    def run_fwdbwd():
        for t in (q, k, v):
            t.grad = None
        sdpa(q, k, v, is_causal=causal).backward(do)

    return run_fwdbwd


def pass_fn(attn: Callable, pass_: str) -> Callable:
    """The forward, or forward+backward in every argument but the last (dO): q, k, v and the
    bias if there is one."""
    if pass_ == "fwd":
        return attn

    def fwdbwd(*args):
        out, vjp = jax.vjp(attn, *args[:-1])
        return out, vjp(args[-1])

    return fwdbwd


def bias_shape(kind: str, batch: int, heads: int, seq_len: int) -> tuple | None:
    """The [B|1, N|1, T|1, S|1] shape of a --bias kind (None: no bias)."""
    dims = BIASES[kind]
    if dims is None:
        return None
    full = dict(B=batch, N=heads, T=seq_len, S=seq_len)
    return tuple(1 if c == "1" else full[c] for c in dims)


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
        impl,
        pass_,
        causal,
        head_dim,
        seq_len,
        batch,
        heads,
        dtype,
        spec.flops(pass_ == "fwdbwd"),
        bias=bias,
    )


def prepare(impl, pass_, causal, head_dim, seq_len, batch, heads, dtype, max_temp_bytes, bias="none"):
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
        except Exception as e:  # reported in the table
            r.status = f"failed: {short(e)}"
            return r, None, None
    try:
        fn = pass_fn(_attention_fn(impl, causal, head_dim, bias), pass_)
        t0 = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        r.compile_s = time.perf_counter() - t0
    except Exception as e:  # reported in the table
        r.status = "OOM" if is_oom(e) else f"failed: {short(e)}"
        return r, None, None
    try:
        analysis = compiled.memory_analysis()
        r.temp_bytes = None if analysis is None else int(analysis.temp_size_in_bytes)
    except Exception:  # some backends have no memory analysis
        r.temp_bytes = None
    if max_temp_bytes is not None and r.temp_bytes is not None and r.temp_bytes > max_temp_bytes:
        r.status = f"skipped: needs {r.temp_bytes / 2**30:.1f} GiB temp > --max-temp-gib {max_temp_bytes / 2**30:.1f}"
        return r, None, None
    return r, compiled, args


def _run_once(r: Result, compiled, args) -> float | None:
    """Seconds for one call, or None (and r.status set) when it fails."""
    try:
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        return time.perf_counter() - t0
    except Exception as e:  # reported in the table
        r.status = "OOM" if is_oom(e) else f"failed: {short(e)}"
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
    max_temp_bytes: int | None,
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
    shares = [core_share()] if on_cpu else []
    cells = []  # [result, compiled or None, args, times]
    for impl in impls:
        r, compiled, args = prepare(impl, pass_, causal, head_dim, seq_len, batch, heads, dtype, max_temp_bytes, bias)
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
        shares.append(core_share())
    for r, _, _, times in cells:
        if shares and None not in shares:
            r.core_share = min(s for s in shares if s is not None)
        if r.status == "ok" and times:
            r.time_s = statistics.median(times)
            r.reps = len(times)
            r.flops_per_s = r.flops / r.time_s
    return [c[0] for c in cells]


def measure(impl: str, *args, **kwargs) -> Result:
    """One cell of the table (see measure_case)."""
    return measure_case([impl], *args, **kwargs)[0]


# ----------------------------------------------------------------------------- which impls


def torch_unavailable(on_gpu: bool) -> str | None:
    """None if torch's CPU SDPA can be measured here, else why not."""
    if on_gpu:
        return "the torch peer is PyTorch's CPU kernel, measured on a CPU backend only"
    try:
        import torch  # noqa: F401
    except Exception as e:
        return f"does not import ({short(e, 60)}); pip install torch"
    return None


def available_impls(requested: list[str] | None, dtype: str) -> tuple[list[str], dict]:
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
    mosaic = jax_flash.explain(
        probe, probe, probe, implementation="pallas", config=jax_flash.Config(pallas_backend="mosaic_gpu")
    )
    if mosaic.reasons.get("pallas") is None:
        names.append(PALLAS_MOSAIC)
    else:
        skipped[PALLAS_MOSAIC] = mosaic.reasons["pallas"]
    names.append(PEER_JAX_NN)
    if on_gpu:
        names.append(PEER_JAX_NN_CUDNN)
        try:
            from jax.experimental.pallas.ops.gpu import attention  # noqa: F401

            names.append(PEER_JAX_PALLAS)
        except Exception as e:
            skipped[PEER_JAX_PALLAS] = f"does not import: {short(e)}"
    else:
        skipped[PEER_JAX_NN_CUDNN] = "needs a GPU"
        skipped[PEER_JAX_PALLAS] = "needs a GPU"
    why_not_torch = torch_unavailable(on_gpu)
    if why_not_torch is None:
        names.append(PEER_TORCH)
    else:
        skipped[PEER_TORCH] = why_not_torch
    if requested:
        unknown = [n for n in requested if n not in KNOWN]
        if unknown:
            raise SystemExit(f"--impls: unknown {unknown}; known: {', '.join(KNOWN)}")
        # A requested implementation runs even if it looks unavailable: the table then says
        # why it failed.
        names = list(requested)
        skipped = {k: v for k, v in skipped.items() if k not in requested}
    return names, skipped


# ----------------------------------------------------------------------------- report


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
            f"{fmt_seq(r.seq_len):>6s} {time_ms:>10s} {tput:>9s} {ratio:>9s} {vs_torch:>8s} "
            f"{peak:>7s} {cores:>5s} {temp:>10s} {comp:>9s}  "
            f"{r.status}"
        )
    return "\n".join(lines)


def _attach_ratios(results: list[Result], peaks: dict | None = None) -> None:
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
        help=f"comma list among {', '.join(KNOWN)} (default: every one available)",
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
        help="first tune the Pallas block sizes with jax_flash.pallas._tune.tune(...)",
    )
    args = p.parse_args(argv)
    args.seq_lens = int_list(args.seq_lens)
    args.head_dims = int_list(args.head_dims)
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


def main(argv=None) -> list[Result]:
    """The attention table over the options of `parse_args`."""
    start = time.monotonic()
    args = parse_args(argv)
    if args.plot:
        require_matplotlib()  # before a run of minutes, not after it
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    env = environment()
    print(
        f"jax_flash {env['jax_flash']}, jax {env['jax']}, backend {env['backend']} "
        f"({env['device']}, {env['cpu_count']} CPUs), {env['date']}"
    )
    if args.tune_pallas:
        tune_pallas(args)
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
                print(
                    f"cpu kernels: ISA {isa}, {thread_count()} threads"
                    + (f"; torch: {thread_count()} threads" if PEER_TORCH in impls else "")
                )
                for h in args.head_dims:
                    b = _jax_flash_ext.cpu_blocking(h, args.dtype, isa in ("amx", "avx512bf16", "amx_emulated"))
                    print(
                        f"  blocking H={h}: {b['block_q']} x {b['block_k']}, tile step "
                        f"forward {b['forward_bytes'] / 2**10:.0f} KiB, backward "
                        f"{b['backward_bytes'] / 2**10:.0f} KiB"
                    )
    env["peaks"] = dict(peaks)
    max_temp: int | None
    if args.max_temp_gib is not None:
        max_temp = int(args.max_temp_gib * 2**30)
    else:
        mem = device_memory_bytes()
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
    cases = [
        (h, t, c, p, b)
        for h in args.head_dims
        for t in args.seq_lens
        for c in causals
        for b in args.bias
        for p in passes
    ]
    for head_dim, seq_len, causal, pass_, bias in cases:
        config = (pass_, causal, head_dim, seq_len, args.batch, args.heads, args.dtype)
        if args.time_budget is not None and time.monotonic() - start >= args.time_budget:
            case = [_cell(impl, *config, bias) for impl in ordered]
            for r in case:
                r.status = CUT
        else:
            case = measure_case(ordered, *config, args.reps, max_temp, args.max_seconds, bias)
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
