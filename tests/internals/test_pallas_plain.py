"""The pallas plain kernels (jax_flash/pallas/_triton_kernels.py, `Layout.plain`).

A call whose raw scores and values are finite (`pallas.plain_inputs`, tested on every call)
and that has no soft cap, bias or flex function (`_heuristics.pallas_plain_blocker`) runs the
plain kernels: no poisoning, no finite copies, no clamp in the forward, its softmax in base 2
on the raw scores. They compute what the general kernels compute within rounding; these tests
hold them to that (the general kernels forced by the routing test returning False), and check
the routing: a poison in q, k or v, an overflowing score, a scale the raw-score softmax cannot
take or a feature it does not serve sends the call to the general kernels (a sink does not:
tests/features/test_sinks.py holds the plain forward's NaN, +inf and -inf sinks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from cases import Shape, make_qkv, make_sinks, mask_kwargs
from jax_flash import pallas
from jax_flash._spec import MaskInputs

SHAPE = Shape(2, 45, 70, 4, 2, 32)  # ragged against the interpreted tiles (32 x 16)
KINDS = ["none", "causal", "window", "lengths", "segments", "mask", "offset_window", "all_masked", "tile_window"]


def _run(q, k, v, **kw):
    def loss(q, k, v):
        out = jax_flash.attention(q, k, v, implementation="pallas", **kw)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size, dtype=out.dtype).reshape(out.shape))), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return [np.asarray(x, np.float64) for x in (out, *grads)]


def _close(a, b, rtol):
    scale = max(np.max(np.abs(b)), 1.0)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    assert np.nanmax(np.abs(a - b)) <= rtol * scale, np.nanmax(np.abs(a - b)) / scale


@pytest.mark.parametrize("extra", ["", "sinks", "dropout"])
@pytest.mark.parametrize("kind", KINDS)
def test_plain_kernels_agree_with_general(kind, extra, monkeypatch):
    """Forward and gradients of the plain and the general kernels on finite inputs agree to
    float32 rounding (they differ by where the scale is applied)."""
    q, k, v = make_qkv(SHAPE, jnp.float32)
    kw = mask_kwargs(kind, SHAPE)
    if extra == "sinks":
        kw["sinks"] = make_sinks(SHAPE).at[1].set(-jnp.inf)  # a -inf sink is no sink
    if extra == "dropout":
        kw.update(dropout_rate=0.3, dropout_rng=jax.random.PRNGKey(7))
    plain = _run(q, k, v, **kw)
    monkeypatch.setattr(pallas._triton, "plain_inputs", lambda *a: jnp.bool_(False))
    general = _run(q, k, v, **kw)
    for a, b in zip(plain, general):
        _close(a, b, 2e-5)


@pytest.mark.parametrize(
    "where, value, plain",
    [
        (None, None, True),
        ("q", jnp.nan, False),
        ("k", jnp.inf, False),
        ("k", -jnp.inf, False),
        ("v", jnp.nan, False),
        ("v", -jnp.inf, False),
        ("q", 2.0**60, False),  # with k = 2**60: 64 · 2**120 >= 2**126, a score could overflow
        ("sinks", jnp.nan, True),  # the plain forward joins a sink as the general one does
        ("sinks", jnp.inf, True),
        ("sinks", -jnp.inf, True),
    ],
)
def test_plain_inputs(where, value, plain):
    """The per-call test behind the plain kernels, under jit too."""
    q = jnp.ones((1, 4, 2, 64), jnp.bfloat16)
    k = jnp.ones((1, 6, 1, 64), jnp.bfloat16)
    v = jnp.ones((1, 6, 1, 64), jnp.bfloat16)
    sinks = jnp.zeros((2,), jnp.float32)
    if where == "q":
        q = q.at[0, 1, 1, 5].set(value)
        if value == 2.0**60:
            k = k.at[0, 3, 0, 7].set(value)
    elif where in ("k", "v"):
        x = (k if where == "k" else v).at[0, 3, 0, 7].set(value)
        k, v = (x, v) if where == "k" else (k, x)
    elif where == "sinks":
        sinks = sinks.at[1].set(value)
    masks = MaskInputs(sinks=sinks)
    assert bool(pallas.plain_inputs(q, k, v, masks)) is plain
    assert bool(jax.jit(pallas.plain_inputs)(q, k, v, masks)) is plain


@pytest.mark.parametrize(
    "kw, why",
    [
        ({}, None),
        (dict(is_causal=True, dropout_rate=0.1), None),
        (dict(logits_soft_cap=3.0), "a soft cap"),
        (dict(bias=np.zeros((1, 1, 8, 8), np.float32)), "a dense bias"),
        (dict(scale=-0.5), "a scale outside"),
        (dict(scale=0.0), "a scale outside"),
        (dict(scale=1e-39), "a scale outside"),
        (dict(scale=2.0**127), "a scale outside"),
    ],
)
def test_plain_blocker_and_explain(kw, why):
    """The static rule, and `explain` naming the kernels a call runs."""
    q = jnp.ones((1, 8, 2, 32), jnp.float32)
    kw = dict(kw)
    if "dropout_rate" in kw:
        kw["dropout_rng"] = jax.random.PRNGKey(0)
    text = str(jax_flash.explain(q, q, q, implementation="pallas", verbose=True, **kw))
    if why is None:
        assert "the plain kernels where q, k and v are finite" in text, text
    else:
        assert f"the general kernels (the call has {why}" in text, text


def test_nonfinite_inputs_run_the_general_kernels():
    """A NaN value behind a mask must not reach the rows that do not see it: the plain forward
    would multiply it by P = 0 (the general kernels' finite copy is what keeps it out)."""
    q, k, v = make_qkv(SHAPE, jnp.float32)
    v = v.at[0, SHAPE.t - 1, 0, 3].set(jnp.nan)  # key T - 1: seen by query row T - 1 only
    out = np.asarray(jax_flash.attention(q, k, v, is_causal=True, query_offset=0, implementation="pallas"))
    ref = np.asarray(jax_flash.attention(q, k, v, is_causal=True, query_offset=0, implementation="xla"))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    assert not np.isnan(out[0, : SHAPE.t - 1]).any()
