"""Implementations and how one is chosen.

Each implementation is an object with a name, `unsupported(spec)` (None, or the reason it
cannot serve the call) and `forward`/`backward` on canonical inputs. They all plug into the
one custom_vjp in `_vjp.py`; none has its own autodiff rule.

Choice (`implementation=None`), at trace time, by the default backend:
GPU -> cuda, then pallas, then xla; CPU -> cpu, then xla; anything else -> xla.
A requested implementation that cannot serve the call raises with the reason; it never
silently becomes another.
"""

from __future__ import annotations

import importlib
from typing import Optional, Protocol

import jax

from jax_flash._spec import AttentionSpec, MaskInputs


class Implementation(Protocol):
    name: str

    def unsupported(self, spec: AttentionSpec) -> Optional[str]:
        """None if this implementation can run `spec` here, else why not (one sentence)."""

    def head_dims(self) -> str:
        """The (H, Hv) pairs of query/key and value head dims it serves, in words (e.g.
        "any pair with H, Hv <= 512"; `explain` states it for a call with Hv != H)."""

    def forward(self, spec: AttentionSpec, q, k, v, masks: MaskInputs):
        """-> out [B, T, N, Hv] (dtype of q), lse [B, N, T] float32 natural log."""

    def backward(self, spec: AttentionSpec, q, k, v, masks: MaskInputs, out, lse, dout, dlse):
        """-> dq, dk, dv (input dtypes), dbias (shape and dtype of masks.bias, or None)."""


# name -> module that defines IMPLEMENTATION; imported on first use so that optional
# dependencies (the extension, Triton) are only touched when asked for.
_MODULES = {
    "cuda": "jax_flash.cuda",
    "pallas": "jax_flash.pallas",
    "cpu": "jax_flash.cpu",
    "xla": "jax_flash.xla",
}

_PREFERENCE = {
    "gpu": ("cuda", "pallas", "xla"),
    "cpu": ("cpu", "xla"),
}


def get(name: str) -> Implementation:
    """The implementation object, or ImportError with the reason it cannot be loaded."""
    module = importlib.import_module(_MODULES[name])
    return module.IMPLEMENTATION


# The SM count assumed where the device does not give one (an H100 / H200; the host emulation
# of the CUDA kernels, interpreted Pallas): the split-KV and grid rules count in SMs.
DEFAULT_SM_COUNT = 132


def device_sm_count() -> Optional[int]:
    """The default device's streaming multiprocessors (jax's `core_count`), or None where it
    has none (a CPU)."""
    count = getattr(jax.devices()[0], "core_count", None)
    return int(count) if count else None


def sm_count() -> int:
    """device_sm_count(), or DEFAULT_SM_COUNT where the device does not say."""
    return device_sm_count() or DEFAULT_SM_COUNT


def platform() -> str:
    """'gpu', 'cpu' or the backend's own name (e.g. 'tpu')."""
    backend = jax.default_backend()
    return "gpu" if backend in ("gpu", "cuda", "rocm") else backend


def reason(name: str, spec: AttentionSpec) -> Optional[str]:
    """Why `name` cannot serve `spec` here, or None when it can."""
    try:
        impl = get(name)
    except ImportError as e:  # an optional dependency is missing
        return f"cannot be loaded: {e}"
    return impl.unsupported(spec)


def explain(spec: AttentionSpec, requested: Optional[str] = None) -> dict[str, Optional[str]]:
    """{name: None if it can run else the reason}, in preference order for this platform."""
    order = list(_PREFERENCE.get(platform(), ("xla",)))
    order += [n for n in _MODULES if n not in order]
    return {name: reason(name, spec) for name in order}


def notes(spec: AttentionSpec, reasons: dict[str, Optional[str]]) -> dict[str, str]:
    """{name: how it would run} for the implementations in `reasons` that can run `spec` and
    have something to say (an optional `note(spec)`: e.g. which kernel image a GPU runs;
    for a value head dim Hv != H, the (H, Hv) pairs it serves: `head_dims()`)."""
    out = {}
    for name, why in reasons.items():
        if why is None:
            impl = get(name)
            note = getattr(impl, "note", None)
            text = note(spec) if note is not None else None
            head_dims = getattr(impl, "head_dims", None)
            if spec.v_head_dim != spec.head_dim and head_dims is not None:
                pairs = f"(H, Hv) served: {head_dims()}"
                text = f"{text}; {pairs}" if text else pairs
            if text:
                out[name] = text
    return out


def select(spec: AttentionSpec, requested: Optional[str]) -> str:
    """The name of the implementation that runs `spec`."""
    if requested is not None:
        why = reason(requested, spec)
        if why is not None:
            raise ValueError(f'implementation="{requested}" cannot run this call: {why}')
        return requested
    for name in _PREFERENCE.get(platform(), ("xla",)):
        if reason(name, spec) is None:
            return name
    raise ValueError(f"no implementation can run this call: {explain(spec)}")
