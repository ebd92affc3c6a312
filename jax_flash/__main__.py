"""`python -m jax_flash`: how the installed jax_flash was built and what runs here.

Prints `jax_flash.build_info()` (the CUDA kernels' runtime and architectures, why those, the
cpu kernels' ISAs, the emulator), the ISA the cpu kernels run on this CPU, the CUDA driver,
JAX's backend, and which implementation a small bfloat16 call would run, with the reason
each other one is unavailable (`jax_flash.explain`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash import _build


def main() -> None:
    info = jax_flash.build_info()
    print(f"jax_flash {jax_flash.__version__}")
    print(info)
    if info.extension:
        from jax_flash import _jax_flash_ext as ext

        print(f"  this CPU runs: {ext.cpu_isa('')}")
    if info.cuda_runtime is not None:
        driver = _build.cuda_driver_version()
        print(f"  CUDA driver:  {_build.version_text(driver) if driver else 'none found'}")
    print(f"JAX {jax.__version__}, default backend {jax.default_backend()} ({jax.devices()[0].device_kind})")
    q = jnp.zeros((1, 128, 4, 64), jnp.bfloat16)
    print(jax_flash.explain(q, q, q))


if __name__ == "__main__":
    main()
