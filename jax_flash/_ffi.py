"""Calls into the compiled extension's FFI targets (see cuda/README.md for the contract).

One `jax.ffi.ffi_call` per target serves every platform the target is registered for. Each
call goes through `jax_flash.parallel.partitioning`: sharded over batch, heads or queries
under `jax.jit`, it runs on each device's shards (a `custom_partitioning` rule); under
`jax.vmap` the mapped axis is folded into the targets' one batch axis (one call, never a
loop over the mapped axis).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _flex
from jax_flash._spec import AttentionSpec, MaskInputs
from jax_flash.parallel import partitioning

_lock = threading.Lock()
_registered: dict | None = None  # platform -> set of target names
_load_error: str | None = None
_emulator_error: str | None = None

# The emulated CUDA targets (jax_flash_emu_*) live in a module of their own,
# jax_flash._jax_flash_emu, built for tests and CI only (cuda/CMakeLists.txt, JAX_FLASH_EMULATOR).
EMULATOR_PREFIX = "jax_flash_emu_"


def _register(module, found: dict) -> None:
    for plat, caps in module.registrations().items():
        for name, capsule in caps.items():
            jax.ffi.register_ffi_target(name, capsule, platform=plat)
        found.setdefault(plat, set()).update(caps)


def targets() -> dict:
    """{platform: set(target names)} registered with XLA; loads the extension (and the
    emulator's module, where it is built) once."""
    global _registered, _load_error, _emulator_error
    with _lock:
        if _registered is None and _load_error is None:
            try:
                from jax_flash import _jax_flash_ext as ext
            except ImportError as e:
                _load_error = f"the compiled extension jax_flash._jax_flash_ext is not built ({e})"
                return {}
            found: dict = {}
            _register(ext, found)
            try:
                from jax_flash import _jax_flash_emu as emu
            except ImportError as e:
                _emulator_error = (
                    "the CUDA kernels' host emulator (jax_flash._jax_flash_emu) is not built: build it with "
                    f'JAX_FLASH_EMULATOR=ON (JAX_FLASH_EMULATOR=ON pip install -e ".[test]") ({e})'
                )
            else:
                _register(emu, found)
            _registered = found
        return _registered or {}


def missing(target: str, plat: str) -> str | None:
    """None if `target` is registered for `plat`, else why not."""
    found = targets()
    if _load_error is not None:
        return _load_error
    if target not in found.get(plat, ()):
        if target.startswith(EMULATOR_PREFIX) and _emulator_error is not None:
            return _emulator_error
        return f"the extension was built without the {plat} target {target}"
    return None


def has_cuda_kernels() -> bool:
    targets()
    try:
        from jax_flash import _jax_flash_ext as ext
    except ImportError:
        return False
    return bool(ext.has_cuda())


def poison_outputs(spec: AttentionSpec) -> bool:
    """Config.poison_outputs (JAX_FLASH_POISON_OUTPUTS, set by the test suite): the handlers fill
    their results with NaN before computing, so an element a kernel leaves unwritten shows up.
    Fixed when the call is traced; the poison_outputs attribute of every target."""
    return bool(spec.settings.get("poison_outputs"))


def _attributes(spec: AttentionSpec) -> dict:
    # Floats as np.float32: a Python float becomes an f64 attribute, which Attr<float> rejects.
    return dict(
        scale=np.float32(spec.scale),
        window_left=np.int64(-1 if spec.window_left is None else spec.window_left),
        window_right=np.int64(-1 if spec.window_right is None else spec.window_right),
        softcap=np.float32(0.0 if spec.soft_cap is None else spec.soft_cap),
        use_segment_ids=bool(spec.has_segment_ids),
        dropout_rate=np.float32(spec.dropout_rate),
        poison_outputs=poison_outputs(spec),
        **_block_attributes(spec),
    )


def _vmap_method(spec: AttentionSpec) -> str | None:
    """A flex call (not wrapped by `partitioning`, whose vmap rule folds the mapped axis into
    the batch: that would renumber the `b` its mask_mod sees) runs once per mapped element
    under vmap; the others never meet vmap here."""
    return "sequential" if spec.flex is not None else None


def _has_block_operands(spec: AttentionSpec) -> bool:
    """A flex_attention call with a mask_mod: the cpu kernels get its block mask's operands."""
    return spec.flex is not None and spec.flex.mask_mod is not None


def _block_attributes(spec: AttentionSpec) -> dict:
    """block_q, block_k: the blocks of the block mask operands, 0 without them."""
    bq, bk = _flex.kernel_blocks(spec)[0] if _has_block_operands(spec) else (0, 0)
    return dict(block_q=np.int64(bq), block_k=np.int64(bk))


def _mask_operands(spec: AttentionSpec, masks: MaskInputs, dtype):
    """Lengths, segment ids, query offsets, the dense bias and mask, the block mask's operands
    are always passed: full lengths, zero ids, zero offsets, and [0] float32 / [0] bool / [0]
    int8, int32, uint32 when absent. The bias keeps
    its [B|1, N|1, T|1, S|1] broadcast shape (the kernels read it through strides) and a
    16-bit or float32 dtype; a float64 bias becomes float32 unless the inputs are float64."""
    b, t, s = spec.batch, spec.q_len, spec.kv_len
    q_len = masks.q_lengths if masks.q_lengths is not None else jnp.full((b,), t, jnp.int32)
    kv_len = masks.kv_lengths if masks.kv_lengths is not None else jnp.full((b,), s, jnp.int32)
    q_seg = masks.q_segment_ids if masks.q_segment_ids is not None else jnp.zeros((b, t), jnp.int32)
    kv_seg = masks.kv_segment_ids if masks.kv_segment_ids is not None else jnp.zeros((b, s), jnp.int32)
    q_off = masks.q_offset if masks.q_offset is not None else jnp.zeros((b,), jnp.int32)
    return (
        q_len,
        kv_len,
        q_seg,
        kv_seg,
        q_off,
        _bias_operand(masks, dtype),
        _dense_mask_operand(masks),
        *_block_operands(spec, masks),
    )


def _block_operands(spec: AttentionSpec, masks: MaskInputs):
    """block_states, block_slots, block_bits (`_flex.block_operands`), or [0] s8, s32, u32."""
    if _has_block_operands(spec):
        return _flex.block_operands(spec, masks)
    return jnp.zeros((0,), jnp.int8), jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.uint32)


