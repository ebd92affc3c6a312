"""The public contract beyond values: jax.nn parity, transformations, gradients checks,
argument validation, dispatch and explain."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_flash
from cases import Shape, make_qkv
from conftest import slow_impl
from jax_flash.reference import attention_reference

SMALL = Shape(2, 24, 40, 4, 2, 64)


def _dtype_for(impl):
    return jnp.bfloat16 if impl == "cuda" else jnp.float32


def _close(a, b, atol):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=atol, rtol=0)


# ---------------------------------------------------------------- jax.nn parity


PARITY_KWARGS = {
    "plain": lambda s: {},
    "causal": lambda s: dict(is_causal=True),
    "window": lambda s: dict(local_window_size=(5, 2)),
    "window_int": lambda s: dict(local_window_size=4),
    "lengths": lambda s: dict(
        query_seq_lengths=jnp.asarray([s.t, s.t - 7], jnp.int32),
        key_value_seq_lengths=jnp.asarray([s.s - 3, s.s], jnp.int32),
    ),
    "bias": lambda s: dict(bias=jnp.asarray(np.random.default_rng(0).normal(size=(s.b, s.n, s.t, s.s)), jnp.float32)),
    "mask": lambda s: dict(
        mask=jnp.asarray(np.random.default_rng(1).random((1, 1, s.t, s.s)) < 0.8).at[..., 0].set(True)
    ),
    "scale": lambda s: dict(scale=0.3, is_causal=True),
}


@pytest.mark.parametrize("kind", list(PARITY_KWARGS))
def test_matches_jax_nn(kind):
    """Every argument shared with jax.nn.dot_product_attention means the same thing."""
    shape = Shape(2, 37, 53, 4, 2, 32)
    q, k, v = make_qkv(shape, jnp.float32)
    kw = PARITY_KWARGS[kind](shape)  # "causal": jax.nn aligns it top-left for T != S too
    ours = jax_flash.attention(q, k, v, implementation="xla", **kw)
    theirs = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)
    _close(ours, theirs, 2e-5)

    cot = jax.random.normal(jax.random.PRNGKey(3), q.shape)
    if "query_seq_lengths" in kw:  # padded query rows: both give 0, compare the live rows
        live = (jnp.arange(shape.t)[None, :] < kw["query_seq_lengths"][:, None])[..., None, None]
        cot = jnp.where(live, cot, 0)
    loss = lambda fn, **extra: lambda q, k, v: jnp.sum(fn(q, k, v, **kw, **extra) * cot)
    g_ours = jax.grad(loss(jax_flash.attention, implementation="xla"), (0, 1, 2))(q, k, v)
    g_theirs = jax.grad(loss(jax.nn.dot_product_attention, implementation="xla"), (0, 1, 2))(q, k, v)
    for a, b in zip(g_ours, g_theirs):
        _close(a, b, 5e-5)


def test_residual_matches_jax_nn():
    q, k, v = make_qkv(Shape(1, 16, 16, 2, 2, 32), jnp.float32)
    _, lse = jax_flash.attention(q, k, v, return_residual=True, implementation="xla")
    _, lse_nn = jax.nn.dot_product_attention(q, k, v, return_residual=True)
    _close(lse, lse_nn, 1e-5)


def test_three_dim_and_extra_batch_axes(impl):
    dt = _dtype_for(impl)
    q, k, v = make_qkv(Shape(1, 20, 20, 2, 2, 64), dt)
    out3 = jax_flash.attention(q[0], k[0], v[0], is_causal=True, implementation=impl)
    out4 = jax_flash.attention(q, k, v, is_causal=True, implementation=impl)
    assert out3.shape == q.shape[1:]
    _close(out3, out4[0], 0)
    # Two leading batch axes with a per-(b1, b2) length.
    q2, k2, v2 = make_qkv(Shape(6, 20, 20, 2, 2, 64), dt)
    lens = jnp.asarray([[20, 5, 11], [1, 20, 9]], jnp.int32)
    r = lambda x: x.reshape(2, 3, *x.shape[1:])
    out5 = jax_flash.attention(r(q2), r(k2), r(v2), key_value_seq_lengths=lens, implementation=impl)
    out4 = jax_flash.attention(q2, k2, v2, key_value_seq_lengths=lens.reshape(6), implementation=impl)
    _close(out5.reshape(out4.shape), out4, 0)


# ---------------------------------------------------------------- transformations


def test_jit_vmap_checkpoint_scan(impl):
    dt = _dtype_for(impl)
    q, k, v = make_qkv(SMALL, dt)
    f = functools.partial(jax_flash.attention, is_causal=True, implementation=impl)
    base = jax.jit(f)(q, k, v)
    tol = 0 if dt == jnp.float32 else 1e-2

    # vmap over an extra leading axis (folded into one call for the compiled targets).
    stacked = jax.jit(jax.vmap(f))(q[None].repeat(3, 0), k[None].repeat(3, 0), v[None].repeat(3, 0))
    for i in range(3):
        _close(stacked[i], base, 1e-6)
    # vmap with an unbatched key/value.
    vq = jax.vmap(f, in_axes=(0, None, None))(q[None].repeat(2, 0), k, v)
    _close(vq[1], base, 1e-6)

    # The forward under jax.checkpoint inside lax.scan gives the plain call's values.
    def scanned(q, k, v):
        step = lambda c, _: (c, jax.checkpoint(f)(q, k, v))
        return jax.lax.scan(step, jnp.zeros((), jnp.float32), None, length=2)[1]

    for o in jax.jit(scanned)(q, k, v):
        _close(o, base, tol)

    # jax.checkpoint and lax.scan around it, differentiated.
    def loss(q, k, v):
        def step(c, _):
            o = jax.checkpoint(f)(q + c.astype(q.dtype), k, v)
            return c + 0.01, jnp.sum(o.astype(jnp.float32))

        _, ys = jax.lax.scan(step, jnp.zeros((), jnp.float32), None, length=2)
        return ys.sum()

    g = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
    assert all(bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))) for x in g)
    if not slow_impl(impl):
        g_ref = jax.grad(
            lambda q, k, v: sum(
                jnp.sum(attention_reference(q + c, k, v, is_causal=True).astype(jnp.float32))
                for c in (jnp.asarray(0.0, q.dtype), jnp.asarray(0.01, q.dtype))
            ),
            (0, 1, 2),
        )(q, k, v)
        for a, b in zip(g, g_ref):
            _close(a, b, 1e-4 if dt == jnp.float32 else 5e-2)


def test_grad_under_vmap(impl):
    dt = _dtype_for(impl)
    q, k, v = make_qkv(SMALL, dt)
    f = lambda q, k, v: jnp.sum(jax_flash.attention(q, k, v, implementation=impl).astype(jnp.float32))
    g_vmapped = jax.vmap(jax.grad(f, (0, 1, 2)))(q[None], k[None], v[None])
    g_plain = jax.grad(f, (0, 1, 2))(q, k, v)
    for a, b in zip(g_vmapped, g_plain):
        _close(a[0], b, 1e-6 if dt == jnp.float32 else 1e-2)


def test_check_grads(impl):
    """Numerical gradients (reverse mode): float64 where the implementation takes it."""
    if impl in ("cuda",):
        pytest.skip("cuda takes 16-bit inputs only; its gradients are checked in test_forward_backward")
    dt = jnp.float64 if impl == "xla" else jnp.float32
    q, k, v = make_qkv(Shape(1, 9, 11, 2, 1, 8), dt)
    bias = jnp.asarray(np.random.default_rng(0).normal(size=(1, 2, 9, 11)), dt)
    kw = dict(is_causal=True, logits_soft_cap=3.0, implementation=impl)
    if impl in ("xla", "pallas", "cpu"):
        f = lambda q, k, v, b: jax_flash.attention(q, k, v, b, **kw)
        args = (q, k, v, bias)
    else:
        f = lambda q, k, v: jax_flash.attention(q, k, v, **kw)
        args = (q, k, v)
    tol = dict(atol=1e-6, rtol=1e-6, eps=1e-4) if dt == jnp.float64 else dict(atol=2e-2, rtol=2e-2, eps=2e-3)
    check_grads(f, args, order=1, modes=["rev"], **tol)


def test_forward_mode_raises():
    q, k, v = make_qkv(SMALL, jnp.float32)
    with pytest.raises(TypeError, match=r"forward-mode|jvp"):
        jax.jvp(lambda q: jax_flash.attention(q, k, v, implementation="xla"), (q,), (q,))


def test_all_masked_rows_have_zero_finite_gradients(impl):
    dt = _dtype_for(impl)
    q, k, v = make_qkv(SMALL, dt)
    kw = dict(key_value_seq_lengths=jnp.asarray([0, SMALL.s], jnp.int32), implementation=impl)
    out = jax_flash.attention(q, k, v, **kw)
    assert np.all(np.asarray(out[0], np.float32) == 0)
    g = jax.grad(lambda q, k, v: jnp.sum(jax_flash.attention(q, k, v, **kw).astype(jnp.float32)), (0, 1, 2))(q, k, v)
    for x in g:
        x = np.asarray(x, np.float32)
        assert np.isfinite(x).all()
        assert np.all(x[0] == 0)


# ---------------------------------------------------------------- validation

Q = jnp.zeros((2, 8, 4, 16), jnp.float32)
KV = jnp.zeros((2, 10, 2, 16), jnp.float32)


@pytest.mark.parametrize(
    "args, kwargs, exc, match",
    [
        ((Q[0, 0], KV, KV), {}, ValueError, r"query must have rank >= 3.*\(4, 16\)"),
        ((Q, KV, KV[:, :9]), {}, ValueError, r"key .* and value .* must have the same shape except the last"),
        ((Q, KV[..., :8], KV[..., :8]), {}, ValueError, r"same head dim H"),
        ((Q[:, :, :3], KV, KV), {}, ValueError, r"N=3 must be a multiple of .* K=2"),
        ((Q, KV[:1], KV[:1]), {}, ValueError, r"same leading batch axes"),
        ((Q.astype(jnp.int32), KV, KV), {}, TypeError, r"query must be float16, bfloat16"),
        ((Q.astype(jnp.bfloat16), KV, KV), {}, TypeError, r"share one dtype"),
        ((Q, KV, KV), dict(mask=jnp.ones((8, 10), jnp.float32)), TypeError, r"mask must be a boolean"),
        (
            (Q, KV, KV),
            dict(mask=jnp.ones((3, 8, 10), bool)),
            ValueError,
            r"mask must be broadcastable .*\(2, 4, 8, 10\)",
        ),
        ((Q, KV, KV), dict(bias=jnp.ones((8, 11), jnp.float32)), ValueError, r"bias must be broadcastable"),
        ((Q, KV, KV), dict(bias=jnp.ones((8, 10), jnp.int32)), TypeError, r"bias must be a floating"),
        (
            (Q, KV, KV),
            dict(query_seq_lengths=jnp.ones((3,), jnp.int32)),
            ValueError,
            r"query_seq_lengths must have shape \(2,\)",
        ),
        (
            (Q, KV, KV),
            dict(key_value_seq_lengths=jnp.ones((2,), jnp.float32)),
            TypeError,
            r"key_value_seq_lengths must be an integer",
        ),
        (
            (Q, KV, KV),
            dict(segment_ids=jnp.ones((2, 8), jnp.int32)),
            ValueError,
            r"single segment_ids array needs self-attention",
        ),
        (
            (Q, KV, KV),
            dict(segment_ids=(jnp.ones((2, 8), jnp.int32), jnp.ones((2, 9), jnp.int32))),
            ValueError,
            r"segment_ids \(key/value\) must have shape \(2, 10\)",
        ),
        ((Q, KV, KV), dict(segment_ids=(jnp.ones((2, 8), jnp.int32),)), ValueError, r"pair"),
        ((Q, KV, KV), dict(local_window_size=(-1, 2)), ValueError, r"local_window_size must be non-negative"),
        ((Q, KV, KV), dict(local_window_size=(1, 2, 3)), ValueError, r"local_window_size must be an int"),
        ((Q, KV, KV), dict(local_window_size=2.5), ValueError, r"local_window_size must be an int"),
        ((Q, KV, KV), dict(logits_soft_cap=-1.0), ValueError, r"logits_soft_cap must be a positive"),
        ((Q, KV, KV), dict(logits_soft_cap="x"), TypeError, r"logits_soft_cap must be a Python float"),
        ((Q, KV, KV), dict(scale=jnp.float32(2.0)), TypeError, r"scale must be a Python float"),
        ((Q, KV, KV), dict(scale=math.inf), ValueError, r"scale must be finite"),
        ((Q, KV, KV), dict(is_causal=1), TypeError, r"is_causal must be a Python bool"),
        ((Q, KV, KV), dict(implementation="triton"), ValueError, r"implementation must be None or one of"),
        ((Q, KV, KV), dict(query_offset=1.5), TypeError, r"query_offset must be an int or an integer array"),
        ((Q, KV, KV), dict(query_offset=True), TypeError, r"query_offset must be an int or an integer array"),
        (
            (Q, KV, KV),
            dict(query_offset=jnp.ones((2,), jnp.float32)),
            TypeError,
            r"query_offset must be an int or an integer array",
        ),
        (
            (Q, KV, KV),
            dict(query_offset=jnp.ones((3,), jnp.int32)),
            ValueError,
            r"query_offset must be an int or an integer array broadcastable to \[\*B\] = \(2,\)",
        ),
        ((Q, KV, KV), dict(query_offset=jnp.ones((2, 8), jnp.int32)), ValueError, r"query_offset .*broadcastable"),
        ((Q, KV, KV), dict(query_offset=2**31), ValueError, r"query_offset must fit in int32"),
        ((Q, KV, KV), dict(query_offset=np.asarray([0, 2**40])), ValueError, r"query_offset must fit in int32"),
    ],
)
def test_validation_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        jax_flash.attention(*args, **kwargs)
    # Raised at trace time, before anything runs.
    with pytest.raises(exc, match=match):
        jax.jit(lambda *a: jax_flash.attention(*a, **kwargs)).trace(*args)


def test_query_offset_forms():
    """An int, a scalar array, [*B] and broadcastable [*B] arrays all mean one offset per
    batch row; 3-D inputs take an int or a one-element array."""
    q, k, v = make_qkv(Shape(6, 9, 14, 2, 1, 16), jnp.float32)
    r = lambda x: x.reshape(2, 3, *x.shape[1:])
    kw = dict(is_causal=True, implementation="xla")
    per_row = jax_flash.attention(q, k, v, query_offset=jnp.asarray([5, 5, -2, 5, 9, 5]), **kw)
    grid = jax_flash.attention(r(q), r(k), r(v), query_offset=jnp.asarray([[5, 5, -2], [5, 9, 5]], jnp.int16), **kw)
    _close(grid.reshape(per_row.shape), per_row, 1e-6)
    same = jax_flash.attention(r(q), r(k), r(v), query_offset=5, **kw)
    for offset in (jnp.asarray(5), jnp.asarray([5, 5, 5]), jnp.asarray([[5], [5]])):
        _close(jax_flash.attention(r(q), r(k), r(v), query_offset=offset, **kw), same, 1e-6)
    assert not np.allclose(np.asarray(per_row[2]), np.asarray(same.reshape(per_row.shape)[2]))
    three = jax_flash.attention(q[0], k[0], v[0], query_offset=jnp.asarray([5]), **kw)
    _close(three, same.reshape(per_row.shape)[0], 1e-6)
    # Traced offsets (a decode loop's step counter) under jit.
    step = jax.jit(lambda o: jax_flash.attention(r(q), r(k), r(v), query_offset=o, **kw))
    _close(step(jnp.int32(5)), same, 1e-6)


def test_requested_implementation_never_falls_back():
    q = jnp.zeros((1, 8, 2, 64), jnp.float64)
    with pytest.raises(ValueError, match=r'implementation="cuda" cannot run this call: .*'):
        jax_flash.attention(q, q, q, implementation="cuda")


def test_explain_names_every_implementation():
    q = jnp.zeros((1, 8, 2, 64), jnp.float32)
    e = jax_flash.explain(q, q, q)
    assert set(e.reasons) == {"xla", "cpu", "pallas", "cuda"}
    assert e.selected is not None and e.reasons[e.selected] is None
    text = str(e)
    for name in e.reasons:
        assert name in text
    # A dense bias: the cpu kernels take it (and are chosen on a CPU), as xla does.
    with_bias = jax_flash.explain(q, q, q, bias=jnp.zeros((8, 8)))
    if e.reasons["cpu"] is None:
        assert with_bias.reasons["cpu"] is None and with_bias.selected == "cpu"
    assert with_bias.reasons["xla"] is None


def _plain_and_verbose(e, verbose):
    """explain's printed forms: one line per implementation, plain; verbose adds the notes."""
    lines = str(e).splitlines()
    assert len(lines) == 1 + len(e.reasons), lines
    assert lines[0] == f"{e.op} would run: {e.selected or 'nothing'}"
    for line, (name, why) in zip(lines[1:], e.reasons.items()):
        mark = "*" if name == e.selected else " "
        if why is not None:
            assert line == f" {mark} {name:8s} unavailable: {why}", line
        else:
            assert line.startswith(f" {mark} {name:8s} available"), line
            assert e.summaries.get(name, "") in line and len(line) < 200, line
    for name, note in e.notes.items():
        assert note not in str(e) and f"details: {note}" in str(verbose), name
    assert [l for l in str(verbose).splitlines() if "details: " not in l] == lines


