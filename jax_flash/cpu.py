"""The `cpu` implementation: the extension's tiled C++ kernels (platform Host)."""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from jax_flash import _ffi, _registry
from jax_flash._spec import AttentionSpec
from jax_flash.inference import split_kv

DTYPES = ("float32", "bfloat16", "float16")
# H and Hv each up to MAX_HEAD_DIM, in any pair (the tiles take both, cuda/cpu/tiling.h).
MAX_HEAD_DIM = 512


# The forward's split-KV rule (the kernels receive the count as the forward_chunks attribute;
# JAX_FLASH_CPU_SPLIT_KV overrides it when the call is traced): with fewer than FORWARD_ITEMS
# work items (cuda/cpu/tiling.h ForwardQueryItems), each item's keys are cut into chunks of at
# least MIN_CHUNK_KEY_BLOCKS 128-key blocks, merged by lse.
BLOCK = 128
FORWARD_ITEMS = 16
MAX_FORWARD_CHUNKS = 16
MIN_CHUNK_KEY_BLOCKS = 4


def packs_heads(spec: AttentionSpec) -> bool:
    """GQA packing (the pack_gqa attribute; tiling.h ForwardBlock): at T = 1 the G query heads of
    a kv head share one tile."""
    return split_kv.packs_query_heads(spec, BLOCK)


