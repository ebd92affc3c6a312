"""jax_flash: exact tiled softmax attention for JAX (FlashAttention), four implementations
behind one function and one custom_vjp. See `attention`."""

from jax_flash._api import Explanation, attention, explain
from jax_flash.reference import attention_reference as reference

__version__ = "0.1.0"
__all__ = ["attention", "explain", "Explanation", "reference", "__version__"]
