"""The pallas kernels' key loops against JAX's own Pallas kernel, read from the Triton IR on any
machine (build/pallas_loops.py).

Lowering for the `cuda` platform needs no GPU: each `pallas_call` becomes a Triton custom call
whose IR this reads. For a plain call (bf16, H = 64 and 128, causal or not) the plain kernels'
key loops must do no more floating-point work per score than `KEY_LOOP_RATIO` times that of
JAX's `jax.experimental.pallas.ops.gpu.attention.mha` at the same shape (its forward, and its
backward against each of ours), hold no per-score select, and pass no loaded tile through a
select on its way into a dot. A select per score planted in the plain forward must fail it.

Where the `triton` package is installed, `python build/pallas_loops.py --sass` prints the same
loops' SASS for sm_90 (docs/gpu-results.md records the figures); the test reads the IR only.
"""

from __future__ import annotations

import functools
import pathlib
import sys

import jax.numpy as jnp
import pytest

from jax_flash.pallas import _triton_kernels

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "build"))

import pallas_loops  # noqa: E402

KEY_LOOP_RATIO = 1.15  # ours / JAX's floating-point operations per score of the key loop
MAX_SELECTS_PER_SCORE = 0.05  # per-row selects only (a per-score one is 1.0)
SEQ = 1024  # the loops do not depend on the length once it spans several tiles

OURS = {"fwd": "jax_flash_fwd_plain", "dkdv": "jax_flash_bwd_dkdv_plain", "dq": "jax_flash_bwd_dq_plain"}


@functools.cache
def _loops(who: str, head_dim: int, causal: bool) -> dict[str, pallas_loops.KeyLoop]:
    lower = pallas_loops.lower_ours if who == "ours" else pallas_loops.lower_jax_mha
    found = {}
    for kernel in pallas_loops.triton_kernels(lower(head_dim, causal, seq=SEQ, dtype=jnp.bfloat16)):
        loop = pallas_loops.key_loop(kernel)
        if loop is not None:
            found[kernel.name] = loop
    return found


def _check(ours: pallas_loops.KeyLoop, theirs: pallas_loops.KeyLoop, what: str):
    ratio = ours.per_score("float") / theirs.per_score("float")
    assert ratio <= KEY_LOOP_RATIO, (
        f"{what}: {ours.per_score('float'):.3f} floating-point operations per score, "
        f"{ratio:.2f}x JAX's {theirs.per_score('float'):.3f} (budget {KEY_LOOP_RATIO}x): {ours.summary()}"
    )
    assert ours.per_score("select") <= MAX_SELECTS_PER_SCORE, f"{what}: a select per score: {ours.summary()}"
    assert not ours.select_before_dot, f"{what}: a loaded tile passes a select into a dot: {ours.select_before_dot}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_plain_key_loops_within_budget_of_jax_mha(head_dim, causal):
    ours, theirs = _loops("ours", head_dim, causal), _loops("jax", head_dim, causal)
    assert set(OURS.values()) <= set(ours), sorted(ours)
    _check(ours[OURS["fwd"]], theirs["mha_forward"], f"forward H={head_dim} causal={causal}")
    for pass_ in ("dkdv", "dq"):
        _check(ours[OURS[pass_]], theirs["mha_backward"], f"{pass_} H={head_dim} causal={causal}")


def test_general_kernels_are_lowered_beside_the_plain_ones():
    """A call the plain kernels may serve carries both: the general ones run where an input is
    not finite (the conditional is on the device)."""
    names = set(_loops("ours", 128, False))
    assert {"jax_flash_fwd", "jax_flash_bwd_dkdv", "jax_flash_bwd_dq"} <= names, sorted(names)


def test_budget_catches_a_per_score_select(monkeypatch):
    """The old poisoning (an isinf select per raw score) planted in the plain forward fails
    the budget."""
    dot = _triton_kernels._dot

    def planted(a, b, trans_b=False, trans_a=False):
        s = dot(a, b, trans_b=trans_b, trans_a=trans_a)
        return jnp.where(jnp.isinf(s), jnp.nan, s)

    monkeypatch.setattr(_triton_kernels, "_dot", planted)
    kernels = pallas_loops.triton_kernels(pallas_loops.lower_ours(128, False, seq=SEQ, dtype=jnp.bfloat16))
    ours = {k.name: pallas_loops.key_loop(k) for k in kernels}
    with pytest.raises(AssertionError, match="per score"):
        _check(ours[OURS["fwd"]], _loops("jax", 128, False)["mha_forward"], "planted")


@pytest.mark.parametrize(
    "causal, window_left, loops",
    [(False, None, 1), (True, None, 2), (True, 300, 3)],
    ids=["full", "causal", "window"],
)
def test_no_statically_empty_loop(causal, window_left, loops):
    """A masked segment known at trace time to be empty emits no loop: the plain forward of a
    full call has one key loop, a causal one two (interior, diagonal), a window three."""
    kernels = pallas_loops.triton_kernels(
        pallas_loops.lower_ours(128, causal, seq=SEQ, dtype=jnp.bfloat16, backward=False, window_left=window_left)
    )
    fwd = {k.name: k for k in kernels}[OURS["fwd"]]
    assert pallas_loops.dot_loops(fwd) == loops
