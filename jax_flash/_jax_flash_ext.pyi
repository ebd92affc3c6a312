"""Types of the native extension module (nanobind, built from cuda/ffi/module.cc and
cuda/cpu/targets.cc). The FFI handlers themselves are PyCapsules that
`jax.ffi.register_ffi_target` takes; the rest are small host queries."""

from typing import Literal, TypedDict

from typing_extensions import CapsuleType

class _CpuBlocking(TypedDict):
    block_q: int
    block_k: int
    key_block_bytes: int
    forward_bytes: int
    backward_bytes: int

def registrations() -> dict[str, dict[str, CapsuleType]]:
    """FFI handler capsules by platform: {'cpu': {name: capsule}, 'CUDA': {name: capsule}}."""

def has_cuda() -> bool:
    """Whether the CUDA kernels were compiled into this module."""

def cuda_architectures() -> str:
    """The CUDA architectures of the kernels' images, comma-separated as CMake spells them
    ("80-real,80-virtual,..."); empty without CUDA kernels."""

class _BuildInfo(TypedDict):
    cuda_runtime_version: int
    cuda_architectures: str
    cuda_selection: str
    cpu_isas: list[str]
    compiler: str

def build_info() -> _BuildInfo:
    """How this module was built: cuda_runtime_version (CUDART_VERSION of the static runtime the
    kernels link, 0 without them), cuda_architectures, cuda_selection (why those), cpu_isas (the
    ISAs with cpu kernels), compiler."""

def cuda_driver_version() -> int:
    """The installed driver's CUDA version (12080 for 12.8), 0 without a driver or without CUDA kernels."""

def cpu_core_share(threads: int) -> float:
    """Each thread's FMA rate with `threads` threads running FMAs at once, over one thread's
    alone (the slowest's): ~1 with a core each, ~1/2 where two share a core; 0 off x86-64."""

def cpu_clock_ghz() -> float:
    """One core's clock now (GHz), measured with a chain of dependent adds (0 off x86-64)."""

def cpu_thread_limit() -> int:
    """The process-wide cap on the cpu kernels' threads (0: every thread of XLA's pool), read from
    JAX_FLASH_CPU_THREADS once, when the extension is loaded."""

def set_cpu_thread_limit(threads: int) -> int:
    """Sets the process-wide cap on the cpu kernels' threads (0: none); returns the previous cap.
    Results are bitwise the same for every cap."""

def cpu_isa(requested: str | None = None) -> str:
    """The ISA the cpu kernels run for `requested` ("": the default, cpu_default_isa's rule on
    this CPU; None: the value of JAX_FLASH_CPU_ISA); a ValueError naming JAX_FLASH_CPU_ISA when
    it is unknown or this CPU lacks it."""

def cpu_default_isa(amx: bool, avx512bf16: bool, avx512: bool, avx2: bool, bf16_dot_over_fma: float) -> str:
    """The default ISA's rule (cpu_isa("") applies it to this CPU): amx where granted; else
    avx512bf16 where bf16_dot_over_fma >= 1, else avx512; else avx2; else generic."""

def cpu_bf16_dot_over_fma() -> float:
    """FLOP/s of vdpbf16ps over those of vfmadd231ps on this CPU, measured once (0 without
    AVX-512 BF16)."""

def cpu_blocking(h: int, dtype: Literal["float32", "bfloat16", "float16"], bf16_products: bool, /) -> _CpuBlocking:
    """(H, dtype, bf16_products) -> the cpu kernels' tile blocking (tiling.h BlockingFor):
    block sizes and the bytes one worker's forward / backward tile step keeps hot."""

def cpu_count_tiles(on: bool) -> None:
    """Starts (True) or stops counting the tiles the cpu kernels compute, from zero (a debug
    counter: jax_flash.cpu.count_tiles)."""

def cpu_tile_counts() -> tuple[int, int]:
    """(forward, backward): the tiles (Q·Kᵀ products) the cpu kernels computed since
    cpu_count_tiles(True)."""

def cpu_gradient_chunks(b: int, n: int, k: int, t: int, s: int, h: int, threads: int) -> int:
    """(B, N, K, T, S, H, threads of XLA's pool) -> the number of key-block chunks (float32 dQ
    partials) of the single-pass backward; 1: each work item owns its query heads."""