def _bias_operand(masks: MaskInputs, dtype):
    if masks.bias is None:
        return jnp.zeros((0,), jnp.float32)
    bias = masks.bias
    if bias.dtype not in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.dtype(dtype)):
        bias = bias.astype(jnp.float32)
    return bias


def _dense_mask_operand(masks: MaskInputs):
    return masks.mask if masks.mask is not None else jnp.zeros((0,), jnp.bool_)


def _dropout_seed(masks: MaskInputs):
    """The dropout key's uint32 [2] words, the last operand of every target (zeros when
    dropout is off: the dropout_rate attribute is then 0)."""
    return masks.dropout_seed if masks.dropout_seed is not None else jnp.zeros((2,), jnp.uint32)


def forward(
    impl: str,
    target: str,
    spec: AttentionSpec,
    q,
    k,
    v,
    masks: MaskInputs,
    attributes: Callable[[AttentionSpec], dict] | None = None,
):
    """Call `target` (a forward target of implementation `impl`): out [B, T, N, Hv], lse
    [B, N, T] float32. `attributes`: (local) spec -> the target's own attributes (forward_call)."""
    return partitioning.forward(
        impl, functools.partial(forward_call, target, attributes=attributes), spec, q, k, v, masks
    )


def backward(
    impl: str,
    target: str,
    spec: AttentionSpec,
    q,
    k,
    v,
    masks: MaskInputs,
    out,
    lse,
    dout,
    dlse,
    deterministic: bool = False,
    backward_grid: Callable[[AttentionSpec], str] | None = None,
    attributes: Callable[[AttentionSpec], dict] | None = None,
    operands: Callable | None = None,
):
    """Call `target` (a backward target): dq, dk, dv (workspaces dropped), and dbias in the
    bias' shape and dtype (None without a bias).

    `backward_grid` (the CUDA targets only): spec -> "kv_heads" or "q_heads", the main
    kernel's grid for the (local) call, which sizes the dk_accum / dv_accum workspace results;
    None for a target without them (the cpu kernels). `attributes`: (local) spec -> the
    target's own attributes (the cpu kernels' isa and gradient_chunks, the CUDA kernels' layout
    and plain kernel). `operands`: (local) spec, out, lse -> the target's own operands after the
    shared ones (the CUDA kernels' route), computed on each device's shards."""
    call = functools.partial(_backward_call, target, bool(deterministic), backward_grid, attributes, operands)
    return partitioning.backward(
        impl,
        call,
        spec,
        q,
        k,
        v,
        masks,
        out,
        lse.astype(jnp.float32),
        dout,
        dlse.astype(jnp.float32),
    )


