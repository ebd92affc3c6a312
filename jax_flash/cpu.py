"""The `cpu` implementation: the extension's tiled C++ kernels (platform Host).

flex_attention: a mask_mod and a block mask, no score_mod (the kernels cannot run a user
function). XLA evaluates mask_mod beforehand at the positions of the partly visible blocks
only, one bit each (`_flex.block_operands`); the kernels' one mask (cuda/cpu/problem.h
ClassifyTile, score_mask.h MaskScores) then skips the tiles whose blocks are all empty,
runs those whose blocks are all full unmasked and reads the bits elsewhere, forward and
backward. `count_tiles` counts the tiles the kernels compute (a debug counter).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import numpy as np

from jax_flash import _ffi, _flex, _heuristics, _registry
from jax_flash._paged_spec import PagedSpec, target_masks
from jax_flash._spec import AttentionSpec

DTYPES = ("float32", "bfloat16", "float16")
# H and Hv each up to MAX_HEAD_DIM, in any pair (the tiles take both, cuda/cpu/tiling.h).
MAX_HEAD_DIM = 512


def packs_heads(spec: AttentionSpec) -> bool:
    """GQA packing (the pack_gqa attribute): at T = 1 the G query heads of a kv head share one tile."""
    return _heuristics.cpu_packs_heads(spec)


def forward_chunks(spec: AttentionSpec) -> int:
    """The forward's split-KV chunk count (the forward_chunks attribute; `_heuristics`)."""
    return _heuristics.cpu_forward_chunks(spec)


def split_kv_description(spec: AttentionSpec) -> str:
    return _heuristics.cpu_forward_description(spec)


def isa(spec: AttentionSpec) -> str:
    """The call's ISA (Config.cpu_isa): "" (the default ISA of this CPU) or one ISA; an unknown
    one, or one this CPU lacks, is a ValueError naming JAX_FLASH_CPU_ISA when the call is traced."""
    value = _heuristics.cpu_isa(spec)
    if value:
        from jax_flash import _jax_flash_ext

        _jax_flash_ext.cpu_isa(value)
    return value


def isa_description(spec: AttentionSpec) -> str:
    """`explain`'s words for the ISA the kernels will run: the one set, or this CPU's default
    (cuda/cpu/README.md, "ISAs"), with the measured rate where it decided between avx512bf16
    and avx512."""
    from jax_flash import _jax_flash_ext

    try:
        value = isa(spec)
    except ValueError as e:
        return f"{e}: calls fail"
    if value:
        return f"ISA {value} (set by cpu_isa)"
    chosen = _jax_flash_ext.cpu_isa("")
    ratio = _jax_flash_ext.cpu_bf16_dot_over_fma() if chosen in ("avx512bf16", "avx512") else 0.0
    if ratio > 0:
        return f"ISA {chosen} (this CPU's default: bf16 dot products at {ratio:.2f}x the FLOP rate of float32 FMAs)"
    return f"ISA {chosen} (this CPU's default)"


def forward_attributes(spec: AttentionSpec) -> dict:
    """The cpu forward targets' own attributes for the (local) call `spec` (cuda/README.md): the
    ISA, the split-KV chunk count and GQA packing, decided when the call is traced."""
    return dict(isa=isa(spec), forward_chunks=np.int64(forward_chunks(spec)), pack_gqa=bool(packs_heads(spec)))


def backward_attributes(spec: AttentionSpec) -> dict:
    """The cpu backward target's own attributes: the ISA and the key-block chunks (0: the
    kernels' rule, from the size of XLA's thread pool)."""
    return dict(isa=isa(spec), gradient_chunks=np.int64(_heuristics.cpu_gradient_chunks(spec)))


@dataclasses.dataclass
class TileCounts:
    """The tiles (Q·Kᵀ products) the cpu kernels computed inside `count_tiles`: `forward`, `backward`."""

    forward: int = 0
    backward: int = 0


@contextlib.contextmanager
def count_tiles() -> Iterator[TileCounts]:
    """A debug counter of the tiles the cpu kernels compute while inside this block (every
    call's, of any thread; read when the block ends, so block on the results inside it):
    tests that the work follows a block mask. Not for concurrent use."""
    from jax_flash import _jax_flash_ext

    counts = TileCounts()
    _jax_flash_ext.cpu_count_tiles(True)
    try:
        yield counts
    finally:
        counts.forward, counts.backward = _jax_flash_ext.cpu_tile_counts()
        _jax_flash_ext.cpu_count_tiles(False)


