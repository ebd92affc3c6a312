"""The `cuda` implementation: the extension's mma.sync kernels (platform CUDA).

The call's settings (`spec.settings`, a `jax_flash.Config` fixed when the call is traced;
docs/configuration.md) choose how it runs:

- emulate_cuda (JAX_FLASH_EMULATE_CUDA=1): on a CPU backend, the same kernel source compiled
  for the host against an emulation of the SIMT model and of each PTX instruction runs instead
  (targets `jax_flash_emu_*`): slow, for testing the kernels without a GPU.
- deterministic (JAX_FLASH_DETERMINISTIC=1): the backward accumulates dQ without racing atomics.
- cuda_layout (JAX_FLASH_CUDA_LAYOUT=warp16|warp32): the kernels' warp layout (cuda/README.md),
  passed to the handlers as the `layout` attribute; `explain` says which one a call runs.
- cuda_backward_grid (JAX_FLASH_CUDA_BWD_GRID=auto|kv_heads|q_heads): the main backward
  kernel's grid (`backward_grid`, cuda/README.md): one CTA per (key block, kv head, batch),
  looping over the query heads of the group, or per (key block, query head, batch) with dK, dV
  per query head in float32 workspaces summed over the group after (MQA/GQA at small batch).
- cuda_split_kv (JAX_FLASH_CUDA_SPLIT_KV=C): forces the forward's split-KV chunk count.

flex_attention: a mask_mod and a block mask, no score_mod (the kernels cannot run a user
function): the block mask decides which tiles each kernel runs, forward and backward, and the
partly visible blocks' mask_mod bits, evaluated by XLA before the call, mask inside them
(kernels/block_mask.h; `_flex.block_operands`). Under the emulation `count_tiles` counts the
tiles the kernels compute.

The rules that decide from them and from the call's shapes (split-KV, GQA packing, the grid)
are `jax_flash._heuristics`; an invalid variable is a ValueError naming it when a call is traced.

Architectures: the extension holds the images its build chose (cuda/CMakeLists.txt: with
JAX_FLASH_CUDA=ON, as in the wheels, cubins for sm_80, sm_90, sm_100, sm_120 and compute_80 PTX; AUTO:
the visible GPUs'; or JAX_FLASH_CUDA_ARCHS). A GPU runs the cubin of its own major version and
an equal or lower minor, else the newest PTX image it can JIT-compile (sm_110 and later run
the compute_80 PTX, compiled by the driver at first use); with neither, `unsupported` says so
before any launch, and `explain` names the image a GPU would run. Before that, the driver must
be new enough for the kernels' static CUDA runtime (`_build.driver_reason`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax import lax

from jax_flash import _build, _ffi, _flex, _heuristics, _registry
from jax_flash._numerics import finite_part, nonfinite_rows, scores_are_finite
from jax_flash._paged_spec import PagedSpec, target_masks
from jax_flash._spec import AttentionSpec
from jax_flash.parallel import partitioning

DTYPES = ("float16", "bfloat16")
# Head dims with compiled instantiations (cuda/kernels, build/generate_kernels.py): every H of
# HEAD_DIMS with the value head dim Hv = H, and the NARROW_VALUE_PAIRS (H, Hv) with Hv < H
# (MLA: DeepSeek's 192-wide queries and keys with 128-wide values).
HEAD_DIMS = (32, 64, 96, 128, 192, 256)
NARROW_VALUE_PAIRS = ((192, 128), (128, 64))
MIN_COMPUTE_CAPABILITY = (8, 0)
# A routed forward call's route (kernels/params.h, Route): which of its kernels runs.
ROUTE_SCAN_VALUES, ROUTE_PLAIN, ROUTE_GENERAL = 0, 1, 2


def head_dim_pairs() -> tuple:
    """The (H, Hv) pairs of query/key and value head dims the kernels serve."""
    return tuple((h, h) for h in HEAD_DIMS) + NARROW_VALUE_PAIRS


def value_head_dim_reason(spec: AttentionSpec) -> str | None:
    """None if the kernels serve the call's (H, Hv) pair, else why not."""
    pair = (spec.head_dim, spec.v_head_dim)
    if pair in head_dim_pairs():
        return None
    return (
        f"has kernels for (H, Hv) pairs with the value head dim Hv = H and for "
        f"{', '.join(f'({h}, {hv})' for h, hv in NARROW_VALUE_PAIRS)} "
        f"({', '.join(f'({h}, {hv})' for h, hv in head_dim_pairs())}), got H = {pair[0]}, "
        f"Hv = {pair[1]}"
    )