def forward_call(
    target: str,
    spec: AttentionSpec,
    q,
    k,
    v,
    masks: MaskInputs,
    decoding: Callable[[AttentionSpec], tuple[int, bool]] | None = None,
    page_table=None,
    attributes: Callable[[AttentionSpec], dict] | None = None,
    operands: tuple = (),
):
    """The forward custom call on (local) canonical arrays; `spec` describes them (no
    sharding rule: for a function that runs inside one, e.g. on one device's shards).

    `decoding` (the CUDA targets only): spec -> (C, pack_gqa), the split-KV chunk count (1: no
    split), which sizes the partial_out / partial_lse workspace results, and GQA packing.
    `page_table` ([B, max_pages] int32; the paged targets, whose first operand it is): k and v
    are then pages [num_pages, page_size, K, H], and `spec` the gathered cache's
    (S = max_pages·page_size). `attributes`: spec -> the target's own attributes beside the
    shared ones (cuda/README.md: the cpu kernels' isa, forward_chunks and pack_gqa, the CUDA
    kernels' layout), decided here, when the call is traced. `operands`: the target's own
    operands after the shared ones (the CUDA targets' route)."""
    b, t, n, _ = q.shape
    hv = v.shape[-1]
    shapes: tuple[jax.ShapeDtypeStruct, ...] = (
        jax.ShapeDtypeStruct((b, t, n, hv), q.dtype),  # out [B, T, N, Hv]
        jax.ShapeDtypeStruct((b, n, t), jnp.float32),
    )
    values = _attributes(spec)
    if attributes is not None:
        values.update(attributes(spec))
    if decoding is not None:
        chunks, pack = decoding(spec)
        split = chunks > 1
        shapes += (
            jax.ShapeDtypeStruct((chunks, b, t, n, hv) if split else (0,), jnp.float32),  # partial_out
            jax.ShapeDtypeStruct((chunks, b, n, t) if split else (0,), jnp.float32),
        )  # partial_lse
        values["pack_gqa"] = bool(pack)
    # Sinks [N] f32 after the mask operands (forward only), -inf (no sink) when absent.
    sinks = masks.sinks if masks.sinks is not None else jnp.full((n,), -jnp.inf, jnp.float32)
    first = () if page_table is None else (page_table,)
    out, lse, *_ = jax.ffi.ffi_call(target, shapes, vmap_method=_vmap_method(spec))(
        *first,
        q,
        k,
        v,
        *_mask_operands(spec, masks, q.dtype),
        sinks.astype(jnp.float32),
        _dropout_seed(masks),
        *operands,
        **values,
    )
    return out, lse


def _backward_call(
    target: str,
    deterministic: bool,
    backward_grid,
    attributes,
    operands,
    spec: AttentionSpec,
    q,
    k,
    v,
    masks: MaskInputs,
    out,
    lse,
    dout,
    dlse,
):
    """The backward custom call on (local) canonical arrays: dq, dk, dv, dbias (None
    without a bias). dbias is the last result (after the CUDA targets' workspaces), float32
    in the bias' shape, summed over its broadcast dims by the kernels."""
    b, t, n, h = q.shape
    shapes: tuple[jax.ShapeDtypeStruct, ...] = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        # dq_accum workspace: the CUDA targets' atomics; the cpu kernels need none ([0]).
        jax.ShapeDtypeStruct((b, t, n, h) if backward_grid is not None else (0,), jnp.float32),
        jax.ShapeDtypeStruct((b, n, t), jnp.float32),  # delta workspace
    )
    if backward_grid is not None:
        # dk_accum, dv_accum: per-query-head dK, dV for the q_heads grid, empty for kv_heads.
        grid = backward_grid(spec)
        dk_accum = (b, k.shape[1], n, h) if grid == "q_heads" else (0,)
        dv_accum = (b, v.shape[1], n, v.shape[-1]) if grid == "q_heads" else (0,)  # [B, S, N, Hv]
        shapes += (jax.ShapeDtypeStruct(dk_accum, jnp.float32), jax.ShapeDtypeStruct(dv_accum, jnp.float32))
        # dbias_accum: deterministic mode's dbias workspace [B, N, Tb, S] for a bias broadcast
        # over B, N or S (summed into dbias in a fixed order after), else empty.
        shapes += (jax.ShapeDtypeStruct(_dbias_workspace(spec, masks, deterministic), jnp.float32),)
    dbias_shape = (0,) if masks.bias is None else masks.bias.shape
    shapes += (jax.ShapeDtypeStruct(dbias_shape, jnp.float32),)
    dq, dk, dv, *_, dbias = jax.ffi.ffi_call(target, shapes, vmap_method=_vmap_method(spec))(
        q,
        k,
        v,
        out,
        dout,
        lse,
        dlse,
        *_mask_operands(spec, masks, q.dtype),
        _dropout_seed(masks),
        *(() if operands is None else operands(spec, out, lse)),
        **_attributes(spec),
        **({} if attributes is None else attributes(spec)),
        deterministic=deterministic,
    )
    return dq, dk, dv, (None if masks.bias is None else dbias.astype(masks.bias.dtype))


def _dbias_workspace(spec: AttentionSpec, masks: MaskInputs, deterministic: bool) -> tuple:
    """The CUDA targets' dbias_accum shape (cuda/kernels/bias.h): [B, N, Tb, S] in
    deterministic mode when the bias is broadcast over B, N or S, else (0,)."""
    if masks.bias is None or not deterministic:
        return (0,)
    bb, nb, tb, sb = masks.bias.shape
    b, n, s = spec.batch, spec.num_heads, spec.kv_len
    if (bb, nb, sb) == (b, n, s):
        return (0,)
    return (b, n, tb, s)


def compiled_kernel_reason(spec: AttentionSpec, dtypes: tuple[str, ...]) -> str | None:
    """Limits common to the compiled implementations."""
    if spec.dtype not in dtypes:
        return f"supports dtypes {', '.join(dtypes)}, got {spec.dtype}"
    return None