def forward_items(spec: AttentionSpec) -> int:
    if packs_heads(spec):
        return spec.batch * spec.num_kv_heads
    return spec.batch * spec.num_heads * -(-spec.q_len // BLOCK)


def forward_chunks(spec: AttentionSpec) -> int:
    return split_kv.chunk_count(forward_items(spec), FORWARD_ITEMS, -(-spec.kv_len // BLOCK), MIN_CHUNK_KEY_BLOCKS,
                                MAX_FORWARD_CHUNKS)


def split_kv_setting() -> Optional[int]:
    """JAX_FLASH_CPU_SPLIT_KV: None (unset or empty: the rule), else the forced chunk count (the
    kernels cap it at one 128-key block per chunk)."""
    return split_kv.forced_chunks("JAX_FLASH_CPU_SPLIT_KV", "the cpu forward's split-KV")


def gradient_chunks_setting() -> int:
    """JAX_FLASH_CPU_GRADIENT_CHUNKS: 0 (unset or empty: the kernels' rule, from the size of XLA's
    thread pool), else the forced count of the backward's key-block chunks, 1 to 4 (the kernels cap
    it at one key block per chunk)."""
    value = os.environ.get("JAX_FLASH_CPU_GRADIENT_CHUNKS", "")
    if not value:
        return 0
    try:
        chunks = int(value)
    except ValueError:
        raise ValueError(f"JAX_FLASH_CPU_GRADIENT_CHUNKS={value!r} is not a chunk count of the cpu backward "
                         "(an integer, 1 to 4)") from None
    return min(max(chunks, 1), 4)


def isa() -> str:
    """JAX_FLASH_CPU_ISA: "" (unset: the widest ISA this CPU runs) or one of amx, avx512bf16,
    avx512, avx2, generic, amx_emulated; an unknown one, or one this CPU lacks, is a ValueError
    naming the variable."""
    value = os.environ.get("JAX_FLASH_CPU_ISA", "")
    if value:
        from jax_flash import _jax_flash_ext

        _jax_flash_ext.cpu_isa(value)
    return value


def forward_attributes(spec: AttentionSpec) -> dict:
    """The cpu forward targets' own attributes for the (local) call `spec`: the ISA, the split-KV
    chunk count and GQA packing (cuda/README.md), decided when the call is traced."""
    forced = split_kv_setting()
    return dict(isa=isa(), forward_chunks=np.int64(forward_chunks(spec) if forced is None else forced),
                pack_gqa=bool(packs_heads(spec)))


def backward_attributes(spec: AttentionSpec) -> dict:
    """The cpu backward target's own attributes: the ISA and the key-block chunks (0: the rule)."""
    return dict(isa=isa(), gradient_chunks=np.int64(gradient_chunks_setting()))


def split_kv_description(spec: AttentionSpec) -> str:
    chunks = forward_chunks(spec)
    packing = (f"GQA packing: the {spec.num_heads // spec.num_kv_heads} query heads of each kv head in one tile, "
               if packs_heads(spec) else "")
    rule = (f"split-KV when the items (B·N·ceil(T/{BLOCK}), or B·K with GQA packing at T = 1) "
            f"are fewer than {FORWARD_ITEMS}: "
            f"min(ceil({FORWARD_ITEMS} / items), {MAX_FORWARD_CHUNKS}, ceil(S/{BLOCK}) // {MIN_CHUNK_KEY_BLOCKS}) "
            "key chunks per query block, merged by lse in chunk order")
    if chunks == 1:
        return f"forward: {packing}no split-KV ({rule})"
    return f"forward: {packing}split-KV into {chunks} key chunks ({rule})"


class CpuImplementation:
    name = "cpu"

    def unsupported(self, spec: AttentionSpec) -> Optional[str]:
        if _registry.platform() != "cpu":
            return f"runs on the CPU backend only (the default backend is {_registry.platform()})"
        why = _ffi.missing("jax_flash_fwd", "cpu") or _ffi.missing("jax_flash_bwd", "cpu")
        if why:
            return why
        if spec.head_dim > MAX_HEAD_DIM:
            return f"supports head dims up to {MAX_HEAD_DIM}, got {spec.head_dim}"
        if spec.v_head_dim > MAX_HEAD_DIM:
            return f"supports value head dims up to {MAX_HEAD_DIM}, got {spec.v_head_dim}"
        return _ffi.compiled_kernel_reason(spec, DTYPES)

    def head_dims(self) -> str:
        return f"any pair with H, Hv <= {MAX_HEAD_DIM}"

    def note(self, spec: AttentionSpec) -> Optional[str]:
        """What `explain` adds: the forward's split-KV (the rule of cuda/cpu/tiling.h), and for a
        dense bias or mask, that it is read in place through its broadcast strides and how the
        backward reduces dbias (cuda/cpu/README.md)."""
        parts = [split_kv_description(spec)]
        for name, shape in (("bias", spec.bias_shape), ("mask", spec.mask_shape)):
            if shape is not None:
                parts.append(f"dense {name} {list(shape)} read in place through its broadcast strides")
        if spec.bias_shape is None:
            return "; ".join(parts)
        dims = [d for d, n, full in zip("BNTS", spec.bias_shape,
                                        (spec.batch, spec.num_heads, spec.q_len, spec.kv_len))
                if n == 1 and full > 1]
        if dims:
            text = f"dbias summed over {', '.join(dims)} inside the backward"
            shared = [d for d in dims if d in "BN"]
            if shared:
                every = " and every ".join({"B": "batch row", "N": "head"}[d] for d in shared)
                text += f" (a backward work item then runs every {every} of its key chunk, in order)"
            parts.append(text)
        else:
            parts.append("dbias written tile by tile")
        return "; ".join(parts)

    def forward(self, spec, q, k, v, masks):
        return _ffi.forward(self.name, "jax_flash_fwd", spec, q, k, v, masks, attributes=forward_attributes)

    def paged_forward(self, pspec, q, key_pages, value_pages, table, lengths, sinks=None):
        """paged_attention (jax_flash/inference/paged.py) on the host target
        jax_flash_paged_fwd: the forward's tiles pack each key block from its pages' slots as
        they visit it (cuda/cpu/README.md), with its split-KV and GQA packing. out [B, T, N,
        H], lse [B, N, T]. Non-finite values are the kernels' own business, as in `forward`."""
        from jax_flash.inference import paged

        spec, masks = paged.target_masks(pspec, q, table, lengths, sinks)
        return _ffi.forward_call("jax_flash_paged_fwd", spec, q, key_pages, value_pages, masks, page_table=table,
                                 attributes=forward_attributes)

    def backward(self, spec, q, k, v, masks, out, lse, dout, dlse):
        return _ffi.backward(self.name, "jax_flash_bwd", spec, q, k, v, masks, out, lse, dout, dlse,
                             attributes=backward_attributes)


IMPLEMENTATION = CpuImplementation()