def test_explain_one_plain_line_per_implementation():
    """`explain` prints one plain line per implementation (how it would run, or why not);
    verbose=True adds the rule behind each available one (its notes), and nothing else."""
    for q, k in (
        (jnp.zeros((1, 128, 4, 64), jnp.float32), jnp.zeros((1, 128, 2, 64), jnp.float32)),
        (jnp.zeros((1, 1, 8, 64), jnp.float32), jnp.zeros((1, 4096, 2, 64), jnp.float32)),
    ):
        kw = dict(is_causal=True, query_offset=k.shape[1] - q.shape[1])
        e = jax_flash.explain(q, k, k, **kw)
        assert not e.verbose and jax_flash.explain(q, k, k, verbose=True, **kw).verbose
        assert e.summaries and all(e.reasons[n] is None for n in e.summaries)
        _plain_and_verbose(e, jax_flash.explain(q, k, k, verbose=True, **kw))
    pages = jnp.zeros((8, 16, 2, 64), jnp.float32)
    table = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)
    args = (jnp.zeros((2, 1, 4, 64), jnp.float32), pages, pages, table, jnp.array([20, 64], jnp.int32))
    e = jax_flash.explain_paged(*args)
    assert e.summaries and e.op == "jax_flash.paged_attention"
    _plain_and_verbose(e, jax_flash.explain_paged(*args, verbose=True))


