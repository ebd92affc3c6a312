"""What every section of the benchmark shares: the machine's description, its memory, how a
failure is reported, and the parsing of size lists."""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform as _platform

import jax

import jax_flash
from jax_flash import _registry


def thread_count() -> int:
    """The threads the cpu kernels use (JAX_FLASH_CPU_THREADS, else every CPU): torch gets
    as many."""
    try:
        n = int(os.environ.get("JAX_FLASH_CPU_THREADS", "0"))
    except ValueError:
        n = 0
    return n if n > 0 else (os.cpu_count() or 1)


def is_oom(e: BaseException) -> bool:
    text = f"{type(e).__name__}: {e}"
    return any(s in text for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "MemoryError"))


def short(e: BaseException, limit: int = 90) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory_bytes() -> int | None:
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return physical_memory_bytes()
    try:
        stats = dev.memory_stats() or {}
        return stats.get("bytes_limit")
    except Exception:  # not every backend has memory stats
        return None


def fmt_seq(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)


def environment() -> dict:
    dev = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "jax_flash": jax_flash.__version__,
        "backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)),
        # "sm_90" on an NVIDIA GPU (the measured choices are kept per architecture), else None.
        "arch": _registry.device_arch(),
        "cpu_count": os.cpu_count(),
        "machine": _platform.machine(),
        "python": _platform.python_version(),
    }


def int_list(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1024 if part.endswith("k") else 1
        out.append(int(part.rstrip("k")) * mult)
    return out


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
    time_s: float | None = None
    flops_per_s: float | None = None
    temp_bytes: int | None = None
    compile_s: float | None = None  # lowering + compilation
    vs_jax_nn: float | None = None  # jax.nn time / this time (>1: faster than jax.nn)
    vs_torch: float | None = None  # torch time / this time (>1: faster than torch)
    peak_fraction: float | None = None  # flops_per_s / the CPU's peak for the dtype
    core_share: float | None = None  # CPU: core_share before and after the case, the lower
    reps: int = 0
    bias: str = "none"  # BIASES

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["pass"] = d.pop("pass_")
        return d