def emulated(spec: AttentionSpec) -> bool:
    """The call runs the host emulation of the kernels (Config.emulate_cuda)."""
    return spec.settings.get("emulate_cuda")


def deterministic(spec: AttentionSpec) -> bool:
    """The backward runs without racing atomics (Config.deterministic)."""
    return spec.settings.get("deterministic")


def layout(spec: AttentionSpec) -> str:
    """The call's warp layout, "warp16" or "warp32" (Config.cuda_layout); a ValueError naming
    JAX_FLASH_CUDA_LAYOUT when the variable held no layout."""
    return _heuristics.cuda_layout(spec)


def target_attributes(spec: AttentionSpec) -> dict:
    """The CUDA (and emulated) targets' own attribute beside the shared ones: the warp layout,
    decided when the call is traced (cuda/README.md)."""
    return dict(layout=layout(spec))


def backward_grid(spec: AttentionSpec) -> str:
    """The main backward kernel's grid for a call of shape `spec`: "kv_heads" or "q_heads"
    (`_heuristics.cuda_backward_grid`)."""
    return _heuristics.cuda_backward_grid(spec)


def packs_heads(spec: AttentionSpec) -> bool:
    """GQA packing (kernels/fwd.h): at T = 1 the G query heads of a kv head share one tile."""
    return _heuristics.cuda_packs_heads(spec)


def sm_count() -> tuple[int, str]:
    """(SMs, where the figure comes from) of the device the kernels run on."""
    count = _registry.sm_count()
    if _registry.device_sm_count() is None:
        return count, f"{count} SMs (an H100/H200; the device does not say)"
    return count, f"the GPU's {count} SMs"


def forward_ctas(spec: AttentionSpec) -> int:
    return _heuristics.cuda_forward_ctas(spec)


def split_kv_chunks(spec: AttentionSpec) -> int:
    """The forward's split-KV chunk count C for a call of shape `spec` on this device (1: no
    split; `_heuristics.cuda_split_kv_chunks`)."""
    return _heuristics.cuda_split_kv_chunks(spec, sm_count()[0])


def decoding(spec: AttentionSpec) -> tuple[int, bool]:
    """(split-KV chunks, GQA packing) of the forward for the (local) call `spec`."""
    return split_kv_chunks(spec), packs_heads(spec)


def scans_values(spec: AttentionSpec, masks) -> bool:
    """Whether the forward kernel zeroes V's non-finite elements and poisons the rows that see
    them itself on every call (AttentionParams::scans_values): in its decoding settings, without
    a dense bias. (A routed call asks for the scan only where v holds a non-finite value.)"""
    chunks, pack = decoding(spec)
    return (chunks > 1 or pack) and masks.bias is None


def plain_forward_blocker(spec: AttentionSpec, paged: bool = False) -> str | None:
    """Why a forward call may not run the plain kernel (`_heuristics.cuda_plain_forward_blocker`),
    or None when it may: then it runs where its scores are finite (`scores_are_finite`, tested
    on every call), the general kernel elsewhere."""
    return _heuristics.cuda_plain_forward_blocker(spec, sm_count()[0], paged)


def plain_backward_blocker(spec: AttentionSpec) -> str | None:
    """Why a backward call may not run the plain kernel (`_heuristics.cuda_plain_backward_blocker`),
    or None when it may: then it runs where the forward's results are finite (`backward_route`)."""
    return _heuristics.cuda_plain_backward_blocker(spec)


