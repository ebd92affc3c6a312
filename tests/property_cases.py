"""Seeded random attention calls for the property-based suite (tests/contract/test_property.py).

`draw(impl, index, seed)` returns one `Example`: shapes, dtype, every mask argument (alone and
combined), soft cap, scale, bias/mask, NaN/Inf injections and the cotangents, as plain Python
values (so that it prints and reproduces), drawn from a numpy Generator seeded by
(seed, implementation, index) alone: example `cuda-17` of seed 0 is the same call on every
machine and in every run, whatever else is collected. `Example.arrays()` builds its inputs
and `Example.kwargs(arrays)` the keyword arguments of `jax_flash.attention`.

`visibility(example)` is an independent numpy statement of the mask rules (which keys
each query may see; docs/design.md, "Masks"), used for the exact checks (empty rows, keys no
query sees).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from cases import Shape

# Tile sizes of the kernels ±1 (16-row warps, 32/64-row backward blocks, 64-key tiles,
# 128-row forward blocks): lengths are drawn near them half of the time.
TILE_LENGTHS = (15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129)
TINY_TILE_LENGTHS = (15, 16, 17, 31, 32, 33, 63, 64, 65)

# Head dims each implementation has kernels for (its own claims are asked too: explain).
HEAD_DIMS = {
    "cuda": (32, 64, 96, 128),
    "cpu": (16, 32, 40, 64, 96, 128, 160, 256),
    "pallas": (16, 32, 40, 64, 96, 128),
    "xla": (8, 16, 32, 40, 64, 96, 128, 160, 256),
}
DTYPES = {
    "cuda": ("bfloat16", "float16"),
    "cpu": ("float32", "bfloat16", "float16"),
    "pallas": ("float32", "bfloat16", "float16"),
    "xla": ("float32", "bfloat16", "float16", "float64"),
}
TAKES_DENSE = ("xla", "pallas", "cpu", "cuda")  # implementations that take a dense bias / mask

SCALES = (0.0, -0.0, -0.3, -1.7, 1e-30, 1e-6, 0.1, 1.0, 3.0, 30.0)
EXTREME_SCALES = (1e8, -1e8, 1e12, 1e30, -1e30)  # logits far beyond any softmax's range
SOFT_CAPS = (1.1754944e-38, 1e-3, 0.5, 2.5, 30.0, 1e4, 1e30)  # float32's smallest normal .. 1e30
LARGE_SOFT_CAP = 1e4  # from here on logits / cap is tiny: tanh must keep its relative accuracy there
BAD_SOFT_CAPS = (1e-39, 1e-46, 1e39)  # not a positive float32 normal: ValueError
F32_MAX_LOGIT = 10.0  # float32 examples keep 4 sigma of their logits below this (see draw)
HUGE_WINDOWS = (2**31 - 1, 2**31, 2**40, 2**70)
POISONS = (float("nan"), float("inf"), float("-inf"))


@dataclasses.dataclass
class Gates:
    """Which dimensions may be drawn (the switches of tests/contract/test_property.py)."""

    poisons: bool = True  # NaN/Inf in q, k, v, bias
    huge_windows: bool = True  # window sides >= 2**31
    bad_soft_caps: bool = True  # soft caps that are not a float32 normal (a ValueError)
    large_soft_caps: bool = True  # soft caps >= LARGE_SOFT_CAP (else 30)
    zero_size: bool = True  # B, T, S or N = 0


@dataclasses.dataclass
class Example:
    impl: str
    index: int
    seed: int
    shape: Shape  # B, T, S, N, K, H (also read as ex.b, ex.t, ... below)
    dtype: str
    scale: Optional[float] = None
    is_causal: bool = False
    window: Any = None  # None, int or (left, right)
    q_lengths: Optional[list] = None
    kv_lengths: Optional[list] = None
    segments: Optional[tuple] = None  # (q_ids [B][T], kv_ids [B][S], single array?)
    q_offset: Any = None  # None, int or per-row list
    soft_cap: Optional[float] = None
    bias_shape: Optional[tuple] = None
    bias_dtype: Optional[str] = None
    bias_neg_inf: float = 0.0  # fraction of bias entries set to -inf (an additive mask)
    mask_shape: Optional[tuple] = None
    mask_density: float = 1.0
    poisons: tuple = ()  # ((tensor, flat index, value), ...)
    magnitude: float = 1.0  # std of q and k
    dlse_on_empty: bool = False  # the lse cotangent is nonzero on rows that see no key
    expect_error: Optional[str] = None  # the argument a ValueError must name

    b = property(lambda self: self.shape.b)
    t = property(lambda self: self.shape.t)
    s = property(lambda self: self.shape.s)
    n = property(lambda self: self.shape.n)
    kh = property(lambda self: self.shape.kh)
    h = property(lambda self: self.shape.h)

    @property
    def id(self) -> str:
        return f"{self.impl}-{self.index}"

    def describe(self) -> str:
        parts = [f"B{self.b} T{self.t} S{self.s} N{self.n} K{self.kh} H{self.h} {self.dtype}"]
        for name in ("scale", "is_causal", "window", "q_lengths", "kv_lengths", "q_offset", "soft_cap",
                     "bias_shape", "bias_dtype", "bias_neg_inf", "mask_shape", "mask_density", "poisons",
                     "magnitude", "dlse_on_empty", "expect_error"):
            value = getattr(self, name)
            default = Example.__dataclass_fields__[name].default
            if value != default and not (isinstance(value, float) and math.isnan(value)):
                parts.append(f"{name}={value!r}")
        if self.segments is not None:
            q_ids, kv_ids, single = self.segments
            parts.append(f"segment_ids={'single' if single else 'pair'}(q={q_ids}, kv={kv_ids})")
        return " ".join(parts)

    # ---- inputs --------------------------------------------------------------------------
    def arrays(self) -> dict:
        """q, k, v (poisoned as drawn), bias, mask, and the cotangents ct (of out) and
        dlse (of lse), as jax arrays; the same for every call."""
        rng = np.random.default_rng(_seed(self.seed, self.impl, self.index, "arrays"))
        dt = jnp.dtype(self.dtype)
        qshape = (self.b, self.t, self.n, self.h)
        kshape = (self.b, self.s, self.kh, self.h)
        a = {
            "q": rng.normal(0.1, self.magnitude, qshape),
            "k": rng.normal(-0.1, self.magnitude, kshape),
            "v": rng.normal(0.2, 1.0, kshape),
        }
        if self.bias_shape is not None:
            bias = rng.normal(0.0, 1.0, self.bias_shape)
            if self.bias_neg_inf:
                bias[rng.random(self.bias_shape) < self.bias_neg_inf] = -np.inf
            a["bias"] = bias
        for name, flat, value in self.poisons:
            if a[name].size:
                a[name].reshape(-1)[flat % a[name].size] = value
        out = {name: jnp.asarray(x, dt) for name, x in a.items() if name != "bias"}
        if "bias" in a:
            out["bias"] = jnp.asarray(a["bias"], jnp.dtype(self.bias_dtype))
        if self.mask_shape is not None:
            out["mask"] = jnp.asarray(rng.random(self.mask_shape) < self.mask_density)
        out["ct"] = jnp.asarray(rng.normal(0.0, 1.0, qshape), dt)
        lse_dt = jnp.float64 if self.dtype == "float64" else jnp.float32
        out["dlse"] = jnp.asarray(rng.normal(0.0, 1.0, (self.b, self.t, self.n)), lse_dt)
        return out

    def kwargs(self) -> dict:
        """Keyword arguments of jax_flash.attention / attention_reference (no bias, mask)."""
        kw = {}
        if self.scale is not None:
            kw["scale"] = self.scale
        if self.is_causal:
            kw["is_causal"] = True
        if self.window is not None:
            kw["local_window_size"] = self.window
        if self.q_lengths is not None:
            kw["query_seq_lengths"] = jnp.asarray(self.q_lengths, jnp.int32)
        if self.kv_lengths is not None:
            kw["key_value_seq_lengths"] = jnp.asarray(self.kv_lengths, jnp.int32)
        if self.segments is not None:
            q_ids, kv_ids, single = self.segments
            q_ids = jnp.asarray(q_ids, jnp.int32).reshape(self.b, self.t)
            kv_ids = jnp.asarray(kv_ids, jnp.int32).reshape(self.b, self.s)
            kw["segment_ids"] = q_ids if single else (q_ids, kv_ids)
        if self.q_offset is not None:
            kw["query_offset"] = (self.q_offset if isinstance(self.q_offset, int)
                                  else jnp.asarray(self.q_offset, jnp.int32))
        if self.soft_cap is not None:
            kw["logits_soft_cap"] = self.soft_cap
        return kw


def _seed(*parts) -> int:
    return zlib.crc32(":".join(map(str, parts)).encode())


def _length(rng, tiny: bool) -> int:
    if rng.random() < 0.5:
        return int(rng.choice(TINY_TILE_LENGTHS if tiny else TILE_LENGTHS))
    hi = 48 if tiny else 300
    return int(np.clip(np.exp(rng.uniform(0, math.log(hi))), 1, hi))


def _seq_lengths(rng, b: int, full: int) -> list:
    """One length per batch row: 0, negative, inside, exactly full, beyond full (an empty
    axis, full = 0, draws 1 for "at least one")."""
    out = []
    for _ in range(b):
        kind = rng.integers(6)
        out.append(int([0, -int(rng.integers(1, 2 * full + 2)), rng.integers(0, full + 1), full,
                         full + int(rng.integers(1, full + 2)), rng.integers(1, max(full, 1) + 1)][kind]))
    return out


def _segment_ids(rng, b: int, length: int, num: int) -> list:
    ids = rng.integers(0, num, size=(b, length))
    if rng.random() < 0.7:  # packed documents: sorted ids
        ids = np.sort(ids, axis=1)
    return ids.tolist()


def _window_side(rng, length: int, gates: Gates):
    kind = rng.integers(8)
    if kind == 0:
        return 0
    if kind == 1 and gates.huge_windows:
        return int(rng.choice(HUGE_WINDOWS))
    if kind == 2:
        return length + int(rng.integers(0, 3))  # covers the sequence exactly or more
    return int(rng.integers(0, max(length, 1) + 1))


def _broadcast_shape(rng, full: tuple) -> tuple:
    """A random shape broadcastable to `full` (some axes 1); keeps the rank."""
    return tuple(d if rng.random() < 0.6 else 1 for d in full)


def draw(impl: str, index: int, seed: int, *, tiny: bool, gates: Gates, attempt: int = 0) -> Example:
    """One example for `impl`. tiny: shapes for interpreted/emulated implementations.
    attempt > 0 draws afresh (after the implementation refused attempt - 1)."""
    rng = np.random.default_rng(_seed(seed, impl, index, attempt))
    # Mostly what this implementation claims; sometimes anything (its refusal is tested).
    own = rng.random() < 0.9
    dtypes = DTYPES[impl] if own else DTYPES["xla"]
    heads = HEAD_DIMS[impl] if own else HEAD_DIMS["xla"] + (512, 640)
    dtype = str(rng.choice(dtypes))
    h = int(rng.choice(heads))
    t, s = _length(rng, tiny), _length(rng, tiny)
    if rng.random() < 0.2:
        s = t  # self-attention (a single segment_ids array)
    kh = int(rng.choice((1, 1, 2, 3)))
    g = int(rng.choice((1, 2, 3, 4)))  # g > 1: grouped-query; K = 1: multi-query
    b = int(rng.choice((1, 1, 2, 3)))
    # Bound the work (the float64 reference materialises B·N·T·S logits).
    budget = 60_000 if tiny else 400_000
    while b * kh * g * t * s > budget and (b > 1 or kh * g > 1):
        if b > 1:
            b -= 1
        elif g > 1:
            g -= 1
        else:
            kh -= 1
    n = kh * g
    zero_axis, zero_pick = int(rng.integers(4)), rng.random()  # always drawn: a stable stream
    zero_axis = zero_axis if zero_pick < 0.04 else None
    if zero_axis is not None and gates.zero_size:  # an empty B, T, S or N
        b, t, s, n = [0 if i == zero_axis else x for i, x in enumerate((b, t, s, n))]
    ex = Example(impl, index, seed, Shape(b, t, s, n, kh, h), dtype)

    flags = rng.random(12)
    if flags[0] < 0.35:
        ex.is_causal = True
    if flags[1] < 0.35:
        if rng.random() < 0.3:
            ex.window = _window_side(rng, max(t, s), gates)
        else:
            ex.window = (_window_side(rng, t + s, gates), _window_side(rng, t + s, gates))
    if flags[2] < 0.25:
        ex.q_lengths = _seq_lengths(rng, b, t)
    if flags[3] < 0.25:
        ex.kv_lengths = _seq_lengths(rng, b, s)
    if flags[4] < 0.2:
        num = int(rng.integers(1, 5))
        single = t == s and rng.random() < 0.5
        q_ids = _segment_ids(rng, b, t, num)
        kv_ids = q_ids if single else _segment_ids(rng, b, s, num + int(rng.integers(0, 2)))
        ex.segments = (q_ids, kv_ids, single)
    if flags[5] < 0.3:
        choices = [s - t, -int(rng.integers(1, t + 3)), s + int(rng.integers(0, 5)),
                   int(rng.integers(-t, s + 1)), int(rng.choice((-(2**30), 2**30, 2**31 - 1, -(2**31))))]
        if rng.random() < 0.5:
            ex.q_offset = int(rng.choice(choices[:4]) if rng.random() < 0.9 else choices[4])
        else:
            ex.q_offset = [int(rng.choice(choices[:4])) for _ in range(b)]
    if flags[6] < 0.25:
        if rng.random() < 0.1:
            if gates.bad_soft_caps:
                ex.soft_cap = float(rng.choice(BAD_SOFT_CAPS))
                ex.expect_error = "logits_soft_cap"
        else:
            ex.soft_cap = float(rng.choice(SOFT_CAPS))
            if ex.soft_cap >= LARGE_SOFT_CAP and not gates.large_soft_caps:
                ex.soft_cap = 30.0
    if flags[7] < 0.4:
        if rng.random() < 0.15:
            ex.scale = float(rng.choice(EXTREME_SCALES))
        else:
            ex.scale = float(rng.choice(SCALES))
    dense = impl in TAKES_DENSE or rng.random() < 0.1  # (the others refuse: tested)
    if dense and flags[8] < 0.3:
        ex.bias_shape = _broadcast_shape(rng, (b, n, t, s))
        ex.bias_dtype = "float32" if rng.random() < 0.5 or dtype == "float64" else dtype
        if rng.random() < 0.25:
            ex.bias_neg_inf = float(rng.choice((0.1, 0.5, 0.95)))
    if dense and flags[9] < 0.2:
        ex.mask_shape = _broadcast_shape(rng, (b, n, t, s))
        ex.mask_density = float(rng.choice((0.05, 0.5, 0.9)))
    if flags[10] < 0.25:
        targets = ["q", "k", "v"] + (["bias"] if ex.bias_shape is not None else [])
        count = int(rng.integers(1, 4))
        poisons = tuple((str(rng.choice(targets)), int(rng.integers(0, 2**31)), float(rng.choice(POISONS)))
                        for _ in range(count))
        if gates.poisons:
            ex.poisons = poisons
    if flags[11] < 0.2:
        ex.magnitude = float(rng.choice((0.01, 3.0, 10.0)))
    if dtype == "float32" and (ex.scale is None or abs(ex.scale) < EXTREME_SCALES[0]):
        # Every implementation recomputes probabilities from a float32 lse, whose rounding moves
        # them by |lse| · 2^-24 relative, and the gradients with them: past logits of ~10 that
        # alone can exceed the float32 tolerance (the float32 reference does not round an lse).
        # Scale q and k down to stay below; the extreme scales test large logits on their own.
        scale = 1 / math.sqrt(h) if ex.scale is None else abs(ex.scale)
        logits = 4 * scale * ex.magnitude**2 * math.sqrt(h)  # 4 sigma of q·k·scale
        if ex.soft_cap is not None:
            logits = min(logits, ex.soft_cap)
        if logits > F32_MAX_LOGIT:
            ex.magnitude = float(f"{ex.magnitude * math.sqrt(F32_MAX_LOGIT / logits):.3g}")
    ex.dlse_on_empty = bool(rng.random() < 0.5)
    return ex


# ---- what each query may see: docs/design.md's "Masks", restated in numpy -------------------
def visibility(ex: Example) -> np.ndarray:
    """bool [B, N, T, S]: query t of (batch b, head n) may see key s (masks combine by AND);
    the dense bias is not a mask (a -inf bias entry still counts as visible here)."""
    b, t, s, n = ex.b, ex.t, ex.s, ex.n
    vis = np.ones((b, n, t, s), bool)
    left = right = None
    if ex.window is not None:
        left, right = (ex.window, ex.window) if isinstance(ex.window, int) else ex.window
    if ex.is_causal:
        right = 0 if right is None else min(right, 0)
    offset = np.zeros(b, np.int64)
    if ex.q_offset is not None:
        offset = np.broadcast_to(np.asarray(ex.q_offset, np.int64), (b,))
    diag = (np.arange(s)[None, :] - np.arange(t)[:, None]).astype(np.int64)  # s - t
    cap = 2**40  # beyond every offset + length: an unbounded side
    if left is not None:
        vis &= (diag[None] >= (offset - min(left, cap))[:, None, None])[:, None]
    if right is not None:
        vis &= (diag[None] <= (offset + min(right, cap))[:, None, None])[:, None]
    if ex.q_lengths is not None:
        vis &= (np.arange(t)[None, :] < np.asarray(ex.q_lengths)[:, None])[:, None, :, None]
    if ex.kv_lengths is not None:
        vis &= (np.arange(s)[None, :] < np.asarray(ex.kv_lengths)[:, None])[:, None, None, :]
    if ex.segments is not None:
        q_ids, kv_ids, _ = ex.segments
        q_ids = np.asarray(q_ids).reshape(b, t)
        kv_ids = np.asarray(kv_ids).reshape(b, s)
        vis &= (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]
    return vis


def dense_mask(ex: Example, arrays: dict) -> Optional[np.ndarray]:
    if ex.mask_shape is None:
        return None
    return np.broadcast_to(np.asarray(arrays["mask"]), (ex.b, ex.n, ex.t, ex.s))
