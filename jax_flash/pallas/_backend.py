"""Which compiler a `pallas` forward call goes through: Triton, or Mosaic GPU for the plain calls
its kernel serves (`Config.pallas_backend`; decided when the call is traced).

The Mosaic GPU forward (`_mosaic`) is FlashAttention-3's schedule for sm_90: one plain kernel,
causal or not, sliding windows (both placed by a query offset), sequence lengths, segment ids,
a soft cap, attention sinks, no other optional feature. A call runs it where `mosaic_unsupported` finds nothing against it and

- `pallas_backend="mosaic_gpu"`: always (a call it cannot serve is an error naming why);
- `pallas_backend="auto"` (the default): where a device run measured it faster than the Triton
  forward for the call's class on this GPU's architecture (`jax_flash/measured_choices.json`,
  `_heuristics.measured_pallas_backend`); Triton elsewhere;
- `pallas_backend="triton"`: never.

It runs as the plain kernels do (`_triton.launches`): gated on the inputs being plain (q, k and v
finite, no score can overflow; tested on the device), beside the Triton general forward gated on
the negation and writing into the same results. The backward of such a call runs the Mosaic GPU
backward (`_mosaic_backward`: H and Hv in 64, 128) gated the same way beside Triton's general backward;
at other head dims Triton's backward (the forward's lse is the same natural-log statistic).

Mosaic GPU kernels compile for GPUs only: on a CPU the package cannot run them (JAX's Mosaic GPU
interpreter is private API). `INTERPRET` is the hook the tests set, through their version-pinned
shim (tests/mosaic_interpret.py), to run the wired path interpreted.
"""

from __future__ import annotations

import dataclasses

from jax_flash import _heuristics, _registry
from jax_flash._spec import AttentionSpec
from jax_flash.pallas import _mosaic, _mosaic_backward

# The architectures the Mosaic GPU forward is built for (wgmma and setmaxnreg: sm_90a).
MOSAIC_ARCHS = ("sm_90",)
# The interpret parameters the Mosaic GPU forward runs under on a CPU: None in the package.
INTERPRET: object = None


def band(spec: AttentionSpec) -> dict:
    """The Mosaic GPU kernels' static keywords for the call: its causal mask or sliding window and
    its soft cap (the per batch row query offset and lengths are arrays: `masks`)."""
    if spec.window_right == 0 and spec.window_left is None:
        return dict(causal=True, window=(None, None), soft_cap=spec.soft_cap)
    return dict(causal=False, window=(spec.window_left, spec.window_right), soft_cap=spec.soft_cap)


def masks(masks) -> dict:
    """The Mosaic GPU kernels' keywords for a call's [B] query offset and lengths and its [B, T],
    [B, S] segment ids (`MaskInputs`)."""
    return dict(
        q_offset=masks.q_offset,
        q_lengths=masks.q_lengths,
        kv_lengths=masks.kv_lengths,
        q_segment_ids=masks.q_segment_ids,
        kv_segment_ids=masks.kv_segment_ids,
    )


def mosaic_unsupported(spec: AttentionSpec) -> str | None:
    """Why the Mosaic GPU forward cannot serve `spec` here, or None."""
    arch = _registry.device_arch()
    if INTERPRET is None and arch not in MOSAIC_ARCHS:
        where = f"an {arch} GPU" if arch else f"the {_registry.platform()} platform"
        return f"it runs on {', '.join(MOSAIC_ARCHS)} GPUs only, not on {where}"
    blocker = _heuristics.pallas_plain_blocker(dataclasses.replace(spec, soft_cap=None))  # a cap it serves
    features = (
        (blocker is not None, blocker),
        (spec.mask_shape is not None, "a dense mask"),
        (spec.has_dropout, "dropout"),
    )
    for present, what in features:
        if present:
            return f"the call has {what} (the Mosaic GPU kernels serve the band, lengths, segment ids, a soft cap and sinks only)"
    b, t, s, n, kv = spec.batch, spec.q_len, spec.kv_len, spec.num_heads, spec.num_kv_heads
    return _mosaic.unsupported(
        (b, t, n, spec.head_dim), (b, s, kv, spec.head_dim), (b, s, kv, spec.v_head_dim), spec.dtype, **band(spec)
    )


def choose(spec: AttentionSpec) -> tuple[str, str]:
    """("triton" or "mosaic_gpu", the sentence `explain` prints) for the forward of `spec`;
    ValueError where `pallas_backend="mosaic_gpu"` asks for a call the kernel cannot serve (or
    the setting's variable holds no valid value)."""
    setting = spec.settings.get("pallas_backend")
    words = _heuristics.setting_words(spec, "pallas_backend")
    if setting == "triton":
        return "triton", f"Triton ({words})"
    why_not = mosaic_unsupported(spec)
    if setting == "mosaic_gpu":
        if why_not is not None:
            raise ValueError(f"pallas_backend='mosaic_gpu': the Mosaic GPU forward cannot serve this call: {why_not}")
        return "mosaic_gpu", f"Mosaic GPU ({words})"
    if why_not is not None:
        return "triton", f"Triton (the Mosaic GPU forward does not serve it: {why_not})"
    return _heuristics.measured_pallas_backend(spec, _registry.device_arch(), _registry.measured_entries())


def backward_unsupported(spec: AttentionSpec) -> str | None:
    """Why the Mosaic GPU backward cannot serve a call whose forward it serves, or None."""
    b, t, s, n, kv, h = spec.batch, spec.q_len, spec.kv_len, spec.num_heads, spec.num_kv_heads, spec.head_dim
    return _mosaic_backward.unsupported(
        (b, t, n, h), (b, s, kv, h), (b, s, kv, spec.v_head_dim), spec.dtype, **band(spec)
    )


def runs_mosaic_backward(spec: AttentionSpec) -> bool:
    """The backward of `spec` runs the Mosaic GPU kernels: its forward does, and they serve it."""
    return runs_mosaic(spec) and backward_unsupported(spec) is None


def runs_mosaic(spec: AttentionSpec) -> bool:
    """The forward of `spec` runs the Mosaic GPU kernel (False where `choose` raises)."""
    try:
        return choose(spec)[0] == "mosaic_gpu"
    except ValueError:
        return False


def description(spec: AttentionSpec) -> str:
    """`explain`'s words for the forward's compiler (the ValueError's text where it has one)."""
    try:
        backend, why = choose(spec)
    except ValueError as e:
        return f"forward: {e}"
    if backend == "triton":
        return f"forward compiled by {why}"
    why_not = backward_unsupported(spec)
    backward = (
        "backward on Mosaic GPU too (a dQ kernel and a dK/dV kernel over the group's heads)"
        if why_not is None
        else f"backward on Triton (the Mosaic GPU backward does not serve {why_not})"
    )
    return (
        f"forward compiled by {why}: FlashAttention-3's schedule (TMA ring, wgmma, two consumer "
        f"warpgroups), its plain kernel where q, k and v are finite, Triton's general kernels elsewhere; {backward}"
    )
