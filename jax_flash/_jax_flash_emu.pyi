"""Types of the CUDA kernels' host emulation module (nanobind, built from cuda/emu/module.cc
with JAX_FLASH_EMULATOR=ON, for tests and CI; not part of a user's install)."""

from typing_extensions import CapsuleType

def registrations() -> dict[str, dict[str, CapsuleType]]:
    """FFI handler capsules by platform: {'cpu': {'jax_flash_emu_fwd': capsule, ...}}, the CUDA
    kernels compiled for the host against the emulation of the SIMT model and of each PTX
    instruction."""

def count_tiles(on: bool) -> None:
    """Starts (True: from zero) or stops the debug count of the tiles the emulated kernels
    compute."""

def tile_counts() -> tuple[int, int, int, int, int, int, int]:
    """(forward, backward, backward dQ kernel, forward by the plain kernel, of them masked,
    backward by the plain kernel, of them masked): the tiles counted since count_tiles(True)."""