def test_explain_names_the_cpu_isa():
    """verbose=True names the ISA the cpu kernels will run: this CPU's default, or the one set."""
    from jax_flash import _jax_flash_ext

    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    e = jax_flash.explain(q, q, q)
    if e.reasons["cpu"] is not None:
        pytest.skip(f"cpu cannot run here: {e.reasons['cpu']}")
    assert f"ISA {_jax_flash_ext.cpu_isa('')} (this CPU's default" in e.notes["cpu"]
    with jax_flash.config(cpu_isa="generic"):
        assert "ISA generic (set by cpu_isa)" in jax_flash.explain(q, q, q).notes["cpu"]


def test_explain_says_pallas_is_interpreted_on_a_cpu():
    if jax.default_backend() != "cpu":
        pytest.skip("CPU backend only")
    q = jnp.zeros((1, 8, 2, 64), jnp.float32)
    e = jax_flash.explain(q, q, q)
    if e.reasons["pallas"] is not None:
        pytest.skip(f"pallas cannot run here: {e.reasons['pallas']}")
    assert "interpreted (slow)" in e.notes["pallas"]
    line = next(l for l in str(e).splitlines() if "pallas" in l)
    assert "available: interpreted on the CPU (slow, for tests)" in line
    verbose = str(jax_flash.explain(q, q, q, verbose=True))
    assert f"details: {e.notes['pallas']}" in verbose


