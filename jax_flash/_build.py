"""What the installed extension was built with (`jax_flash.build_info()`), and the CUDA driver
it finds: the facts the `cuda` implementation checks before it runs (docs/installation.md).

The extension records its build when it is compiled (cuda/CMakeLists.txt): the CUDA runtime
its kernels link statically (or none), the architectures of their images and why those were
chosen, and the ISAs of the cpu kernels. The host emulation of the CUDA kernels is a module of
its own (`jax_flash._jax_flash_emu`), present only in builds made with JAX_FLASH_EMULATOR=ON.
"""

from __future__ import annotations

import dataclasses
import importlib.util

# The CUDA driver that each major version of the runtime needs on Linux (the minimum of its
# minor-version compatibility: any 13.x runtime runs on a 13.0 driver), from NVIDIA's CUDA
# Toolkit release notes, table "CUDA Toolkit and Minimum Required Driver Version".
MINIMUM_LINUX_DRIVER = {12: "525.60.13", 13: "580.65.06"}
# The wheel flavours, by the CUDA major version their kernels are built with.
FLAVOURS = {12: "cuda12", 13: "cuda13"}


def _extension():
    """The native extension module, or None where it is not built."""
    try:
        from jax_flash import _jax_flash_ext
    except ImportError:
        return None
    return _jax_flash_ext


def version_text(version: int) -> str:
    """A CUDA version as the runtime and driver report it (12080) in words ("12.8")."""
    return f"{version // 1000}.{version % 1000 // 10}"


@dataclasses.dataclass(frozen=True)
class BuildInfo:
    """How the installed jax_flash was built: what `jax_flash.build_info()` returns.

    Attributes:
      extension: whether the native extension is present (the cpu and cuda implementations).
      cuda_runtime: the CUDA runtime the kernels are linked against (statically), e.g. "13.0";
        None without CUDA kernels.
      flavour: "cuda13", "cuda12" (CUDA kernels of that major version) or "cpu" (none).
      sass: the GPU architectures with a cubin (machine code), e.g. ("sm_80", "sm_90").
      ptx: the virtual architectures with a PTX image that the driver JIT-compiles for any
        later GPU, e.g. ("compute_80",).
      cuda_selection: why the build holds those architectures (JAX_FLASH_CUDA, JAX_FLASH_CUDA_ARCHS,
        or what AUTO found: the visible GPUs, no GPU, no nvcc).
      cpu_isas: the ISAs the cpu kernels are compiled for (which one runs is chosen at run time).
      emulator: whether the host emulation of the CUDA kernels is installed (JAX_FLASH_EMULATOR=ON
        builds, for tests).
      compiler: the host compiler of the extension.
    """

    extension: bool
    cuda_runtime: str | None
    flavour: str
    sass: tuple[str, ...]
    ptx: tuple[str, ...]
    cuda_selection: str
    cpu_isas: tuple[str, ...]
    emulator: bool
    compiler: str

    def __str__(self) -> str:
        if self.cuda_runtime is None:
            cuda = f"no CUDA kernels ({self.cuda_selection})"
        else:
            images = ", ".join(self.sass) + (f"; PTX {', '.join(self.ptx)}" if self.ptx else "")
            cuda = f"CUDA {self.cuda_runtime} runtime (static), cubins {images} ({self.cuda_selection})"
        lines = [
            f"jax_flash build: {self.flavour}",
            f"  cuda kernels: {cuda}" if self.extension else "  native extension: not built",
            f"  cpu kernels:  {', '.join(self.cpu_isas)}" if self.extension else "",
            f"  emulator:     {'installed' if self.emulator else 'not installed'}",
            f"  compiler:     {self.compiler}" if self.extension else "",
        ]
        return "\n".join(line for line in lines if line)


def _images(architectures: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(cubins, PTX images) of CMake's architecture list ("80-real,80-virtual,90")."""
    sass, ptx = [], []
    for entry in filter(None, architectures.split(",")):
        number, _, kind = entry.partition("-")
        if kind in ("", "real"):
            sass.append(f"sm_{number}")
        if kind in ("", "virtual"):
            ptx.append(f"compute_{number}")
    return tuple(sass), tuple(ptx)


def build_info() -> BuildInfo:
    """How the installed jax_flash was built: the CUDA runtime of its kernels, the architectures
    with cubins and with PTX, why those, the cpu kernels' ISAs, and whether the emulator is
    installed. `print(jax_flash.build_info())` (or `python -m jax_flash`) shows it."""
    emulator = importlib.util.find_spec("jax_flash._jax_flash_emu") is not None
    ext = _extension()
    if ext is None:
        return BuildInfo(False, None, "cpu", (), (), "no native extension", (), emulator, "")
    raw = ext.build_info()
    runtime = raw["cuda_runtime_version"]
    sass, ptx = _images(raw["cuda_architectures"])
    return BuildInfo(
        extension=True,
        cuda_runtime=version_text(runtime) if runtime else None,
        flavour=FLAVOURS.get(runtime // 1000, f"cuda{runtime // 1000}") if runtime else "cpu",
        sass=sass,
        ptx=ptx,
        cuda_selection=raw["cuda_selection"],
        cpu_isas=tuple(raw["cpu_isas"]),
        emulator=emulator,
        compiler=raw["compiler"],
    )


def cuda_runtime_version() -> int:
    """CUDART_VERSION of the runtime the kernels link (13000 for 13.0); 0 without kernels."""
    ext = _extension()
    return ext.build_info()["cuda_runtime_version"] if ext is not None else 0


def cuda_driver_version() -> int:
    """The installed driver's CUDA version (12080 for 12.8; cudaDriverGetVersion through the
    extension); 0 without a driver or without CUDA kernels."""
    ext = _extension()
    return ext.cuda_driver_version() if ext is not None else 0


def driver_reason(driver: int, runtime: int, image: str) -> str | None:
    """Why a driver of CUDA version `driver` cannot run kernels built with runtime `runtime`
    whose GPU runs `image` ("sm_90", or "compute_80 PTX"), or None when it can.

    The static runtime needs a driver of its major version or newer (CUDA's minor-version
    compatibility); a PTX image also needs a driver at least as new as the toolkit that wrote
    it (an older one cannot JIT-compile newer PTX)."""
    need_major = runtime // 1000
    required = MINIMUM_LINUX_DRIVER.get(need_major)
    driver_words = (
        f"this driver supports CUDA {version_text(driver)}" if driver else "no NVIDIA driver library was found"
    )
    if driver // 1000 < need_major:
        other = FLAVOURS.get(driver // 1000)
        fix = (
            f'; or install the {other} flavour of jax_flash (pip install "jax_flash[{other}]" with the {other} '
            "wheel, docs/installation.md)"
            if other
            else ""
        )
        return (
            f"the kernels link the CUDA {version_text(runtime)} runtime, which needs a driver for CUDA "
            f"{need_major}.0 or newer" + (f" (Linux {required} or newer)" if required else "") + f", and "
            f"{driver_words}: update the NVIDIA driver{fix}"
        )
    if image.endswith("PTX") and driver < runtime:
        return (
            f"this GPU runs the {image} image, written by CUDA {version_text(runtime)}, and {driver_words}, "
            f"which cannot JIT-compile it: update the NVIDIA driver to one for CUDA {version_text(runtime)} "
            "or newer, or build for this GPU (JAX_FLASH_CUDA_ARCHS, docs/installation.md)"
        )
    return None
