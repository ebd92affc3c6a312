"""The cuda backward's plain kernel (cuda/kernels/bwd.h, attention_backward_plain_kernel).

A backward call without per-score features (soft cap, segment ids, dropout, dense bias or mask,
block mask) that accumulates dQ with atomics runs the plain kernel where the forward's out is
finite and its lse below +inf (jax_flash/cuda.py tests that on every call): query blocks cut
into masked runs around one interior run that masks nothing, tests nothing and selects nothing
per score. It computes what the general kernel computes on the same tiles: these tests hold it
to the general kernel's bits (one query head per CTA) or rounding (a GQA group per CTA, whose
dK and dV it sums in another order), count which kernel ran and which query blocks it masked
(the host emulation's tile counter), and check the routing: a poisoned forward, a NaN or +inf
sink, a per-score feature or deterministic mode send the call to the general kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from cases import Shape, cuda_backward_target, cuda_forward_target, emulator_or_skip, make_qkv
from jax_flash import cuda
from jax_flash._spec import AttentionSpec

pytestmark = pytest.mark.skipif(
    not jax_flash.current_config().emulate_cuda, reason="counts tiles on the host emulation of the cuda kernels"
)


def _tile(h: int) -> tuple[int, int]:
    """(query rows, keys) of a main backward CTA's step at head dim h (kernels/tile.h
    TileShapeFor, kWarp16: the plain kernel's tiles)."""
    if h > 192:
        return 16, 64
    if h > 128:
        return 16, 32
    return (64, 64) if h <= 64 else (32, 64)