def test_value_head_dim_explained_and_scaled_by_h():
    """Hv != H: `explain` states the (H, Hv) pairs of every implementation that serves the
    call, and why the others do not; the default scale is 1/sqrt(H), not 1/sqrt(Hv)."""
    q, k, _ = make_qkv(Shape(1, 10, 12, 2, 1, 192), jnp.float32)
    v = make_qkv(Shape(1, 10, 12, 2, 1, 128), jnp.float32, seed=1)[2]
    e = jax_flash.explain(q, k, v)
    for name, why in e.reasons.items():
        if why is None:
            assert "(H, Hv) served: " in e.notes[name], (name, e.notes.get(name))
    assert "(H, Hv) served: any pair" in e.notes["xla"]
    if e.reasons["cuda"] is not None and "value head dim" in e.reasons["cuda"]:
        assert "got H = 192, Hv = 128" in e.reasons["cuda"]
    same = jax_flash.explain(q, k, k)
    assert all("(H, Hv)" not in note for note in same.notes.values())
    out = jax_flash.attention(q, k, v, implementation="xla")
    assert out.shape == (1, 10, 2, 128)
    _close(out, jax_flash.attention(q, k, v, scale=192**-0.5, implementation="xla"), 0)
    assert not np.allclose(out, jax_flash.attention(q, k, v, scale=128**-0.5, implementation="xla"))


