"""Implementations and how one is chosen.

Each implementation is an object with a name, `unsupported(spec)` (None, or the reason it
cannot serve the call) and `forward`/`backward` on canonical inputs. They all plug into the
one custom_vjp in `_vjp.py`; none has its own autodiff rule. The capabilities reach them
through here by name, never by importing them: paged attention asks `paged_unsupported(pspec)`
and runs `paged_forward` (`paged_reason`, `paged_default`); ring attention runs `forward` and
`backward` on its blocks.

Choice (`implementation=None`), at trace time, by the default backend:
GPU -> cuda, then pallas, then xla; CPU -> cpu, then xla; anything else -> xla.
A requested implementation that cannot serve the call raises with the reason; it never
silently becomes another.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Protocol, cast

import jax

from jax_flash import _heuristics
from jax_flash._paged_spec import PagedSpec
from jax_flash._spec import AttentionSpec, MaskInputs


class Implementation(Protocol):
    name: str

    def unsupported(self, spec: AttentionSpec) -> str | None:
        """None if this implementation can run `spec` here, else why not (one sentence)."""

    # Optional: `summary(spec) -> str`, how it would run `spec` in plain words (`explain`'s one
    # line), and `note(spec) -> str | None`, the rules behind that (`explain(..., verbose=True)`).

    def head_dims(self) -> str:
        """The (H, Hv) pairs of query/key and value head dims it serves, in words (e.g.
        "any pair with H, Hv <= 512"; `explain` states it for a call with Hv != H)."""

    def forward(self, spec: AttentionSpec, q, k, v, masks: MaskInputs):
        """-> out [B, T, N, Hv] (dtype of q), lse [B, N, T] float32 natural log."""

    def backward(self, spec: AttentionSpec, q, k, v, masks: MaskInputs, out, lse, dout, dlse):
        """-> dq, dk, dv (input dtypes), dbias (shape and dtype of masks.bias, or None); for a
        flex_attention call (spec.flex, served by an implementation with `serves_flex = True`)
        a fifth result: the cotangents of masks.score_consts (None for non-floating ones)."""


class PagedImplementation(Implementation, Protocol):
    """An implementation that serves `paged_attention` (jax_flash/inference/paged.py)."""

    paged_default: bool  # whether implementation=None may pick it (in the platform's order)

    def paged_unsupported(self, pspec: PagedSpec) -> str | None:
        """None if it can run the paged call `pspec` here, else why not (one sentence)."""

    def paged_forward(self, pspec: PagedSpec, q, key_pages, value_pages, table, lengths, sinks=None):
        """-> out [B, T, N, H] (dtype of q), lse [B, N, T] float32."""

    def paged_summary(self, pspec: PagedSpec) -> str:
        """How it runs the paged call, in plain words (`explain_paged`'s one line)."""

    def paged_note(self, pspec: PagedSpec) -> str:
        """How it runs the paged call and the rules behind it (`explain_paged(..., verbose=True)`)."""


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


def get_paged(name: str) -> PagedImplementation | None:
    """The implementation object if it serves paged_attention (it has `paged_forward`), else
    None; ImportError as `get`."""
    impl = get(name)
    return cast(PagedImplementation, impl) if hasattr(impl, "paged_forward") else None


# The SM count assumed where the device does not give one (an H100 / H200; the host emulation
# of the CUDA kernels, interpreted Pallas): the split-KV and grid rules count in SMs.
DEFAULT_SM_COUNT = 132


def device_sm_count() -> int | None:
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


def preference() -> tuple[str, ...]:
    """The implementations implementation=None tries on this platform, in order."""
    return _PREFERENCE.get(platform(), ("xla",))


def names() -> list[str]:
    """Every implementation: this platform's preference order, then the others."""
    order = list(preference())
    return order + [n for n in _MODULES if n not in order]


def reason(name: str, spec: AttentionSpec) -> str | None:
    """Why `name` cannot serve `spec` here, or None when it can."""
    try:
        impl = get(name)
    except ImportError as e:  # an optional dependency is missing
        return f"cannot be loaded: {e}"
    if spec.flex is not None and not getattr(impl, "serves_flex", False):
        # Never a dense fallback: the user functions would have to be materialised as T×S.
        return "does not serve flex_attention (score_mod, mask_mod, block masks) yet"
    return impl.unsupported(spec)


def explain(spec: AttentionSpec, requested: str | None = None) -> dict[str, str | None]:
    """{name: None if it can run else the reason}, in preference order for this platform."""
    return {name: reason(name, spec) for name in names()}


def notes(spec: AttentionSpec, reasons: dict[str, str | None]) -> dict[str, str]:
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


def summaries(spec: AttentionSpec, reasons: dict[str, str | None]) -> dict[str, str]:
    """{name: one plain phrase of how it would run} for the implementations in `reasons` that
    can run `spec` and have an optional `summary(spec)` (explain's one line per implementation)."""
    out = {}
    for name, why in reasons.items():
        summary = getattr(get(name), "summary", None) if why is None else None
        if summary is not None:
            out[name] = summary(spec)
    return out


def device_arch() -> str | None:
    """The default device's architecture ("sm_90") on a GPU, else None."""
    if platform() != "gpu":
        return None
    cc = getattr(jax.devices()[0], "compute_capability", None)
    if not cc:
        return None
    major, minor = str(cc).split(".")[:2]
    return f"sm_{major}{minor}"


@functools.cache
def _measured_entries() -> tuple[dict, ...]:
    return tuple(_heuristics.load_measured_choices())


def measured_entries() -> list[dict]:
    """The measured table's entries (`_heuristics.load_measured_choices`), read once."""
    return list(_measured_entries())


def choice(spec: AttentionSpec) -> tuple[tuple[str, ...], str]:
    """(the order implementation=None tries for `spec` here, the sentence saying what it rests
    on): on a GPU the implementations a device run measured for the call's class, fastest
    first (`_heuristics.measured_choice`), then the platform's default order."""
    measured, why = _heuristics.measured_choice(spec, device_arch(), list(_measured_entries()))
    rest = tuple(n for n in preference() if n not in measured)
    return tuple(n for n in measured if n in _MODULES) + rest, why


def select(spec: AttentionSpec, requested: str | None) -> str:
    """The name of the implementation that runs `spec`."""
    if requested is not None:
        why = reason(requested, spec)
        if why is not None:
            raise ValueError(f'implementation="{requested}" cannot run this call: {why}')
        return requested
    for name in choice(spec)[0]:
        if reason(name, spec) is None and _default_for(name, spec):
            return name
    raise ValueError(f"no implementation can run this call: {explain(spec)}")


def _default_for(name: str, spec: AttentionSpec) -> bool:
    """Whether implementation=None may pick `name` for `spec`: a flex call only where the
    implementation says so (`flex_default`, True when absent); asking for it by name works."""
    return spec.flex is None or getattr(get(name), "flex_default", True)


def paged_reason(name: str, pspec: PagedSpec) -> str | None:
    """Why `name` cannot serve the paged_attention call `pspec` here, or None when it can."""
    try:
        impl = get_paged(name)
    except ImportError as e:  # an optional dependency is missing
        return f"cannot be loaded: {e}"
    if impl is None:
        return "does not serve paged_attention"
    return impl.paged_unsupported(pspec)


def paged_default(pspec: PagedSpec) -> str:
    """What paged_attention(implementation=None) runs: the first implementation of this
    platform's preference order that may be picked by default (`paged_default`) and serves
    the call; xla (which serves every call) when none does."""
    for name in preference():
        if paged_reason(name, pspec) is None and getattr(get(name), "paged_default", False):
            return name
    return "xla"


@dataclasses.dataclass(frozen=True)
class Explanation:
    """Which implementation `attention` would run for a call, and why not the others.

    `str()` gives one plain line per implementation: available, with how it would run in
    words (`summaries`), or unavailable, with the reason. With `verbose=True` (`explain(...,
    verbose=True)`) each available line is followed by the rule behind it and its formula
    (`notes`), e.g. the split-KV rule with the figures of this call."""

    selected: str | None
    reasons: dict[str, str | None]  # name -> None (can run) or the reason it cannot

    notes: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> the rules and formulae behind it
    op: str = "jax_flash.attention"  # the function explained
    summaries: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> how it runs, in plain words
    verbose: bool = False  # str() adds the notes
    # How the call runs with its inputs sharded over the sequence under jax.jit (ring,
    # all-to-all or hybrid, and why), or None (inputs not sequence-sharded).
    sequence_parallel: str | None = None

    def __str__(self) -> str:
        lines = [f"{self.op} would run: {self.selected or 'nothing'}"]
        for name, why in self.reasons.items():
            mark = "*" if name == self.selected else " "
            if why is not None:
                lines.append(f" {mark} {name:8s} unavailable: {why}")
                continue
            summary = self.summaries.get(name)
            lines.append(f" {mark} {name:8s} available" + (f": {summary}" if summary else ""))
            if self.verbose and name in self.notes:
                lines.append(f"   {'':8s} details: {self.notes[name]}")
        if self.sequence_parallel is not None:
            lines.append(f"sequence parallel: {self.sequence_parallel}")
        return "\n".join(lines)


def explanation(
    spec: AttentionSpec, requested: str | None, *, verbose: bool = False, op: str = "jax_flash.attention"
) -> Explanation:
    """The `Explanation` of a call with this spec: why each implementation can or cannot serve
    it, which one `requested` (None: the default order) selects, and how each would run."""
    reasons = explain(spec)
    try:
        selected: str | None = select(spec, requested)
    except ValueError:
        selected = None
    details = notes(spec, reasons)
    if requested is None and selected is not None:
        # What implementation=None's order rests on: a device run's measurement, or the default.
        why = f"chosen by: {choice(spec)[1]}"
        details[selected] = f"{details[selected]}; {why}" if selected in details else why
    return Explanation(
        selected=selected,
        reasons=reasons,
        notes=details,
        summaries=summaries(spec, reasons),
        verbose=verbose,
        op=op,
    )