def backward_attributes(spec: AttentionSpec) -> dict:
    """The backward targets' own attributes: the layout and whether the plain kernel is launched."""
    return dict(target_attributes(spec), plain_kernel=plain_backward_blocker(spec) is None)


def backward_route(spec: AttentionSpec, out, lse) -> tuple:
    """The backward's route operand (kernels/params.h, AttentionParams::route), on each device's
    shards: [1] s32, the plain kernel where the forward's out is finite and its lse below +inf
    (no row was poisoned and no sink is NaN or +inf, so every P and dS the plain kernel forms is
    finite and a masked pair's is exactly 0), else the general kernel; [0] s32 (not routed) for a
    call the plain kernel does not serve. One reduction over out and one over lse; the cotangents
    are assumed finite (docs/numerical-contract.md)."""
    if plain_backward_blocker(spec) is not None:
        return (jnp.zeros((0,), jnp.int32),)
    finite = jnp.all(lse < jnp.inf) & jnp.all(jnp.isfinite(out))
    return (jnp.reshape(jnp.where(finite, ROUTE_PLAIN, ROUTE_GENERAL), (1,)).astype(jnp.int32),)


def forward_kernel_description(spec: AttentionSpec) -> str:
    """What `explain` says of the forward kernel a call runs (kernels/fwd.h)."""
    return _heuristics.cuda_forward_kernel_description(spec, sm_count()[0])


def decoding_description(spec: AttentionSpec) -> str:
    """What `explain` says of the forward's split-KV and GQA packing."""
    sms, words = sm_count()
    return _heuristics.cuda_decoding_description(spec, sms, words)


def _prefix(spec: AttentionSpec) -> str:
    return "jax_flash_emu" if emulated(spec) else "jax_flash"


def _architectures() -> tuple[str, ...]:
    """The CUDA architectures of the build's images, as CMake spells them ("80-real", ...)."""
    try:
        from jax_flash import _jax_flash_ext as ext
    except ImportError:
        return ()
    text = getattr(ext, "cuda_architectures", lambda: "")()
    return tuple(a for a in text.split(",") if a)


def _parse_arch(entry: str) -> tuple[int, int, str, bool, bool] | None:
    """(major, minor, suffix, cubin, ptx) of a CMake CUDA architecture such as "80-real",
    "90a-virtual" or "120"; None for the symbolic ones ("native", "all", "all-major")."""
    import re

    m = re.fullmatch(r"(\d+)(\d)([af]?)(?:-(real|virtual))?", entry.strip())
    if m is None:
        return None
    kind = m.group(4)
    return int(m.group(1)), int(m.group(2)), m.group(3), kind != "virtual", kind != "real"


def _runs_on(cc, major: int, minor: int, suffix: str, *, ptx: bool) -> bool:
    if suffix == "a":  # architecture-specific: that capability only
        return cc == (major, minor)
    if suffix == "f" or not ptx:  # family-specific, or a cubin: the same major version
        return cc[0] == major and cc[1] >= minor
    return cc >= (major, minor)  # PTX: JIT-compiled for any later capability


def kernel_image(cc: tuple[int, int], architectures) -> str | None:
    """The image of the build that a GPU of compute capability `cc` runs: "sm_XY" (a cubin),
    "compute_XY PTX" (JIT-compiled by the driver), "unknown" when the build's architectures
    are symbolic ("native", "all"), or None when no image can run there.

    A cubin sm_XY runs on X.Z for Z >= Y (sm_XYa only on X.Y, sm_XYf on X.Z, Z >= Y); PTX
    compute_XY is JIT-compiled on any capability >= X.Y (compute_XYa/f like their cubins)."""
    cubins, ptx, symbolic = [], [], False
    for entry in architectures:
        parsed = _parse_arch(entry)
        if parsed is None:
            symbolic = True
            continue
        major, minor, suffix, cubin, virtual = parsed
        if cubin and _runs_on(cc, major, minor, suffix, ptx=False):
            cubins.append((major, minor, suffix))
        if virtual and _runs_on(cc, major, minor, suffix, ptx=True):
            ptx.append((major, minor, suffix))
    if cubins:
        major, minor, suffix = max(cubins)
        return f"sm_{major}{minor}{suffix}"
    if ptx:
        major, minor, suffix = max(ptx)
        return f"compute_{major}{minor}{suffix} PTX"
    return "unknown" if symbolic else None