def test_default_choice_on_cpu():
    if jax.default_backend() != "cpu":
        pytest.skip("CPU backend only")
    q = jnp.zeros((1, 8, 2, 64), jnp.float32)
    e = jax_flash.explain(q, q, q)
    assert e.selected == ("cpu" if e.reasons["cpu"] is None else "xla")


def test_cuda_head_dims_match_the_instantiations():
    """jax_flash.cuda.HEAD_DIMS lists exactly the head dims with generated kernel files."""
    import pathlib
    import re

    from jax_flash import cuda

    root = pathlib.Path(__file__).resolve().parents[2] / "cuda" / "kernels"
    built = {int(m.group(1)) for f in root.glob("*.cu") if (m := re.search(r"hdim(\d+)\.cu$", f.name))}
    assert built == set(cuda.HEAD_DIMS)


def test_export_disabled_checks_name_every_target():
    """export_disabled_checks() covers every FFI target the extension modules register (a
    paged program exports too), and importing jax_flash registered them."""
    from jax_flash import _ffi
    from jax_flash._export import FFI_TARGETS

    registered = set().union(*_ffi.targets().values()) if _ffi.targets() else set()
    if not registered:
        pytest.skip("the extension is not built")
    assert registered <= set(FFI_TARGETS), registered - set(FFI_TARGETS)
    assert len(jax_flash.export_disabled_checks()) == len(FFI_TARGETS)


