"""The `cuda` implementation: the extension's mma.sync kernels (platform CUDA).

With JAX_FLASH_EMULATE_CUDA=1 on a CPU backend, the same kernel source compiled for the host
against an emulation of the SIMT model and of each PTX instruction runs instead (targets
`jax_flash_emu_*`): slow, for testing the kernels without a GPU.

JAX_FLASH_DETERMINISTIC=1 makes the backward accumulate dQ without racing atomics.
"""

from __future__ import annotations

import os
from typing import Optional

import jax

from jax_flash import _ffi, _registry
from jax_flash._spec import AttentionSpec

DTYPES = ("float16", "bfloat16")
# Head dims with compiled instantiations (cuda/kernels, build/generate_kernels.py).
HEAD_DIMS = (32, 64, 96, 128)
MIN_COMPUTE_CAPABILITY = (8, 0)


def emulated() -> bool:
    return os.environ.get("JAX_FLASH_EMULATE_CUDA", "") == "1"


def deterministic() -> bool:
    return os.environ.get("JAX_FLASH_DETERMINISTIC", "") == "1"


def _prefix() -> str:
    return "jax_flash_emu" if emulated() else "jax_flash"


def _compute_capability() -> Optional[tuple[int, int]]:
    cc = getattr(jax.devices()[0], "compute_capability", None)
    if cc is None:
        return None
    major, minor = str(cc).split(".")[:2]
    return int(major), int(minor)


class CudaImplementation:
    name = "cuda"

    def unsupported(self, spec: AttentionSpec) -> Optional[str]:
        plat = _registry.platform()
        if emulated():
            if plat != "cpu":
                return "JAX_FLASH_EMULATE_CUDA=1 emulates the kernels on the CPU backend only"
            why = _ffi.missing("jax_flash_emu_fwd", "cpu") or _ffi.missing("jax_flash_emu_bwd", "cpu")
            if why:
                return why
        else:
            if plat != "gpu":
                return f"needs an NVIDIA GPU (the default backend is {plat})"
            if not _ffi.has_cuda_kernels():
                why = _ffi.missing("jax_flash_fwd", "cpu")
                return why or "the extension was built without CUDA kernels (no nvcc at build time)"
            cc = _compute_capability()
            if cc is None:
                return "the GPU is not an NVIDIA CUDA device"
            if cc < MIN_COMPUTE_CAPABILITY:
                return f"needs compute capability 8.0 or newer, the GPU has {cc[0]}.{cc[1]}"
        if spec.head_dim not in HEAD_DIMS:
            return f"has kernels for head dims {HEAD_DIMS}, got {spec.head_dim}"
        return _ffi.compiled_kernel_reason(spec, DTYPES)

    def forward(self, spec, q, k, v, masks):
        return _ffi.forward(f"{_prefix()}_fwd", spec, q, k, v, masks)

    def backward(self, spec, q, k, v, masks, out, lse, dout, dlse):
        return _ffi.backward(
            f"{_prefix()}_bwd", spec, q, k, v, masks, out, lse, dout, dlse,
            deterministic=deterministic(),
        )


IMPLEMENTATION = CudaImplementation()