def _items(t, s, h, *, band=(None, None), q_valid=None, kv_valid=None):
    """(items, masked items) one query head's CTAs run over a [t, s] problem, from the dense
    visibility matrix: the query blocks that see each key block (from the first to the last
    block holding a row that sees one of its keys), and of them those where not every row of
    a whole block inside the valid rows sees every key of a whole key block inside the valid
    keys."""
    block_q, block_kv = _tile(h)
    q_valid = t if q_valid is None else q_valid
    kv_valid = s if kv_valid is None else kv_valid
    rows, cols = np.arange(t)[:, None], np.arange(s)[None, :]
    visible = (rows < q_valid) & (cols < kv_valid)
    if band[0] is not None:
        visible &= cols - rows >= band[0]
    if band[1] is not None:
        visible &= cols - rows <= band[1]
    items = masked = 0
    for s0 in range(0, s, block_kv):
        seen = np.flatnonzero(visible[:, s0 : s0 + block_kv].any(axis=1))
        if seen.size == 0:
            continue
        for qb in range(seen[0] // block_q, seen[-1] // block_q + 1):
            items += 1
            tile = visible[qb * block_q : (qb + 1) * block_q, s0 : s0 + block_kv]
            masked += int(tile.shape != (block_q, block_kv) or not tile.all())
    return items, masked


def _run(q, k, v, dout, *, plain_kernel, sinks=None, layout="warp16", q_heads_grid=False, **settings):
    """The emulated forward target, then the backward target with plain_kernel, the layout and
    the grid given: (dq, dk, dv as float32 arrays, the backward's tiles counted)."""
    out, lse = cuda_forward_target("jax_flash_emu_fwd", q, k, v, sinks=sinks, **settings)
    with cuda.count_tiles() as counts:
        grads = jax.block_until_ready(
            cuda_backward_target(
                "jax_flash_emu_bwd",
                q,
                k,
                v,
                out,
                lse,
                dout,
                plain_kernel=plain_kernel,
                layout=layout,
                q_heads_grid=q_heads_grid,
                **settings,
            )
        )
    return [np.asarray(g.astype(jnp.float32)) for g in grads], counts


def _dout(shape: Shape, dtype, seed: int = 11):
    d = jax.random.normal(jax.random.PRNGKey(seed), (shape.b, shape.t, shape.n, shape.v_h), jnp.float32) + 0.1
    return d.astype(dtype)


CASES = {
    # name: (shape, settings for _run, the band (lo, hi) of visible s - t, or None: lengths)
    "plain": (Shape(1, 65, 129, 2, 2, 64), {}, (None, None)),
    "causal": (Shape(1, 257, 257, 1, 1, 32), dict(window=(-1, 0)), (None, 0)),
    "causal_offset": (Shape(1, 97, 200, 2, 2, 128), dict(window=(-1, 0), q_offset=[103]), (None, 103)),
    "window": (Shape(1, 190, 260, 1, 1, 64), dict(window=(70, 3)), (-70, 3)),
    "lengths": (Shape(2, 130, 191, 1, 1, 64), dict(q_lengths=[130, 100], kv_lengths=[191, 65]), None),
    "sinks": (Shape(1, 64, 100, 2, 2, 96), dict(sinks=[6.0, -jnp.inf]), (None, None)),
    "gqa": (Shape(1, 80, 140, 4, 2, 64), dict(window=(-1, 0)), (None, 0)),
    "gqa_q_heads_grid": (Shape(1, 80, 140, 4, 1, 64), dict(window=(-1, 0), q_heads_grid=True), (None, 0)),
    "h256": (Shape(1, 33, 65, 1, 1, 256), dict(window=(-1, 0)), (None, 0)),
    "h192_hv128": (Shape(1, 33, 70, 2, 1, 192, hv=128), {}, (None, None)),
    "h128_hv64": (Shape(1, 70, 129, 1, 1, 128, hv=64), dict(window=(-1, 0)), (None, 0)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_plain_backward_agrees_with_general(name):
    """plain_kernel=True runs the plain kernel (every backward step counted as plain), False the
    general one (none). With one query head per CTA (MHA, the q_heads grid) the two give the same
    bits; with a GQA group per CTA the plain kernel takes the group's heads of a query block
    before the next block, so dK and dV agree within float32 rounding of their sums. The plain
    kernel masks exactly the query blocks where some row of a whole block does not see every key
    of a whole key block, whatever the layout attribute (the same bits under both)."""
    emulator_or_skip()
    shape, settings, band = CASES[name]
    dtype = jnp.bfloat16 if shape.h != 96 else jnp.float16
    q, k, v = make_qkv(shape, dtype, seed=3)
    dout = _dout(shape, dtype)
    settings = dict(settings, scale=0.3)
    grid = settings.pop("q_heads_grid", False)
    sinks = settings.pop("sinks", None)
    general, g_counts = _run(q, k, v, dout, plain_kernel=False, q_heads_grid=grid, sinks=sinks, **settings)
    plain, p_counts = _run(q, k, v, dout, plain_kernel=True, q_heads_grid=grid, sinks=sinks, **settings)
    wide, _ = _run(q, k, v, dout, plain_kernel=True, q_heads_grid=grid, sinks=sinks, layout="warp32", **settings)
    assert g_counts.backward > 0 and g_counts.backward_plain == 0
    assert p_counts.backward_plain == p_counts.backward > 0
    for x, y in zip(wide, plain):
        np.testing.assert_array_equal(x, y)
    one_head_per_cta = grid or shape.n == shape.kh
    for x, y, what in zip(plain, general, ("dq", "dk", "dv")):
        assert not np.isnan(x).any(), what
        if one_head_per_cta:
            np.testing.assert_array_equal(x, y, err_msg=what)
        else:
            np.testing.assert_allclose(x, y, rtol=2.0**-7, atol=2.0**-7 * np.abs(y).max(), err_msg=what)
    if band is not None:
        want = _items(shape.t, shape.s, shape.h, band=band)
        ctas_heads = shape.b * shape.n  # every query head's items run once, in some CTA
        assert (p_counts.backward_plain // ctas_heads, p_counts.backward_plain_masked // ctas_heads) == want


def test_plain_backward_lengths_items():
    """With lengths, the query blocks past a query length and the key blocks past a key length
    are masked (here per batch row: the counts add up over the two rows)."""
    emulator_or_skip()
    shape = Shape(2, 130, 191, 1, 1, 64)
    q, k, v = make_qkv(shape, jnp.bfloat16, seed=4)
    _, counts = _run(q, k, v, _dout(shape, jnp.bfloat16), plain_kernel=True, q_lengths=[130, 100], kv_lengths=[191, 65])
    want = [_items(130, 191, 64, q_valid=qv, kv_valid=kv) for qv, kv in ((130, 191), (100, 65))]
    assert (counts.backward_plain, counts.backward_plain_masked) == tuple(map(sum, zip(*want)))


def test_plain_backward_interior_runs_unmasked():
    """A causal call over many query blocks masks only the diagonal ones: of 8 key blocks x up
    to 8 query blocks (64 x 64 at H = 32... 64), the interior loop runs every block below each
    key block's diagonal unmasked."""
    emulator_or_skip()
    shape = Shape(1, 512, 512, 1, 1, 64)
    q, k, v = make_qkv(shape, jnp.bfloat16, seed=5)
    _, counts = _run(q, k, v, _dout(shape, jnp.bfloat16), plain_kernel=True, window=(-1, 0))
    items, masked = _items(512, 512, 64, band=(None, 0))
    assert (counts.backward_plain, counts.backward_plain_masked) == (items, masked)
    assert (items, masked) == (36, 8)  # one diagonal block per key block


def _grads(q, k, v, **kwargs):
    def loss(q, k, v):
        out = jax_flash.attention(q, k, v, implementation="cuda", **kwargs)
        return jnp.sum(out.astype(jnp.float32) * jnp.linspace(-1.0, 1.0, out.shape[-1]))

    with cuda.count_tiles() as counts:
        grads = jax.block_until_ready(jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
    return [np.asarray(g.astype(jnp.float32)) for g in grads], counts


def test_backward_routes_to_the_plain_kernel_only_when_it_may():
    """Through jax_flash.attention: finite inputs without per-score features run the plain
    backward; a NaN in q or v, an overflowing score, a NaN sink, a soft cap, segment ids or
    deterministic mode run the general one, which keeps the numerical contract (NaN exactly where
    the reference has it); either kernel matches the reference."""
    emulator_or_skip()
    shape = Shape(1, 70, 90, 2, 1, 64)
    q, k, v = make_qkv(shape, jnp.bfloat16, seed=6)
    grads, counts = _grads(q, k, v, is_causal=True)
    assert counts.backward_plain == counts.backward > 0
    ref = jax.grad(
        lambda q, k, v: jnp.sum(
            jax_flash.reference(q, k, v, is_causal=True, compute_dtype=jnp.float32) * jnp.linspace(-1.0, 1.0, 64)
        ),
        argnums=(0, 1, 2),
    )(q, k, v)
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(g, np.asarray(r, np.float32), atol=3e-2, rtol=3e-2)
    poisoned = {
        "nan_q": dict(q=q.at[0, 5, 1, 3].set(jnp.nan)),
        "nan_v": dict(v=v.at[0, 20, 0, 3].set(jnp.nan)),
        "overflow": dict(q=q.at[0, 9, 0, :].set(3e19), k=k.at[0, 2, 0, :].set(-3e19)),
    }
    for name, repl in poisoned.items():
        args = {"q": q, "k": k, "v": v, **repl}
        grads, counts = _grads(args["q"], args["k"], args["v"], is_causal=True)
        assert counts.backward > 0 and counts.backward_plain == 0, name
        # The contract: a row or key that no poison reaches stays finite, and keys before the
        # poisoned query (causal: row 5 sees keys 0..5) are the only ones it reaches.
        assert np.isnan(np.concatenate([g.ravel() for g in grads])).any(), name
        assert not np.isnan(grads[0][0, :2]).any(), name
    sinks = jnp.asarray([jnp.nan, 0.5], jnp.float32)
    grads, counts = _grads(q, k, v, is_causal=True, sinks=sinks)
    assert counts.backward > 0 and counts.backward_plain == 0
    assert np.isnan(grads[0][:, :, 0]).all() and not np.isnan(grads[0][:, :, 1]).any()
    text = str(jax_flash.explain(q, k, v, implementation="cuda", verbose=True, is_causal=True))
    assert "backward: the plain kernel" in text, text
    for kwargs, why in (
        (dict(logits_soft_cap=20.0), "a soft cap"),
        (dict(segment_ids=(jnp.zeros((1, 70), jnp.int32), jnp.zeros((1, 90), jnp.int32))), "segment ids"),
    ):
        _, counts = _grads(q, k, v, **kwargs)
        assert counts.backward > 0 and counts.backward_plain == 0, kwargs
        text = str(jax_flash.explain(q, k, v, implementation="cuda", verbose=True, **kwargs))
        assert f"backward: the general kernel (the call has {why})" in text, text
    with jax_flash.config(deterministic=True):
        _, counts = _grads(q, k, v, is_causal=True)
        text = str(jax_flash.explain(q, k, v, implementation="cuda", verbose=True, is_causal=True))
    assert counts.backward > 0 and counts.backward_plain == 0
    assert "backward: the general kernel (the call has deterministic mode)" in text, text


def test_plain_backward_at_extreme_scales():
    """Any scale: the plain kernel's arithmetic is the general kernel's (x = scale·s rounded
    once, then exp2((x − lse)·log2 e)), so at scales where the softmax is one-hot or flat the
    two still give the same bits, 0, −0.0 and negative scales included."""
    emulator_or_skip()
    shape = Shape(1, 40, 70, 1, 1, 64)
    q, k, v = make_qkv(shape, jnp.bfloat16, seed=7)
    dout = _dout(shape, jnp.bfloat16)
    for scale in (1e30, -1e30, 1e-30, 0.0, -0.0, -0.7, 3e9):
        general, _ = _run(q, k, v, dout, plain_kernel=False, window=(-1, 0), scale=scale)
        plain, counts = _run(q, k, v, dout, plain_kernel=True, window=(-1, 0), scale=scale)
        assert counts.backward_plain > 0
        for x, y in zip(plain, general):
            np.testing.assert_array_equal(x, y, err_msg=str(scale))


def test_routed_backward_runs_one_kernel():
    """A routed backward (the route operand) launches the general kernel and, with plain_kernel,
    the plain one beside it; each returns unless the route is its own: route 1 gives the plain
    kernel's bits and counts, route 2 the general kernel's, and without plain_kernel the general
    kernel serves every route (some kernel always writes the results, poisoned before)."""
    emulator_or_skip()
    shape = Shape(1, 100, 130, 2, 1, 64)
    q, k, v = make_qkv(shape, jnp.bfloat16, seed=8)
    out, lse = cuda_forward_target("jax_flash_emu_fwd", q, k, v, window=(-1, 0))
    dout = _dout(shape, jnp.bfloat16)

    def call(**kw):
        with cuda.count_tiles() as counts:
            grads = jax.block_until_ready(
                cuda_backward_target("jax_flash_emu_bwd", q, k, v, out, lse, dout, window=(-1, 0), **kw)
            )
        return [np.asarray(g.astype(jnp.float32)) for g in grads], counts

    plain, _ = call(plain_kernel=True)
    general, general_counts = call(plain_kernel=False)
    routed, counts = call(plain_kernel=True, route=1)
    assert counts.backward_plain == counts.backward == general_counts.backward
    for x, y in zip(routed, plain):
        np.testing.assert_array_equal(x, y)
    for plain_kernel, route in ((True, 2), (False, 2), (False, 1)):
        routed, counts = call(plain_kernel=plain_kernel, route=route)
        assert counts.backward_plain == 0 and counts.backward == general_counts.backward, (plain_kernel, route)
        for x, y in zip(routed, general):
            np.testing.assert_array_equal(x, y)


def test_backward_route_reads_the_forward_results():
    """cuda.backward_route: the plain kernel's route where out is finite and lse below +inf (an
    empty row's -inf is fine), the general kernel's otherwise, under jit too; none for a call
    the plain kernel does not serve."""
    emulator_or_skip()
    spec = AttentionSpec(1, 8, 8, 2, 1, 32, "bfloat16", 0.125)
    out = jnp.ones((1, 8, 2, 32), jnp.bfloat16)
    lse = jnp.zeros((1, 2, 8), jnp.float32).at[0, 1, 3].set(-jnp.inf)
    for o, l, want in (
        (out, lse, cuda.ROUTE_PLAIN),
        (out.at[0, 3, 1, 4].set(jnp.nan), lse, cuda.ROUTE_GENERAL),
        (out.at[0, 3, 1, 4].set(jnp.inf), lse, cuda.ROUTE_GENERAL),
        (out, lse.at[0, 0, 2].set(jnp.nan), cuda.ROUTE_GENERAL),
        (out, lse.at[0, 0, 2].set(jnp.inf), cuda.ROUTE_GENERAL),
    ):
        (route,) = cuda.backward_route(spec, o, l)
        assert route.tolist() == [want]
        (route,) = jax.jit(lambda o, l: cuda.backward_route(spec, o, l))(o, l)
        assert route.tolist() == [want]