def flex_description(spec: AttentionSpec, verbose: bool) -> str:
    """`explain`'s words for a flex_attention call with a mask_mod (`_flex.kernel_description`)."""
    tiles = f"{_heuristics.CPU_BLOCK}x{_heuristics.CPU_BLOCK} tiles"
    return _flex.kernel_description(spec, tiles, "unmasked where all full", verbose)


def _flex_masked(spec: AttentionSpec) -> bool:
    return spec.flex is not None and spec.flex.mask_mod is not None


class CpuImplementation:
    name = "cpu"

    # flex_attention: mask_mod and block masks; a score_mod is refused (_flex.score_mod_reason).
    serves_flex = True

    def unsupported(self, spec: AttentionSpec) -> str | None:
        if spec.flex is not None and spec.flex.score_mod is not None:
            return _flex.score_mod_reason(self.name)
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

    def note(self, spec: AttentionSpec) -> str | None:
        """What `explain` adds: the forward's split-KV (`_heuristics.cpu_forward_chunks`), and for a
        dense bias or mask, that it is read in place through its broadcast strides and how the
        backward reduces dbias (cuda/cpu/README.md)."""
        try:
            parts = [split_kv_description(spec)]
        except ValueError as e:  # a bad JAX_FLASH_CPU_SPLIT_KV
            parts = [f"{e}: calls fail"]
        for name, shape in (("bias", spec.bias_shape), ("mask", spec.mask_shape)):
            if shape is not None:
                parts.append(f"dense {name} {list(shape)} read in place through its broadcast strides")
        if _flex_masked(spec):
            parts.append(flex_description(spec, verbose=True))
        parts.append(isa_description(spec))
        if spec.bias_shape is None:
            return "; ".join(parts)
        dims = [
            d
            for d, n, full in zip("BNTS", spec.bias_shape, (spec.batch, spec.num_heads, spec.q_len, spec.kv_len))
            if n == 1 and full > 1
        ]
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

    def summary(self, spec: AttentionSpec) -> str:
        """`explain`'s one line: the forward's split-KV and GQA packing, and a dense bias or
        mask read in place."""
        try:
            text = _heuristics.cpu_forward_summary(spec)
        except ValueError as e:  # a bad JAX_FLASH_CPU_SPLIT_KV
            return f"{e}: calls fail"
        dense = [name for name, shape in (("bias", spec.bias_shape), ("mask", spec.mask_shape)) if shape is not None]
        if dense:
            text += f", dense {' and '.join(dense)} read in place"
        if _flex_masked(spec):
            text += ", " + flex_description(spec, verbose=False)
        return text

    def forward(self, spec, q, k, v, masks):
        # Bad settings (JAX_FLASH_CPU_ISA, JAX_FLASH_CPU_SPLIT_KV): a ValueError now.
        forward_attributes(spec)
        return _ffi.forward(self.name, "jax_flash_fwd", spec, q, k, v, masks, attributes=forward_attributes)

    # paged_attention (jax_flash/inference/paged.py): what implementation=None runs on the CPU
    # backend where it serves the call (2.9-3.0x paged xla's speed in a decode step, docs/benchmarks.md).
    paged_default = True

    def paged_unsupported(self, pspec: PagedSpec) -> str | None:
        return self.unsupported(pspec.attention) or _ffi.missing("jax_flash_paged_fwd", "cpu")

    def paged_summary(self, pspec: PagedSpec) -> str:
        return "pages read by each tile, " + self.summary(pspec.attention)

    def paged_note(self, pspec: PagedSpec) -> str:
        try:
            how = split_kv_description(pspec.attention)
        except ValueError as e:  # a bad JAX_FLASH_CPU_SPLIT_KV
            how = f"{e}: calls fail"
        return "the host forward, each key block packed from its pages' slots by the tile that visits it; " + how

    def paged_forward(self, pspec, q, key_pages, value_pages, table, lengths, sinks=None):
        """paged_attention on the host target jax_flash_paged_fwd: the forward's tiles pack each
        key block from its pages' slots as they visit it (cuda/cpu/README.md), with its split-KV
        and GQA packing. out [B, T, N, H], lse [B, N, T]. Non-finite values are the kernels' own
        business, as in `forward`."""
        spec, masks = target_masks(pspec, q, table, lengths, sinks)
        forward_attributes(spec)
        return _ffi.forward_call(
            "jax_flash_paged_fwd",
            spec,
            q,
            key_pages,
            value_pages,
            masks,
            page_table=table,
            attributes=forward_attributes,
        )

    def backward(self, spec, q, k, v, masks, out, lse, dout, dlse):
        backward_attributes(spec)
        return _ffi.backward(
            self.name, "jax_flash_bwd", spec, q, k, v, masks, out, lse, dout, dlse, attributes=backward_attributes
        )


IMPLEMENTATION = CpuImplementation()