def _compute_capability() -> tuple[int, int] | None:
    cc = getattr(jax.devices()[0], "compute_capability", None)
    if cc is None:
        return None
    major, minor = str(cc).split(".")[:2]
    return int(major), int(minor)


# The kernels' launch geometry (cuda/kernels/grid.h, fwd.h, bwd.h), checked at trace time so
# that a call the launches cannot take is refused before it runs: one CTA per (block, head,
# batch), the batch folded into grid.x with the blocks (at most 2**31 - 1 CTAs), the heads
# over grid.y·grid.z (65535 each, so any int32 count). Every kernel's block holds at least
# 64 query rows or keys (forward 128, backward and dQ 64), except the backward's 32 keys at
# H = 192: B·ceil(L / 64) (B·ceil(S / 32) there) bounds grid.x for L = T and S. The backward's delta kernel is a 1-D grid of ceil(B·T·N / rows) CTAs with
# rows = 128 threads / (lanes per row, the head dim's 16-byte chunks rounded up to a power of
# two; rows of out, dout: Hv). The handlers hold B, N, K as int and T, S below 2**30.
MIN_GRID_BLOCK = 64


def _min_grid_block(head_dim: int, what: str) -> int:
    return 32 if head_dim == 192 and what == "key" else MIN_GRID_BLOCK


MAX_GRID_X = 2**31 - 1
MAX_INT = 2**31 - 1


def _delta_rows_per_block(head_dim: int) -> int:
    lanes = 1
    while lanes < head_dim // 8:
        lanes *= 2
    return 128 // lanes


