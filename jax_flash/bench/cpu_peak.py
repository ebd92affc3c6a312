"""The CPU's peak FLOP rate per dtype (`cpu_peaks`: threads × FLOP per cycle from the CPU
flags × the clock measured by jax_flash's extension) and the probe of whether the threads had a
core each (`core_share`, the `cores` column)."""

from __future__ import annotations

from typing import Optional

from jax_flash.bench.common import thread_count

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
    threads = threads or thread_count()
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


def core_share() -> Optional[float]:
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
    share = _jax_flash_ext.cpu_core_share(thread_count())
    return share if share > 0 else None
