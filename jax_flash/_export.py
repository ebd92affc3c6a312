"""`jax.export` of functions that call the compiled implementations.

The `cpu` and `cuda` implementations are XLA FFI custom calls. `jax.export` refuses custom
calls without a compatibility guarantee unless they are named in `disabled_checks`: these
are. What that waives: an exported artifact that holds them runs only where a jax_flash with
the same FFI targets is imported (importing jax_flash registers them), so export and load
with the same jax_flash version.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jax.export import DisabledSafetyCheck

# Every FFI target jax_flash registers: the C++ cpu kernels and the CUDA kernels (the same
# names on both platforms), and the host emulation of the CUDA kernels (tests).
FFI_TARGETS = (
    "jax_flash_fwd",
    "jax_flash_bwd",
    "jax_flash_paged_fwd",
    "jax_flash_emu_fwd",
    "jax_flash_emu_bwd",
    "jax_flash_emu_paged_fwd",
)


def export_disabled_checks() -> list[DisabledSafetyCheck]:
    """The `disabled_checks` that `jax.export.export` needs for a function using jax_flash::

        exported = jax.export.export(jax.jit(f), disabled_checks=jax_flash.export_disabled_checks())(*args)

    (`xla` and `pallas` need none; passing these anyway is harmless.)

    Example:

    >>> import jax
    >>> import jax.numpy as jnp
    >>> import jax_flash
    >>> q = jnp.ones((1, 8, 2, 16), jnp.float32)
    >>> f = jax.jit(lambda q: jax_flash.attention(q, q, q))
    >>> exported = jax.export.export(f, disabled_checks=jax_flash.export_disabled_checks())(q)
    >>> exported.call(q).shape
    (1, 8, 2, 16)
    """
    from jax import export

    return [export.DisabledSafetyCheck.custom_call(name) for name in FFI_TARGETS]