def launch_limit(spec: AttentionSpec) -> str | None:
    """Why the kernels cannot be launched for `spec` (a CUDA grid or int limit), or None."""
    b, t, s, n, h = spec.batch, spec.q_len, spec.kv_len, spec.num_heads, spec.head_dim
    if max(b, n) > MAX_INT:
        return f"holds B and N as int32: batch B={b} and heads N={n} must be at most 2**31 - 1"
    for length, what in ((t, "query"), (s, "key")):
        block = _min_grid_block(h, what)
        ctas = b * -(-length // block)
        if ctas > MAX_GRID_X:
            return (
                f"would launch B·ceil({'T' if what == 'query' else 'S'}/{block}) = "
                f"{ctas} CTAs ({what} blocks x batch B={b}) in grid.x, above CUDA's limit of 2**31 - 1"
            )
    rows = _delta_rows_per_block(spec.v_head_dim)  # the delta kernel reads rows of out, dout
    ctas = -(-(b * t * n) // rows)
    if ctas > MAX_GRID_X:
        return (
            f"would launch ceil(B·T·N/{rows}) = {ctas} CTAs in the backward's 1-D delta grid, "
            "above CUDA's grid.x limit of 2**31 - 1"
        )
    return None


def dense_description(spec: AttentionSpec) -> str | None:
    """What `explain` says of a dense bias or mask (cuda/README.md, kernels/bias.h)."""
    parts = [
        f"dense {name} {list(shape)} read in place through its broadcast strides"
        for name, shape in (("bias", spec.bias_shape), ("mask", spec.mask_shape))
        if shape is not None
    ]
    if spec.bias_shape is None:
        return "; ".join(parts) or None
    full = (spec.batch, spec.num_heads, spec.q_len, spec.kv_len)
    summed = [d for d, n, f in zip("BNTS", spec.bias_shape, full) if n == 1 and f > 1]
    spread = [d for d in summed if d != "T"]
    if not summed:
        parts.append("dbias stored element by element")
    elif not spread:
        parts.append("dbias summed over T by the thread that owns each key")
    elif deterministic(spec):
        parts.append(
            f"dbias summed over {', '.join(summed)}: over B, N, S through a float32 workspace "
            f"[B, N, Tb, S] = {[spec.batch, spec.num_heads, spec.bias_shape[2], spec.kv_len]} "
            "summed in a fixed order (JAX_FLASH_DETERMINISTIC=1)"
        )
    else:
        parts.append(f"dbias summed over {', '.join(summed)} with atomics (over T and S first inside each warp)")
    return "; ".join(parts)


@dataclasses.dataclass
class TileCounts:
    """The tiles (Q·Kᵀ products of a CTA's tile) the emulated kernels computed inside
    `count_tiles`: `forward`, `backward` (the main kernel's), `backward_dq` (deterministic
    mode's dQ kernel); of the forward's, `forward_plain` those the plain kernel computed
    (kernels/fwd.h) and `forward_plain_masked` those of them it masked (the tiles before and
    after the interior ones); of the backward's, `backward_plain` and `backward_plain_masked`
    likewise (kernels/bwd.h: query blocks of a key block)."""

    forward: int = 0
    backward: int = 0
    backward_dq: int = 0
    forward_plain: int = 0
    forward_plain_masked: int = 0
    backward_plain: int = 0
    backward_plain_masked: int = 0


@contextlib.contextmanager
def count_tiles() -> Iterator[TileCounts]:
    """A debug counter of the tiles the kernels compute on their host emulation
    (JAX_FLASH_EMULATE_CUDA=1) while inside this block (read when the block ends, so block on
    the results inside it): tests that the work follows a block mask, and which forward kernel
    ran. A GPU keeps no count.
    Not for concurrent use."""
    from jax_flash import _jax_flash_emu

    counts = TileCounts()
    _jax_flash_emu.count_tiles(True)
    try:
        yield counts
    finally:
        (
            counts.forward,
            counts.backward,
            counts.backward_dq,
            counts.forward_plain,
            counts.forward_plain_masked,
            counts.backward_plain,
            counts.backward_plain_masked,
        ) = _jax_flash_emu.tile_counts()
        _jax_flash_emu.count_tiles(False)


def flex_description(spec: AttentionSpec, verbose: bool) -> str:
    """`explain`'s words for a flex_attention call with a mask_mod (`_flex.kernel_description`)."""
    fwd = f"{_heuristics.CUDA_FORWARD_BLOCK_Q}x{_heuristics.cuda_forward_block_kv(spec)}"
    tiles = f"forward tiles ({fwd}) and backward tiles (of {_heuristics.cuda_backward_block_kv(spec)} keys)"
    text = _flex.kernel_description(
        spec, tiles, "a fragment (16 queries or keys of a tile) within one full block unmasked", verbose
    )
    if verbose:
        text += "; run when asked for by name (implementation=None does not pick cuda for a flex call yet)"
    return text


def _flex_masked(spec: AttentionSpec) -> bool:
    return spec.flex is not None and spec.flex.mask_mod is not None


class CudaImplementation:
    name = "cuda"

    # flex_attention: mask_mod and block masks; a score_mod is refused (_flex.score_mod_reason).
    serves_flex = True
    # ... when asked for by name: implementation=None picks pallas (measured on a GPU) for a flex
    # call until these kernels' block masks have run on one (tested on the host emulation).
    flex_default = False

    def unsupported(self, spec: AttentionSpec) -> str | None:
        if spec.flex is not None and spec.flex.score_mod is not None:
            return _flex.score_mod_reason(self.name)
        plat = _registry.platform()
        try:
            emulate = emulated(spec)
        except ValueError as e:
            return str(e)
        if emulate:
            if plat != "cpu":
                return "JAX_FLASH_EMULATE_CUDA=1 emulates the kernels on the CPU backend only"
            why = _ffi.missing("jax_flash_emu_fwd", "cpu") or _ffi.missing("jax_flash_emu_bwd", "cpu")
            if why:
                return why
        else:
            if plat != "gpu":
                return f"needs an NVIDIA GPU (the default backend is {plat})"
            if not _ffi.has_cuda_kernels():
                why = _ffi.missing("jax_flash_fwd", "cpu")
                return why or (
                    f"the extension was built without CUDA kernels ({_build.build_info().cuda_selection}): "
                    'install a CUDA wheel (pip install "jax_flash[cuda13]") or rebuild with the GPU visible or '
                    "JAX_FLASH_CUDA=ON (docs/installation.md)"
                )
            cc = _compute_capability()
            if cc is None:
                return "the GPU is not an NVIDIA CUDA device"
            if cc < MIN_COMPUTE_CAPABILITY:
                return f"needs compute capability 8.0 or newer, the GPU has {cc[0]}.{cc[1]}"
            archs = _architectures()
            image = kernel_image(cc, archs) if archs else "unknown"
            if image is None:
                return (
                    f"the extension has no kernel image for compute capability {cc[0]}.{cc[1]} "
                    f"(built for {';'.join(archs)}): rebuild with JAX_FLASH_CUDA_ARCHS including "
                    f'"{cc[0]}{cc[1]}-real" or a PTX image such as "80-virtual", or with JAX_FLASH_CUDA=ON '
                    "(docs/installation.md)"
                )
            # The driver, before any launch: the static runtime of the kernels needs one of its
            # major version, and a PTX image one as new as the toolkit that wrote it.
            why = _build.driver_reason(_build.cuda_driver_version(), _build.cuda_runtime_version(), image)
            if why:
                return why
        if spec.head_dim not in HEAD_DIMS:
            return f"has kernels for head dims {HEAD_DIMS}, got {spec.head_dim}"
        why = value_head_dim_reason(spec)
        if why:
            return why
        return _ffi.compiled_kernel_reason(spec, DTYPES) or launch_limit(spec)

    def head_dims(self) -> str:
        return ", ".join(f"({h}, {hv})" for h, hv in head_dim_pairs())

    def summary(self, spec: AttentionSpec) -> str:
        """`explain`'s one line: the host emulation, the layout, the forward's split-KV and GQA
        packing, the backward grid, and a dense bias or mask."""
        try:
            text = _heuristics.cuda_summary(spec, sm_count()[0])
        except ValueError as e:  # a bad JAX_FLASH_CUDA_* setting
            return f"{e}: calls fail"
        if spec.bias_shape is not None or spec.mask_shape is not None:
            text += ", dense bias/mask read in place"
        if _flex_masked(spec):
            text += ", " + flex_description(spec, verbose=False)
        if emulated(spec):
            return f"host emulation (JAX_FLASH_EMULATE_CUDA=1), {text}"
        cc = _compute_capability()
        image = kernel_image(cc, _architectures()) if cc is not None else None
        if image is not None and image.endswith("PTX"):
            return f"{image} JIT-compiled by the driver (no cubin for this GPU), {text}"
        return text

    def note(self, spec: AttentionSpec) -> str | None:
        """What `explain` adds when the kernels can run: the host emulation, or which image
        of the build this GPU runs (a cubin, or PTX that the driver JIT-compiles)."""
        try:
            how = _heuristics.cuda_layout_description(spec)
        except ValueError as e:
            how = f"{e}: calls fail"
        try:
            how += "; " + forward_kernel_description(spec)
        except ValueError as e:
            how += f"; {e}: calls fail"
        how += "; " + _heuristics.cuda_backward_kernel_description(spec)
        try:
            how += "; " + _heuristics.cuda_backward_grid_description(spec)
        except ValueError as e:
            how += f"; {e}: backward calls fail"
        try:
            how += "; " + decoding_description(spec)
        except ValueError as e:
            how += f"; {e}: calls fail"
        try:
            dense = dense_description(spec)
        except ValueError as e:
            dense = f"{e}: backward calls fail"
        if dense:
            how += "; " + dense
        if _flex_masked(spec):
            how += "; " + flex_description(spec, verbose=True)
        if emulated(spec):
            return f"on the host emulation of the kernels: JAX_FLASH_EMULATE_CUDA=1; {how}"
        cc = _compute_capability()
        if cc is None:
            return how
        image = kernel_image(cc, _architectures())
        if image is None or image == "unknown":
            return how
        if image.endswith("PTX"):
            return (
                f"compute capability {cc[0]}.{cc[1]} has no cubin in this build: it runs the {image} image, "
                f"JIT-compiled by the driver at first use; {how}"
            )
        return f"runs the {image} cubin; {how}"

    # Non-finite inputs (docs/numerical-contract.md). The kernels' products P·V, dS·K and
    # dSᵀ·Q also multiply masked (zero) weights, and 0·NaN would carry a masked-out poisoned
    # value, key or query into rows that do not see it: they get finite copies. The scores
    # of the forward keep the raw q and k (a ±inf score becomes NaN in the kernel); the
    # backward needs no poisoned operand, as a poisoned row's lse and D are NaN.
    def forward(self, spec, q, k, v, masks):
        layout(spec)  # an unknown JAX_FLASH_CUDA_LAYOUT: a ValueError now
        split_kv_chunks(spec)  # likewise JAX_FLASH_CUDA_SPLIT_KV
        target = f"{_prefix(spec)}_fwd"
        # The whole of _forward_local runs inside the sharding rule: its test for a non-finite
        # value is over this device's shard (a test over the global array would be an
        # all-reduce on every call).
        return partitioning.forward(self.name, functools.partial(self._forward_local, target), spec, q, k, v, masks)

    def _forward_local(self, target, spec, q, k, v, masks, page_table=None):
        def call(spec, q, k, v, masks, plain_kernel=False, route=None):
            attributes = lambda s: dict(
                target_attributes(s), plain_kernel=plain_kernel, decode_tile=_heuristics.cuda_decode_tile(s)
            )
            route = jnp.zeros((0,), jnp.int32) if route is None else jnp.reshape(route, (1,)).astype(jnp.int32)
            return _ffi.forward_call(
                target,
                spec,
                q,
                k,
                v,
                masks,
                decoding=decoding,
                page_table=page_table,
                attributes=attributes,
                operands=(route,),
            )

        if scans_values(spec, masks):
            # The kernel's decoding settings handle a non-finite V themselves
            # (kernels/nonfinite.h): a decode step reads K and V once.
            return call(spec, q, k, v, masks)
        bad_v = nonfinite_rows(v)  # [B, S, K], or [num_pages, page_size, K]
        if masks.bias is not None:
            # A -inf bias is not a mask (docs/numerical-contract.md): a non-finite value behind it
            # still reaches the row, which the kernel's scan of V cannot tell from a masked key.
            # The host finds such rows, on a finite copy of V, in the one call that has one.
            return lax.cond(
                jnp.any(bad_v),
                lambda: self._poisoned(call, spec, q, k, v, masks, bad_v),
                lambda: call(spec, q, k, v, masks),
            )
        # Every other call is routed (kernels/params.h, AttentionParams::route): the kernels
        # read which of them runs from a device scalar computed here, so choosing by what the
        # inputs hold needs no conditional (XLA's copies its predicate to the host and waits for
        # the device). A v with a non-finite value: the general kernel zeroes it in its V tiles
        # and poisons the rows that see it (one pass over V more, here, for the test); else the
        # plain kernel where it serves the call and every score is finite (one reduction over
        # q and one over k), the general kernel elsewhere.
        plain = plain_forward_blocker(spec, paged=page_table is not None) is None
        finite_scores = scores_are_finite(q, k) if plain else jnp.bool_(False)
        route = jnp.where(jnp.any(bad_v), ROUTE_SCAN_VALUES, jnp.where(finite_scores, ROUTE_PLAIN, ROUTE_GENERAL))
        return call(spec, q, k, v, masks, plain_kernel=plain, route=route)

    def _poisoned(self, call, spec, q, k, v, masks, bad_v):
        """The forward of a call with a dense bias whose v holds a non-finite value: the kernels
        on a finite copy of V, then NaN in the rows that see a flagged key."""
        out, lse = call(spec, q, k, finite_part(v), masks)
        sees = self._sees(call, spec, bad_v, masks, q.dtype)
        # An empty row (lse = -inf: it sees no key, or only -inf logits, with no sink) stays 0.
        sees = sees & (jnp.swapaxes(lse, 1, 2) != -jnp.inf)
        return jnp.where(sees[..., None], jnp.asarray(jnp.nan, out.dtype), out), lse

    def _sees(self, call, spec, flags, masks, dtype):
        """Bool [B, T, N]: the row sees a key whose flag is set. The kernels on q = k = 0
        (every visible logit 0, so P = 1/#visible > 0) and v = the flags, at head dim 32."""
        small = dataclasses.replace(spec, head_dim=min(HEAD_DIMS), value_head_dim=None)
        b, t, n, h = spec.batch, spec.q_len, spec.num_heads, small.head_dim
        v = jnp.broadcast_to(flags[..., None], (*flags.shape, h)).astype(dtype)
        zeros_q, zeros_k = jnp.zeros((b, t, n, h), dtype), jnp.zeros(v.shape, dtype)
        # Without the bias: a -inf bias is not a mask, a non-finite v behind it still reaches
        # the row (docs/numerical-contract.md); the dense mask stays.
        share, _ = call(small, zeros_q, zeros_k, v, masks._replace(bias=None))
        return share[..., 0] > 0

    # paged_attention (jax_flash/inference/paged.py): what implementation=None runs on an NVIDIA
    # GPU where it serves the call (never its host emulation: the CPU backend prefers cpu).
    paged_default = True

    def paged_unsupported(self, pspec: PagedSpec) -> str | None:
        return self.unsupported(pspec.attention)

    def paged_summary(self, pspec: PagedSpec) -> str:
        try:
            how = _heuristics.cuda_decoding_summary(pspec.attention, sm_count()[0])
        except ValueError as e:
            how = f"{e}: calls fail"
        return f"K/V tiles read through the table, {how}"

    def paged_note(self, pspec: PagedSpec) -> str:
        try:
            how = decoding_description(pspec.attention)
        except ValueError as e:
            how = f"{e}: calls fail"
        return (
            "the forward kernel with its K/V tiles read through the table (cp.async from each page's "
            f"slot, any page size); {how}"
        )

    def paged_forward(self, pspec, q, key_pages, value_pages, table, lengths, sinks=None):
        """paged_attention on the paged target: the forward kernel reading K and V through the
        page table (cp.async from each page's slot), with the decode settings of `attention`
        (split-KV, GQA packing). out [B, T, N, H], lse [B, N, T]. Keys of an out-of-range page
        id are masked through kv segment ids (1 on such a page, 0 elsewhere, the queries' 0);
        the kernel reads page 0 in their place."""
        spec, masks = target_masks(pspec, q, table, lengths, sinks)
        layout(spec)
        split_kv_chunks(spec)
        return self._forward_local(
            f"{_prefix(spec)}_paged_fwd", spec, q, key_pages, value_pages, masks, page_table=table
        )

    def backward(self, spec, q, k, v, masks, out, lse, dout, dlse):
        layout(spec)
        backward_grid(spec)  # an unknown JAX_FLASH_CUDA_BWD_GRID: a ValueError now
        # The grid is chosen from the shapes each call's kernels see (a device's shards, the
        # batch with a vmapped axis folded in).
        return _ffi.backward(
            self.name,
            f"{_prefix(spec)}_bwd",
            spec,
            finite_part(q),
            finite_part(k),
            finite_part(v),
            masks,
            out,
            lse,
            dout,
            dlse,
            deterministic=deterministic(spec),
            backward_grid=backward_grid,
            attributes=backward_attributes,
            operands=backward_route,
        )


IMPLEMENTATION = CudaImplementation()
