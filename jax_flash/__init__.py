"""jax_flash: exact tiled softmax attention for JAX (FlashAttention), four implementations
behind one function and one custom_vjp. See `attention`; `ring_attention` for sequences
sharded over a mesh axis (context parallelism), `ulysses_attention` (all-to-all to heads) and
`hybrid_attention` (all-to-all × ring on two mesh axes); `paged_attention` and `paged_cache_write`
for decoding with a paged KV cache. `build_info` says how the installed package was built (its
CUDA kernels' runtime and architectures; docs/installation.md). Call settings (`Config`, `config`) are fixed when a call
is traced (docs/configuration.md)."""

from jax_flash import _ffi
from jax_flash._api import Explanation, attention, explain
from jax_flash._build import BuildInfo, build_info
from jax_flash._config import Config, config, current_config
from jax_flash._export import export_disabled_checks
from jax_flash._flex import BlockMask, create_block_mask
from jax_flash._flex_api import flex_attention
from jax_flash.inference.paged import explain_paged, paged_attention, paged_cache_write
from jax_flash.parallel.ring import ring_attention, unzigzag, zigzag
from jax_flash.parallel.ulysses import hybrid_attention, ulysses_attention
from jax_flash.reference import (
    attention_reference as reference,
    flex_attention_reference as flex_reference,
    paged_attention_reference as paged_reference,
)

# The extension's FFI targets are registered with XLA on import (where the extension is built),
# so that a deserialized `jax.export` program that calls them runs in a process that has only
# imported jax_flash.
_ffi.targets()

__version__ = "0.1.0"
__all__ = [
    "BlockMask",
    "BuildInfo",
    "Config",
    "Explanation",
    "__version__",
    "attention",
    "build_info",
    "config",
    "create_block_mask",
    "current_config",
    "explain",
    "explain_paged",
    "export_disabled_checks",
    "flex_attention",
    "flex_reference",
    "hybrid_attention",
    "paged_attention",
    "paged_cache_write",
    "paged_reference",
    "reference",
    "ring_attention",
    "ulysses_attention",
    "unzigzag",
    "zigzag",
]
