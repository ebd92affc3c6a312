"""jax_flash: exact tiled softmax attention for JAX (FlashAttention), four implementations
behind one function and one custom_vjp. See `attention`; `ring_attention` for sequences
sharded over a mesh axis (context parallelism)."""

from jax_flash._api import Explanation, attention, explain
from jax_flash._export import export_disabled_checks
from jax_flash.parallel.ring import ring_attention, unzigzag, zigzag
from jax_flash.reference import attention_reference as reference

__version__ = "0.1.0"
__all__ = [
    "attention",
    "explain",
    "Explanation",
    "export_disabled_checks",
    "reference",
    "ring_attention",
    "zigzag",
    "unzigzag",
    "__version__",
]