@pytest.mark.parametrize("impl", ["cpu", "cuda", "xla"])
def test_jax_export_round_trip(impl):
    """jax.export of a forward and a gradient through the compiled custom calls: refused
    without jax_flash.export_disabled_checks() (the targets carry no compatibility
    guarantee), exact after a serialize / deserialize round trip with them."""
    from jax import export

    dtype = jnp.bfloat16 if impl == "cuda" else jnp.float32
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 24, 2, 32), dtype) for i in range(3))
    why = jax_flash.explain(q, k, v, implementation=impl).reasons[impl]
    if why is not None:
        pytest.skip(f"{impl} cannot run here: {why}")
    # The same program twice: bitwise, except the emulated CUDA backward's atomic dQ order.
    tol = 1e-2 if impl == "cuda" else 0.0
    f = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True, implementation=impl))
    g = jax.jit(jax.grad(lambda q, k, v: (f(q, k, v) ** 2).sum(), argnums=(0, 1, 2)))
    if impl != "xla":
        with pytest.raises(ValueError, match="custom calls"):
            export.export(f)(q, k, v)
    for fn in (f, g):
        exported = export.export(fn, disabled_checks=jax_flash.export_disabled_checks())(q, k, v)
        loaded = export.deserialize(exported.serialize())
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(
                np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol
            ),
            loaded.call(q, k, v),
            fn(q, k, v),
        )
