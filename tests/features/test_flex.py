"""flex_attention: score_mod, mask_mod and block masks (docs/flex.md), on xla and pallas
(everything) and the compiled kernels, cpu and cuda (emulated on the host here: mask_mod and
block masks; a score_mod is refused).

The built-in masks re-expressed as mask_mods give bitwise the built-in path's results where
the same tiles run in the same order (xla at the block mask's tiles; cpu and cuda at their own
tiles, whatever the block size); the recipes (ALiBi, a T5 bucket table, the soft cap, a
per-head scale; per-document causal, prefix-LM, dilated, block-sparse, a speculative tree)
match the float64 reference within the reference's own error at the input dtype, gradients
included (closed-over float arrays too); the numerical contract holds; the tiles run follow
the block mask; a cpu or cuda call with more partly visible blocks than the block mask's capacity
gives NaN rows, never a wrong result; bad arguments are refused clearly. Shapes are ragged
against the tiles (±1)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.test_util import check_grads

import jax_flash
from cases import EPS, FACTOR, GRAD_EPS, Shape, make_qkv, max_err
from conftest import availability
from jax_flash import pallas, xla
from jax_flash._flex_api import canonicalize_flex
from jax_flash._normalize import canonicalize

# Block size of the block masks below: T and S are ±1 around multiples of it. On a GPU the
# pallas kernels run the blocks as Triton tiles, which must be powers of two >= 16.
BS = 16 if jax.default_backend() == "gpu" else 8
SHAPE = Shape(2, 2 * BS + 1, 3 * BS - 1, 4, 2, 16)  # T = 17, S = 23, GQA 4:2


def _inputs(shape=SHAPE, dtype=jnp.float32, seed=0):
    return make_qkv(shape, dtype, seed)


def _available(name: str) -> str:
    why = availability(name)
    if why is not None:
        pytest.skip(f"{name} unavailable here: {why}")
    return name


# The implementations that serve flex_attention with score_mods (cpu serves mask_mods only:
# its tests are below), and those that serve mask_mods.
FLEX_IMPLEMENTATIONS = ("xla", "pallas")
MASK_IMPLEMENTATIONS = ("xla", "pallas", "cpu")


@pytest.fixture(params=FLEX_IMPLEMENTATIONS)
def flex_impl(request):
    return _available(request.param)


@pytest.fixture(params=MASK_IMPLEMENTATIONS)
def mask_impl(request):
    return _available(request.param)


CPU_TILE = 128  # the cpu kernels' tiles (cuda/cpu/tiling.h kBlockQ, kBlockK)
# The cuda kernels' tiles at head dim 32 (cuda/kernels/tile.h, warp16): the forward's 128 x 64,
# the backward's and the dQ kernel's 64 x 64; their inputs are 16-bit, their head dims >= 32.
CUDA_FORWARD_TILE, CUDA_BACKWARD_TILE = (128, 64), (64, 64)
# A shape of several cuda tiles each way, ragged (±1), GQA 2:1, and a block size of 32.
CUDA_SHAPE, CUDA_BS = Shape(1, 2 * 128 + 1, 3 * 64 - 1, 2, 1, 32), 32

# A shape of several cpu tiles each way, ragged (±1), GQA 2:1, and its block size.
CPU_SHAPE, CPU_BS = Shape(1, 2 * CPU_TILE + 1, 3 * CPU_TILE - 1, 2, 1, 16), 64


def _kernel_case(name: str, shape: Shape, dtype="float32") -> tuple[Shape, str]:
    """(shape, dtype) of a test for implementation `name`: the cuda kernels take 16-bit inputs
    (bfloat16 for a float32 test) and head dims >= 32."""
    if name != "cuda":
        return shape, dtype
    return dataclasses.replace(shape, h=max(shape.h, 32)), "bfloat16" if dtype == "float32" else dtype


# ---- the built-in masks as mask_mods --------------------------------------------------------


def _builtin(kind: str, shape: Shape):
    """(attention kwargs, the same mask as a mask_mod)."""
    rng = np.random.default_rng(5)
    b, t, s = shape.b, shape.t, shape.s
    if kind == "causal":
        return dict(is_causal=True), lambda b, h, qi, ki: ki <= qi
    if kind == "offset_window":  # bottom-right aligned, one offset per batch row
        offs = jnp.asarray([s - t, -3][:b], jnp.int32)

        def mask_mod(b, h, qi, ki):
            d = ki - (qi + offs[b])
            return (d >= -5) & (d <= 2)

        return dict(local_window_size=(5, 2), query_offset=offs), mask_mod
    if kind == "lengths":
        ql = jnp.asarray([t - 4, t][:b], jnp.int32)
        kl = jnp.asarray([s, BS + 1][:b], jnp.int32)
        kw = dict(query_seq_lengths=ql, key_value_seq_lengths=kl)
        return kw, lambda b, h, qi, ki: (qi < ql[b]) & (ki < kl[b])
    if kind == "segments":
        qs = jnp.asarray(np.sort(rng.integers(0, 4, size=(b, t)), axis=1), jnp.int32)
        ks = jnp.asarray(np.sort(rng.integers(0, 3, size=(b, s)), axis=1), jnp.int32)
        return dict(segment_ids=(qs, ks)), lambda b, h, qi, ki: qs[b, qi] == ks[b, ki]
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["causal", "offset_window", "lengths", "segments"])
def test_builtin_masks_bitwise(kind):
    """Same tiles (BS × BS), same order: out, lse and dq, dk, dv equal bitwise to the built-in
    path's on xla (its forward and backward run at the block mask's tile size)."""
    q, k, v = _inputs()
    kw, mask_mod = _builtin(kind, SHAPE)
    block_mask = jax_flash.create_block_mask(mask_mod, SHAPE.b, None, SHAPE.t, SHAPE.s, block_size=BS)

    @jax.jit
    def both(q, k, v, dout):
        c = canonicalize(q, k, v, **kw)
        f = canonicalize_flex(q, k, v, mask_mod=mask_mod, block_mask=block_mask)
        results = []
        for x, blocks in ((c, dict(block_q=BS, block_k=BS)), (f, {})):
            out, lse = xla.forward(x.spec, x.q, x.k, x.v, x.masks, **blocks)
            grads = xla.backward(x.spec, x.q, x.k, x.v, x.masks, out, lse, dout, jnp.zeros_like(lse), **blocks)
            results.append((out, lse, *grads[:3]))
        return results

    dout = jax.random.normal(jax.random.PRNGKey(9), (SHAPE.b, SHAPE.t, SHAPE.n, SHAPE.h), jnp.float32)
    built, flex = both(q, k, v, dout)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), built, flex):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f"{kind}: {name}")


@pytest.mark.parametrize("kind", ["causal", "offset_window", "lengths", "segments"])
def test_builtin_masks_pallas(kind):
    """pallas: the mask_mod with its block mask (tiles BS × BS) against the built-in mask at the
    same tiles, within float32 rounding: the two kernels are different programs (loops over
    the block lists, or over index ranges), which the compiler may fuse differently, so that
    even where the same tiles run in the same order (causal) the last bits can differ."""
    if availability("pallas") is not None:
        pytest.skip(f"pallas unavailable here: {availability('pallas')}")
    from jax_flash.pallas._table import Config

    q, k, v = _inputs()
    kw, mask_mod = _builtin(kind, SHAPE)
    block_mask = jax_flash.create_block_mask(mask_mod, SHAPE.b, None, SHAPE.t, SHAPE.s, block_size=BS)
    tiles = Config(block_q=BS, block_k=BS, num_warps=4, num_stages=1)
    configs = {"fwd": tiles, "dkdv": tiles, "dq": tiles}

    @jax.jit
    def both(q, k, v, dout):
        c = canonicalize(q, k, v, **kw)
        f = canonicalize_flex(q, k, v, mask_mod=mask_mod, block_mask=block_mask)
        results = []
        for x in (c, f):
            out, lse = pallas.forward(x.spec, x.q, x.k, x.v, x.masks, configs=configs)
            grads = pallas.backward(
                x.spec, x.q, x.k, x.v, x.masks, out, lse, dout, jnp.zeros_like(lse), configs=configs
            )
            results.append((out, lse, *grads[:3]))
        return results

    dout = jax.random.normal(jax.random.PRNGKey(9), (SHAPE.b, SHAPE.t, SHAPE.n, SHAPE.h), jnp.float32)
    built, flex = both(q, k, v, dout)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), built, flex):
        np.testing.assert_array_equal(np.isfinite(b), np.isfinite(a), err_msg=f"{kind}: {name}")
        fin = np.isfinite(np.asarray(a))
        scale = max(1.0, float(np.max(np.abs(np.asarray(a)[fin]), initial=0)))
        assert max_err(np.asarray(b)[fin], np.asarray(a)[fin]) <= 4e-6 * scale, f"{kind}: {name}"


def _builtin_and_flex(kind, name, shape, dtype, block_size, scale=None):
    """(out, lse, dq, dk, dv) of the built-in mask `kind` and of the same mask as a mask_mod
    with its block mask (block_size), on implementation `name`, under one jit."""
    q, k, v = _inputs(shape, dtype)
    kw, mask_mod = _builtin(kind, shape)
    kw = dict(kw, scale=scale)
    block_mask = jax_flash.create_block_mask(mask_mod, shape.b, None, shape.t, shape.s, block_size=block_size)
    dout = jax.random.normal(jax.random.PRNGKey(9), (shape.b, shape.t, shape.n, shape.h), jnp.float32).astype(dtype)
    dlse = jax.random.normal(jax.random.PRNGKey(8), (shape.b, shape.t, shape.n), jnp.float32)

    def grads(fn):
        (out, lse), pull = jax.vjp(fn, q, k, v)
        return out, lse, *pull((dout, jnp.where(jnp.isfinite(lse), dlse, 0)))

    return jax.jit(
        lambda: (
            grads(lambda q, k, v: jax_flash.attention(q, k, v, return_residual=True, implementation=name, **kw)),
            grads(
                lambda q, k, v: jax_flash.flex_attention(
                    q,
                    k,
                    v,
                    mask_mod=mask_mod,
                    block_mask=block_mask,
                    scale=scale,
                    return_residual=True,
                    implementation=name,
                )
            ),
        )
    )()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("big", [False, True], ids=["one_tile", "tiles"])
@pytest.mark.parametrize("kind", ["causal", "offset_window", "lengths", "segments"])
def test_builtin_masks_bitwise_cpu(kind, big, dtype):
    """cpu: out, lse and dq, dk, dv of the mask_mod with its block mask equal bitwise those of
    the built-in mask: the kernels run the same 128 x 128 tiles in the same order (a tile is
    skipped when all its blocks are empty, as the built-in geometry skips it; one that
    overlaps partly visible blocks is masked element by element from mask_mod's bits, which
    leaves every visible score as it was), for a block mask of one tile (8 x 8 blocks) and of
    several tiles (64 x 64 blocks). One exception: with query lengths the built-in backward
    clips a tile's rows at the length, which changes the blocking of the bf16 products' sums
    over the rows (dK, a last bit in 2 of 6128 elements here), so `lengths` over several tiles
    in bfloat16 is compared within the suite's tolerance instead."""
    _available("cpu")
    shape, bs = (CPU_SHAPE, CPU_BS) if big else (SHAPE, BS)
    built, flex = _builtin_and_flex(kind, "cpu", shape, jnp.dtype(dtype), bs)
    for i, (name, a, b) in enumerate(zip(("out", "lse", "dq", "dk", "dv"), built, flex)):
        if kind == "lengths" and big and dtype == "bfloat16":
            np.testing.assert_array_equal(np.isfinite(b), np.isfinite(a))
            ok = np.isfinite(np.asarray(a, np.float32))
            a, b = np.asarray(a, np.float32)[ok], np.asarray(b, np.float32)[ok]
            scale = max(1.0, float(np.max(np.abs(a), initial=0)))
            assert max_err(b, a) <= (EPS if i < 2 else GRAD_EPS)[dtype] * scale, f"{kind}: {name}"
        else:
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f"{kind}: {name}")


@pytest.mark.parametrize("kind", ["causal", "offset_window", "lengths", "segments"])
def test_builtin_masks_bitwise_cuda(kind):
    """cuda (the kernels on their host emulation): out, lse and dq, dk, dv of the mask_mod with
    its block mask (32 x 32 blocks, several per tile) equal bitwise those of the built-in mask:
    each kernel runs the same tiles in the same order (a tile is skipped when all its blocks
    are empty, as the built-in geometry skips it; a fragment under partly visible blocks is
    masked element by element from mask_mod's bits, which leaves every visible score as it
    was, and a warp whose rows see none of a tile adds exact zeros). The built-in masks run the
    plain forward kernel, whose softmax works on raw scores, and the block mask the general
    one, on logits scale·s: at a scale that is a power of two (1/8 here) the two round the
    same, so the forwards agree bit for bit too (at other scales within rounding:
    tests/internals/test_cuda_plain.py)."""
    _available("cuda")
    built, flex = _builtin_and_flex(kind, "cuda", CUDA_SHAPE, jnp.bfloat16, CUDA_BS, scale=0.125)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), built, flex):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f"{kind}: {name}")


# ---- recipes against the float64 reference --------------------------------------------------


def _t5_bucket(rel):
    """T5's bidirectional relative-position bucket of rel = kv_idx - q_idx (8 buckets up to
    distance 16): exact below 2, logarithmic above, one half per direction."""
    half, exact, far = 4, 2, 16
    n = jnp.abs(rel)
    log_part = jnp.log(jnp.maximum(n, 1) / exact) / np.log(far / exact) * (half - exact)
    large = jnp.minimum(exact + log_part.astype(jnp.int32), half - 1)
    return jnp.where(rel > 0, half, 0) + jnp.where(n < exact, n, large)


def _score_mod(name: str, params):
    if name == "alibi":
        return lambda s, b, h, qi, ki: s - params["slopes"][h] * jnp.abs(qi - ki)
    if name == "t5":
        return lambda s, b, h, qi, ki: s + params["table"][h, _t5_bucket(ki - qi)]
    if name == "softcap":
        return lambda s, b, h, qi, ki: params["cap"][0] * jnp.tanh(s / params["cap"][0])
    if name == "head_scale":
        return lambda s, b, h, qi, ki: s * params["head_scale"][h]
    return None


def _mask_mod(name: str, shape: Shape):
    rng = np.random.default_rng(11)
    b, t, s, n = shape.b, shape.t, shape.s, shape.n
    if name == "doc_causal":  # packed documents, causal inside each
        docs = jnp.asarray(np.sort(rng.integers(0, 3, size=(b, max(t, s))), axis=1), jnp.int32)
        return lambda b, h, qi, ki: (docs[b, qi] == docs[b, ki]) & (ki <= qi)
    if name == "prefix_lm":  # bidirectional over a per-row prefix, causal after it
        prefix = jnp.asarray([5, 12][:b], jnp.int32)
        return lambda b, h, qi, ki: (ki <= qi) | (ki < prefix[b])
    if name == "dilated":  # every other key, causal
        return lambda b, h, qi, ki: (ki <= qi) & ((qi - ki) % 2 == 0)
    if name == "block_sparse":  # a random pattern of BS × BS blocks per (b, h)
        nq, nk = -(-t // BS), -(-s // BS)
        table = rng.random(size=(b, n, nq, nk)) < 0.5
        table[0, 0, 0, :] = False  # the first rows of one head see nothing
        table = jnp.asarray(table)
        return lambda b, h, qi, ki: table[b, h, qi // BS, ki // BS]
    if name == "tree":  # speculative decoding: a prefix of S - T keys, then T draft tokens
        parent = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
        anc = np.eye(t, dtype=bool)
        for i in range(1, t):
            anc[i] |= anc[parent[i]]
        anc = jnp.asarray(anc)
        prefix = s - t
        return lambda b, h, qi, ki: (ki < prefix) | anc[qi, jnp.clip(ki - prefix, 0, t - 1)]
    return None


def _params(n: int, dtype=jnp.float32):
    rng = np.random.default_rng(2)
    return dict(
        slopes=jnp.asarray(2.0 ** -np.arange(1, n + 1), dtype),
        table=jnp.asarray(rng.normal(size=(n, 8)), dtype),
        cap=jnp.asarray([2.0], dtype),
        head_scale=jnp.asarray(rng.uniform(0.5, 1.5, size=n), dtype),
    )


# One recipe per query head (head h: score_mod SCORES[h], mask_mod MASKS[h]), so that one
# compiled call covers them all (the tree: T draft tokens after a prefix of S - T keys).
SCORES = ("alibi", "t5", "softcap", "head_scale", None)
MASKS = ("doc_causal", "prefix_lm", "dilated", "block_sparse", "tree")


def _per_head(fns):
    def fn(*args):
        h = args[-3]  # (score,) b, h, q_idx, kv_idx
        out = fns[-1](*args)
        for i in range(len(fns) - 2, -1, -1):
            out = jnp.where(h == i, fns[i](*args), out)
        return out

    return fn


@pytest.mark.parametrize("with_block_mask", [True, False], ids=["block_mask", "no_block_mask"])
def test_recipes_against_reference(flex_impl, with_block_mask):
    """out, lse and the gradients in q, k, v and the score_mods' closed-over floats: err
    against float64 <= 2 × the float32 reference's own + eps, per head (= per recipe); the
    per-head block mask has empty blocks, which are skipped; without it every block evaluates
    mask_mod."""
    shape = Shape(2, 2 * BS + 1, 3 * BS - 1, len(MASKS), 1, 16)  # GQA: 5 query heads, 1 kv head
    mask_mod = _per_head([_mask_mod(m, shape) for m in MASKS])
    names = [f"{sc} + {m}" for sc, m in zip(SCORES, MASKS)]
    q, k, v = _inputs(shape)
    bm = jax_flash.create_block_mask(mask_mod, shape.b, shape.n, shape.t, shape.s, block_size=BS)
    flex_kw = dict(block_mask=bm if with_block_mask else None, implementation=flex_impl)
    dout = jax.random.normal(jax.random.PRNGKey(4), (shape.b, shape.t, shape.n, shape.h), jnp.float32)
    dlse = jax.random.normal(jax.random.PRNGKey(5), (shape.b, shape.t, shape.n), jnp.float32)

    def run(fn, params, q, k, v, **kw):
        def f(q, k, v, params):
            score_mod = _per_head([_score_mod(sc, params) or (lambda s, b, h, qi, ki: s) for sc in SCORES])
            return fn(q, k, v, score_mod=score_mod, mask_mod=mask_mod, return_residual=True, **kw)

        (out, lse), pull = jax.vjp(f, q, k, v, params)
        lse_ct = jnp.where(jnp.isfinite(lse), dlse.astype(lse.dtype), 0)
        return out, lse, pull((dout.astype(out.dtype), lse_ct))

    p32 = _params(shape.n)
    p64 = jax.tree.map(lambda x: x.astype(jnp.float64), p32)
    got = jax.jit(lambda p, q, k, v: run(jax_flash.flex_attention, p, q, k, v, **flex_kw))(p32, q, k, v)
    q64, k64, v64 = (x.astype(jnp.float64) for x in (q, k, v))
    low, ref = jax.jit(
        lambda p32, p64, q, k, v, q64, k64, v64: (
            run(jax_flash.flex_reference, p32, q, k, v),
            run(jax_flash.flex_reference, p64, q64, k64, v64),
        )
    )(p32, p64, q, k, v, q64, k64, v64)
    # out, lse, dq per query head (one recipe each); dk, dv of the kv head they all share.
    results = {"out": 2, "lse": 2, "dq": 2}
    for h in range(shape.n):
        for i, (name, axis) in enumerate(results.items()):
            a, lo, r = (np.take(np.asarray(x[i] if i < 2 else x[2][0]), h, axis=axis) for x in (got, low, ref))
            eps = (EPS if i < 2 else GRAD_EPS)["float32"] * max(
                1.0, float(np.max(np.abs(r[np.isfinite(r)]), initial=0))
            )
            assert max_err(a, r) <= FACTOR * max_err(lo, r) + eps, f"{names[h]}: {name}"
    for i, name in ((1, "dk"), (2, "dv")):
        a, lo, r = got[2][i], low[2][i], ref[2][i]
        assert max_err(a, r) <= FACTOR * max_err(lo, r) + GRAD_EPS["float32"] * float(jnp.max(jnp.abs(r))), name
    for sc, name in zip(SCORES, ("slopes", "table", "cap", "head_scale")):
        a, lo, r = got[2][3][name], low[2][3][name], ref[2][3][name]
        assert float(jnp.max(jnp.abs(r))) > 0, f"{sc}: its closed-over array has a gradient"
        assert max_err(a, r) <= FACTOR * max_err(lo, r) + GRAD_EPS["float32"] * float(jnp.max(jnp.abs(r))), sc
    assert int(bm.num_nonempty()) < shape.b * shape.n * bm.shape[2] * bm.shape[3], "the mask has empty blocks"


@pytest.mark.parametrize(
    "name, dtype, with_block_mask",
    [
        ("cpu", "float32", True),
        ("cpu", "bfloat16", True),
        ("cpu", "float32", False),
        ("xla", "bfloat16", True),
        ("cuda", "bfloat16", True),
        ("cuda", "float16", False),
    ],
)
def test_mask_recipes_against_reference(name, dtype, with_block_mask):
    """The recipes' mask_mods alone (the implementations without score_mods run them too):
    out, lse and the gradients in q, k, v against float64, err <= 2 x the reference's own at
    the input dtype + eps, per head (= per recipe); with a per-(b, h) block mask (empty blocks
    skipped, capacity exact) or without one (cpu, cuda: every block partly visible)."""
    _available(name)
    shape, _ = _kernel_case(name, Shape(2, 2 * BS + 1, 3 * BS - 1, len(MASKS), 1, 16))
    mask_mod = _per_head([_mask_mod(m, shape) for m in MASKS])
    dt = jnp.dtype(dtype)
    q, k, v = _inputs(shape, dt)
    bm = jax_flash.create_block_mask(mask_mod, shape.b, shape.n, shape.t, shape.s, block_size=BS)
    assert bm.partial_capacity == int(bm.num_partial()), "created eagerly: the exact count"
    kw = dict(block_mask=bm) if with_block_mask else {}
    dout = jax.random.normal(jax.random.PRNGKey(4), (shape.b, shape.t, shape.n, shape.h), jnp.float32)
    dlse = jax.random.normal(jax.random.PRNGKey(5), (shape.b, shape.t, shape.n), jnp.float32)

    def run(fn, q, k, v, **kw):
        (out, lse), pull = jax.vjp(lambda q, k, v: fn(q, k, v, mask_mod=mask_mod, return_residual=True, **kw), q, k, v)
        lse_ct = jnp.where(jnp.isfinite(lse), dlse.astype(lse.dtype), 0)
        return out, lse, *pull((dout.astype(out.dtype), lse_ct))

    got = jax.jit(lambda q, k, v: run(jax_flash.flex_attention, q, k, v, implementation=name, **kw))(q, k, v)
    q64, k64, v64 = (x.astype(jnp.float64) for x in (q, k, v))
    low, ref = jax.jit(
        lambda q, k, v, q64, k64, v64: (
            run(jax_flash.flex_reference, q, k, v),
            run(jax_flash.flex_reference, q64, k64, v64),
        )
    )(q, k, v, q64, k64, v64)
    for i, what in enumerate(("out", "lse", "dq", "dk", "dv")):
        axis = {"out": 2, "lse": 2, "dq": 2}.get(what)
        heads = range(shape.n) if axis is not None else [None]
        for h in heads:
            a, lo, r = (np.asarray(jnp.asarray(x[i], jnp.float64)) for x in (got, low, ref))
            if h is not None:
                a, lo, r = (np.take(x, h, axis=axis) for x in (a, lo, r))
            eps = (EPS if i < 2 else GRAD_EPS)[dtype] * max(1.0, float(np.max(np.abs(r[np.isfinite(r)]), initial=0)))
            where = MASKS[h] if h is not None else "every head"
            assert max_err(a, r) <= FACTOR * max_err(lo, r) + eps, f"{where}: {what}"


def test_check_grads_closed_over_floats(flex_impl):
    """Numerical gradients through q, k, v, ALiBi's slopes and a T5 table closed over by the
    score_mod, through the one custom_vjp, with a per-document causal block mask: float64 on
    xla, float32 (coarser steps and tolerances) on pallas, which takes no float64."""
    shape = Shape(1, 9, 11, 2, 1, 8)
    dt = jnp.float64 if flex_impl == "xla" else jnp.float32
    q, k, v = _inputs(shape, dt)
    params = _params(shape.n, dt)
    mask_mod = _mask_mod("doc_causal", shape)
    bm = jax_flash.create_block_mask(mask_mod, shape.b, None, shape.t, shape.s, block_size=BS // 2 if BS < 16 else BS)

    @jax.jit
    def f(q, k, v, slopes, table):
        def score_mod(s, b, h, qi, ki):
            return s - slopes[h] * jnp.abs(qi - ki) + table[h, _t5_bucket(ki - qi)]

        out, lse = jax_flash.flex_attention(
            q,
            k,
            v,
            score_mod=score_mod,
            mask_mod=mask_mod,
            block_mask=bm,
            return_residual=True,
            implementation=flex_impl,
        )
        return out, jnp.where(jnp.isfinite(lse), lse, 0)

    tol = dict(atol=1e-6, rtol=1e-6, eps=1e-4) if dt == jnp.float64 else dict(atol=2e-2, rtol=2e-2, eps=2e-3)
    check_grads(f, (q, k, v, params["slopes"], params["table"]), order=1, modes=["rev"], **tol)


def test_block_mask_rebuilt_under_jit(mask_impl):
    """Packed documents that change every step: the document ids are an argument of the
    jitted step, and the block mask is rebuilt from them inside it; two different packings
    through one compiled step match the reference."""
    shape = Shape(2, 3 * BS + 1, 3 * BS + 1, 2, 1, 16)
    q, k, v = _inputs(shape)

    def mask_of(docs):
        return lambda b, h, qi, ki: (docs[b, qi] == docs[b, ki]) & (ki <= qi)

    traces = []

    @jax.jit
    def step(q, k, v, docs):
        traces.append(docs)  # once per trace
        bm = jax_flash.create_block_mask(mask_of(docs), shape.b, None, shape.t, shape.s, block_size=BS)
        out = jax_flash.flex_attention(q, k, v, mask_mod=mask_of(docs), block_mask=bm, implementation=mask_impl)
        return out, bm.num_nonempty()

    ref = jax.jit(lambda q, k, v, docs: jax_flash.flex_reference(q, k, v, mask_mod=mask_of(docs)))
    counts = []
    for seed in (0, 1):
        docs = np.sort(np.random.default_rng(seed).integers(0, 4, size=(shape.b, shape.t)), axis=1)
        out, count = step(q, k, v, jnp.asarray(docs, jnp.int32))
        assert max_err(out, ref(q, k, v, jnp.asarray(docs, jnp.int32))) <= 2e-6
        counts.append(int(count))
    assert len(traces) == 1 and counts[0] != counts[1], counts


# ---- the numerical contract -------------------------------------------------------------------


def test_contract_empty_rows_and_poison(flex_impl):
    """Rows that see nothing: out 0, lse -inf, zero gradients. A NaN query row and an inf key
    reach only what sees them (the reference's NaN pattern), and a NaN in the score_mod's table
    at pairs no query sees changes nothing."""
    shape = Shape(1, BS + 1, 2 * BS - 1, 2, 1, 16)
    q, k, v = _inputs(shape)
    q = q.at[0, 3, 1, 0].set(jnp.nan)
    k = k.at[0, 12, 0, 5].set(jnp.inf)  # key 12 is seen by no query below
    table = jnp.zeros((shape.t, shape.s), jnp.float32).at[0, 14].set(jnp.nan)  # (0, 14) is masked

    def mask_mod(b, h, qi, ki):
        return (ki <= qi) & (qi >= 2) & (ki != 12)  # rows 0, 1 see nothing

    bm = jax_flash.create_block_mask(mask_mod, None, None, shape.t, shape.s, block_size=BS)

    def run(fn, **kw):
        def f(q, k, v, table):
            score_mod = lambda s, b, h, qi, ki: s + table[qi, ki]
            return fn(q, k, v, score_mod=score_mod, mask_mod=mask_mod, return_residual=True, **kw)

        return jax.jit(lambda *a: (*f(*a), jax.grad(lambda *a: jnp.sum(f(*a)[0]), argnums=(0, 1, 2, 3))(*a)))

    out, lse, grads = run(jax_flash.flex_attention, block_mask=bm, implementation=flex_impl)(q, k, v, table)
    ref, ref_lse, ref_grads = run(jax_flash.flex_reference)(q, k, v, table)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    assert np.isnan(out[0, 3, 1]).all() and not np.isnan(out[0, 3, 0]).any()
    assert not np.isnan(out[0, :, 0]).any(), "the other head does not see the NaN query"
    np.testing.assert_array_equal(np.asarray(out[0, :2]), 0)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(r))
    dtable = np.asarray(grads[3])
    assert not np.isnan(dtable[0, 14]), "a masked NaN of the table reaches nothing"
    assert not np.isnan(np.delete(dtable, 3, axis=0)).any(), "only the NaN query's row of the table is NaN"
    assert np.all(np.asarray(lse[0, :2]) == -np.inf) and np.all(np.asarray(ref_lse[0, :2]) == -np.inf)
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    ok = np.ones_like(np.asarray(out), bool)
    ok[0, 3, 1] = False
    assert max_err(np.asarray(out)[ok], np.asarray(ref)[ok]) <= 1e-5


@pytest.mark.parametrize("name", ["cpu", "xla", "cuda"])
def test_contract_mask_mod(name):
    """Without a score_mod (every implementation that serves flex): rows that see nothing give
    out 0, lse -inf and zero gradients; a NaN query row and an inf key reach only what sees
    them (the reference's NaN pattern, gradients too): the key, masked for every query,
    reaches nothing."""
    _available(name)
    shape, dtype = _kernel_case(name, Shape(1, BS + 1, 2 * BS - 1, 2, 1, 16))
    q, k, v = _inputs(shape, jnp.dtype(dtype))
    q = q.at[0, 3, 1, 0].set(jnp.nan)
    k = k.at[0, 12, 0, 5].set(jnp.inf)  # key 12 is seen by no query

    def mask_mod(b, h, qi, ki):
        return (ki <= qi) & (qi >= 2) & (ki != 12)  # rows 0, 1 see nothing

    bm = jax_flash.create_block_mask(mask_mod, None, None, shape.t, shape.s, block_size=BS)

    def run(fn, **kw):
        def f(q, k, v):
            return fn(q, k, v, mask_mod=mask_mod, return_residual=True, **kw)

        return jax.jit(lambda *a: (*f(*a), jax.grad(lambda *a: jnp.sum(f(*a)[0]), argnums=(0, 1, 2))(*a)))

    out, lse, grads = run(jax_flash.flex_attention, block_mask=bm, implementation=name)(q, k, v)
    ref, ref_lse, ref_grads = run(jax_flash.flex_reference)(q, k, v)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    assert np.isnan(out[0, 3, 1]).all() and not np.isnan(out[0, 3, 0]).any()
    assert not np.isnan(out[0, :, 0]).any(), "the other head does not see the NaN query"
    np.testing.assert_array_equal(np.asarray(out[0, :2]), 0)
    assert np.all(np.asarray(lse[0, :2]) == -np.inf) and np.all(np.asarray(ref_lse[0, :2]) == -np.inf)
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(ref_lse))
    for g, r in zip(grads, ref_grads):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(r))
    np.testing.assert_array_equal(np.asarray(grads[0][0, :2]), 0)
    ok = ~np.isnan(np.asarray(ref, np.float32))
    tol = 1e-5 if dtype == "float32" else 4 * EPS[dtype] * max(1.0, float(np.max(np.abs(np.asarray(ref)[ok]))))
    assert max_err(np.asarray(out, np.float32)[ok], np.asarray(ref, np.float32)[ok]) <= tol


# ---- partial_capacity ---------------------------------------------------------------------------


def test_partial_capacity():
    """Eagerly the exact count of partly visible blocks, under jit every block (the count is
    traced), or what is asked; a bad one is refused."""
    t, s = 4 * BS + 3, 5 * BS
    causal = lambda b, h, qi, ki: ki <= qi
    bm = jax_flash.create_block_mask(causal, None, 2, t, s, block_size=BS)
    assert bm.partial_capacity == int(bm.num_partial()) == 2 * 5
    traced = jax.jit(lambda: jax_flash.create_block_mask(causal, None, 2, t, s, block_size=BS))()
    assert traced.partial_capacity == 2 * 5 * 5 == traced.capacity
    asked = jax_flash.create_block_mask(causal, None, 2, t, s, block_size=BS, partial_capacity=3)
    assert asked.partial_capacity == 3
    np.testing.assert_array_equal(asked.to_dense(), bm.to_dense())
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match=r"partial_capacity must be None \(every block\) or an int >= 0"):
            jax_flash.create_block_mask(causal, None, 2, t, s, block_size=BS, partial_capacity=bad)


@pytest.mark.parametrize("name, dtype", [("cpu", "float32"), ("cpu", "bfloat16"), ("cuda", "bfloat16")])
def test_kernels_partial_capacity_overflow(name, dtype):
    """A block mask with more partly visible blocks than its capacity: on cpu and cuda the rows
    of the query blocks of the blocks past it (in (b, h, i, j) order) are NaN, out and lse, and
    so are their dq rows; every other row is what the reference gives. xla, which evaluates
    mask_mod in its tiles, does not read the capacity."""
    _available(name)
    shape, _ = _kernel_case(name, Shape(1, 5 * BS - 1, 5 * BS + 1, 2, 1, 16))  # causal: 5 partial blocks
    q, k, v = _inputs(shape, jnp.dtype(dtype))
    causal = lambda b, h, qi, ki: ki <= qi
    bm = jax_flash.create_block_mask(causal, None, None, shape.t, shape.s, block_size=BS, partial_capacity=3)
    assert int(bm.num_partial()) == 5

    def f(q, k, v, impl):
        return jax_flash.flex_attention(
            q, k, v, mask_mod=causal, block_mask=bm, return_residual=True, implementation=impl
        )

    (out, lse), dq = jax.jit(
        lambda q, k, v: (f(q, k, v, name), jax.grad(lambda q: jnp.sum(f(q, k, v, name)[0].astype(jnp.float32)))(q))
    )(q, k, v)
    ref, ref_lse = jax_flash.flex_reference(q, k, v, mask_mod=causal, return_residual=True)
    bad = 3 * BS  # query blocks 3 and 4: rows 24..
    assert np.isnan(np.asarray(out[0, bad:], np.float32)).all() and np.isnan(np.asarray(lse[0, bad:])).all()
    assert np.isnan(np.asarray(dq[0, bad:], np.float32)).all()
    good = np.asarray(out[0, :bad], np.float32)
    assert not np.isnan(good).any()
    assert max_err(good, np.asarray(ref[0, :bad], np.float32)) <= 2 * EPS[dtype] * 10
    np.testing.assert_allclose(
        np.asarray(lse[0, :bad]), np.asarray(ref_lse[0, :bad]), rtol=1e-2 if dtype == "bfloat16" else 1e-5
    )
    out_xla = f(q, k, v, "xla")[0]
    assert not np.isnan(np.asarray(out_xla, np.float32)).any()


# ---- work follows the mask --------------------------------------------------------------------


def test_tiles_follow_block_mask():
    """The xla tile loop runs exactly the non-empty blocks (forward and backward), and
    mask_mod only in the partly visible ones; with a per-(b, h) block mask, their union."""
    shape = Shape(1, 4 * BS - 1, 4 * BS + 1, 2, 2, 8)
    q, k, v = _inputs(shape)

    def causal(b, h, qi, ki):
        return ki <= qi

    bm = jax_flash.create_block_mask(causal, None, None, shape.t, shape.s, block_size=BS)
    nonempty = int(bm.num_nonempty())
    partial = int(jnp.sum(bm.kv_num_blocks))
    assert 0 < partial < nonempty < bm.shape[2] * bm.shape[3]
    loss = lambda q, k, v: jnp.sum(
        jax_flash.flex_attention(q, k, v, mask_mod=causal, block_mask=bm, implementation="xla")
    )
    with xla.count_tiles() as c:
        jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert (c.forward, c.backward) == (nonempty, nonempty)
    assert c.mask_mod == 2 * partial  # forward and backward

    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.random(size=(shape.n, 4, 5)) < 0.4)
    sparse = lambda b, h, qi, ki: table[h, qi // BS, ki // BS]
    bm = jax_flash.create_block_mask(sparse, None, shape.n, shape.t, shape.s, block_size=BS)
    union = int(jnp.sum(jnp.any(bm.to_dense() > 0, axis=(0, 1))))
    with xla.count_tiles() as c:
        jax.jit(
            lambda q, k, v: jax_flash.flex_attention(q, k, v, mask_mod=sparse, block_mask=bm, implementation="xla")
        )(q, k, v)
    assert c.forward == union and c.mask_mod == 0  # every non-empty block is full


def test_kernels_trust_the_block_mask(mask_impl):
    """Work follows the block mask in every implementation, also where no tile can be counted
    (the pallas kernels): given a block mask that disagrees with its mask_mod on purpose, a
    block it calls full is not masked (mask_mod is not evaluated there) and a block it calls
    empty is not run, forward and backward: the results are those of the mask the block mask
    describes, not of the mask_mod."""
    shape = Shape(1, 3 * BS - 1, 3 * BS + 1, 2, 1, 8)
    q, k, v = _inputs(shape)

    def causal(b, h, qi, ki):
        return ki <= qi

    def both(b, h, qi, ki):  # causal within query block i, and key block i - 1 whole
        i, j = qi // BS, ki // BS
        return ((j == i) & (ki <= qi)) | (j == i - 1)

    cases = (
        (jax_flash.create_block_mask(lambda b, h, qi, ki: qi >= 0, None, None, shape.t, shape.s, block_size=BS), None),
        (jax_flash.create_block_mask(both, None, None, shape.t, shape.s, block_size=BS), both),
    )

    def value_and_grads(f):
        loss = lambda q, k, v: jnp.sum(f(q, k, v))
        return jax.jit(lambda q, k, v: (f(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))(q, k, v)

    for bm, described in cases:
        out, grads = value_and_grads(
            lambda q, k, v, bm=bm: jax_flash.flex_attention(
                q, k, v, mask_mod=causal, block_mask=bm, implementation=mask_impl
            )
        )
        ref, ref_grads = value_and_grads(
            lambda q, k, v, described=described: jax_flash.flex_reference(q, k, v, mask_mod=described)
        )
        assert max_err(out, ref) <= 2e-6
        for a, r in zip(grads, ref_grads):
            assert max_err(a, r) <= 2e-5 * max(1.0, float(jnp.max(jnp.abs(r))))


def _kernel_tiles(states, shape: Shape, bs: int, heads: int, tile=(CPU_TILE, CPU_TILE)) -> int:
    """The kernel tiles (tile[0] rows x tile[1] keys, multiples of bs, per batch row and query
    head) that overlap a block that is not empty, from the block mask's states [B|1, N|1, nq, nk]."""
    st = np.broadcast_to(np.asarray(states), (shape.b, heads, *np.asarray(states).shape[2:]))
    per_q, per_k = tile[0] // bs, tile[1] // bs
    count = 0
    for i in range(-(-shape.t // tile[0])):
        for j in range(-(-shape.s // tile[1])):
            blocks = st[:, :, i * per_q : (i + 1) * per_q, j * per_k : (j + 1) * per_k]
            count += int(np.sum(np.any(blocks > 0, axis=(2, 3))))
    return count


def test_cpu_tiles_follow_block_mask():
    """The cpu kernels compute exactly the 128 x 128 tiles that overlap a non-empty block of
    their (b, h), forward and backward (a debug counter in the kernels): a causal block mask
    skips the tiles above the diagonal; a per-head block-sparse one of 64 x 64 blocks skips
    each head's own empty tiles (not their union, as xla's one schedule does)."""
    _available("cpu")
    from jax_flash import cpu

    shape = Shape(1, 3 * CPU_TILE - 1, 3 * CPU_TILE + 1, 2, 1, 8)
    q, k, v = _inputs(shape)
    every = shape.b * shape.n * 3 * 4

    def causal(b, h, qi, ki):
        return ki <= qi

    rng = np.random.default_rng(1)
    table = jnp.asarray(rng.random(size=(shape.n, 6, 7)) < 0.3)
    sparse = lambda b, h, qi, ki: table[h, qi // CPU_BS, ki // CPU_BS]
    for mask_mod, heads, bs in ((causal, None, CPU_TILE), (sparse, shape.n, CPU_BS)):
        bm = jax_flash.create_block_mask(mask_mod, None, heads, shape.t, shape.s, block_size=bs)
        want = _kernel_tiles(bm.to_dense(), shape, bs, shape.n)
        assert 0 < want < every

        def loss(q, k, v, bm, mask_mod=mask_mod):
            return jnp.sum(jax_flash.flex_attention(q, k, v, mask_mod=mask_mod, block_mask=bm, implementation="cpu"))

        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        step = lambda q, k, v, bm=bm, grads=grads: grads(q, k, v, bm)
        jax.block_until_ready(step(q, k, v))  # compiled outside the count
        with cpu.count_tiles() as c:
            jax.block_until_ready(step(q, k, v))
        assert (c.forward, c.backward) == (want, want)
    with cpu.count_tiles() as c:  # no block mask: every tile
        jax.block_until_ready(jax_flash.flex_attention(q, k, v, mask_mod=causal, implementation="cpu"))
    assert c.forward == every


def _check_cuda_tiles_and_grads(q, k, v, mask_mod, bm, shape, **settings):
    """One forward and one backward call of flex_attention on cuda with block mask `bm`, in
    both backward modes (and `settings`): the kernels compute exactly the tiles over non-empty
    blocks (forward, main backward, deterministic dQ kernel), and the output and gradients
    match the float64 reference within the bf16 reference's own error."""
    from jax_flash import cuda

    forward = _kernel_tiles(bm.to_dense(), shape, CUDA_BS, shape.n, CUDA_FORWARD_TILE)
    backward = _kernel_tiles(bm.to_dense(), shape, CUDA_BS, shape.n, CUDA_BACKWARD_TILE)

    def value_and_grads(fn, q, k, v, **kw):
        def loss(q, k, v):
            out = fn(q, k, v, mask_mod=mask_mod, **kw).astype(jnp.float32)
            return jnp.sum(out * jnp.cos(out)), out

        grads, out = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads

    q64, k64, v64 = (x.astype(jnp.float64) for x in (q, k, v))
    low, ref = (value_and_grads(jax_flash.flex_reference, *x) for x in ((q, k, v), (q64, k64, v64)))
    for deterministic in (False, True):
        with jax_flash.config(deterministic=deterministic, **settings):
            step = jax.jit(
                lambda q, k, v: value_and_grads(jax_flash.flex_attention, q, k, v, block_mask=bm, implementation="cuda")
            )
            jax.block_until_ready(step(q, k, v))  # compiled outside the count
            with cuda.count_tiles() as c:
                got = jax.block_until_ready(step(q, k, v))
        assert (c.forward, c.backward, c.backward_dq) == (forward, backward, backward if deterministic else 0)
        for g, lo, r in zip(jax.tree.leaves(got), jax.tree.leaves(low), jax.tree.leaves(ref)):
            scale = max(1.0, float(jnp.max(jnp.abs(r))))
            assert max_err(g, r) <= FACTOR * max_err(lo, r) + GRAD_EPS["bfloat16"] * scale


def test_cuda_tiles_follow_block_mask():
    """cuda (on its host emulation, which counts them): the forward computes exactly the
    128 x 64 tiles, the backward's main kernel and deterministic mode's dQ kernel exactly the
    64 x 64 tiles, that overlap a non-empty block of their (b, h): a causal block mask skips the
    tiles above the diagonal, a per-head block-sparse one of 32 x 32 blocks each head's own
    empty tiles. Their results (forward and gradients, both modes) match the reference."""
    _available("cuda")
    shape = CUDA_SHAPE
    q, k, v = _inputs(shape, jnp.bfloat16)
    every = shape.b * shape.n * 3 * 3  # forward tiles: ceil(257 / 128) x ceil(191 / 64)

    def causal(b, h, qi, ki):
        return ki <= qi

    rng = np.random.default_rng(1)
    table = jnp.asarray(rng.random(size=(shape.n, 9, 6)) < 0.3)
    sparse = lambda b, h, qi, ki: table[h, qi // CUDA_BS, ki // CUDA_BS]
    for mask_mod, heads in ((causal, None), (sparse, shape.n)):
        bm = jax_flash.create_block_mask(mask_mod, None, heads, shape.t, shape.s, block_size=CUDA_BS)
        assert 0 < _kernel_tiles(bm.to_dense(), shape, CUDA_BS, shape.n, CUDA_FORWARD_TILE) < every
        _check_cuda_tiles_and_grads(q, k, v, mask_mod, bm, shape)


def test_cuda_ring_prefetches_across_gaps():
    """cuda: each loop's cp.async ring copies the running tiles only, STAGES - 1 ahead of the
    math, so a tile after a gap lands in the slot the math reads: a mask whose running tiles
    have gaps past the prologue's copies (every third tile of a CTA's row is empty: 8 key
    tiles per forward CTA (no split-KV), 5 query blocks per backward CTA and 8 key tiles per
    dQ CTA), some blocks partly visible, gives the forward of the same mask given densely
    bitwise (that call runs every tile; an empty one adds exact zeros) and the reference's
    gradients in both backward modes, computing exactly the tiles of non-empty blocks."""
    _available("cuda")
    shape = Shape(1, 4 * 64 + 1, 8 * 64 - 1, 2, 1, 32)
    q, k, v = _inputs(shape, jnp.bfloat16, seed=3)

    def gapped(b, h, qi, ki):
        # Forward tiles (128 rows) and backward blocks (64 rows, in pairs) against 64-key tiles:
        # a third of them empty; odd key tiles partly visible (a pattern of bits).
        runs = (qi // 128 + ki // 64 + h) % 3 != 1
        return runs & (((ki // 64) % 2 == 0) | ((qi + 2 * ki) % 7 != 0))

    bm = jax_flash.create_block_mask(gapped, None, shape.n, shape.t, shape.s, block_size=CUDA_BS)
    qi, ki = jnp.arange(shape.t)[:, None], jnp.arange(shape.s)[None, :]
    dense = jnp.stack([gapped(0, h, qi, ki) for h in range(shape.n)])[None]
    with jax_flash.config(cuda_split_kv=1):  # one key chunk: each forward CTA loops over 8 tiles
        flex_fwd, dense_fwd = jax.jit(
            lambda: (
                jax_flash.flex_attention(
                    q, k, v, mask_mod=gapped, block_mask=bm, return_residual=True, implementation="cuda"
                ),
                jax_flash.attention(q, k, v, mask=dense, return_residual=True, implementation="cuda"),
            )
        )()
    for name, a, b in zip(("out", "lse"), flex_fwd, dense_fwd):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    _check_cuda_tiles_and_grads(q, k, v, gapped, bm, shape, cuda_split_kv=1)


# ---- block masks -----------------------------------------------------------------------------


def test_create_block_mask_matches_dense():
    """Counts and ascending indices of partly and fully visible blocks, both directions, equal
    those of the dense mask (built here in numpy); jit gives the same."""
    t, s, bq, bk = 21, 30, 8, 4
    docs = jnp.asarray([0] * 7 + [1] * 9 + [2] * 14, jnp.int32)

    def mask_mod(b, h, qi, ki):
        return (docs[qi] == docs[ki]) & (ki <= qi + h)

    bm = jax_flash.create_block_mask(mask_mod, None, 2, t, s, block_size=(bq, bk))
    jitted = jax.jit(lambda: jax_flash.create_block_mask(mask_mod, None, 2, t, s, block_size=(bq, bk)))()
    dense = np.zeros((1, 2, t, s), bool)
    d = np.asarray(docs)
    for h in range(2):
        for i in range(t):
            for j in range(s):
                dense[0, h, i, j] = d[i] == d[j] and j <= i + h
    nq, nk = -(-t // bq), -(-s // bk)
    want = np.zeros((1, 2, nq, nk), int)
    for i in range(nq):
        for j in range(nk):
            tile = dense[:, :, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            want[:, :, i, j] = np.where(tile.all(axis=(2, 3)), 2, np.where(tile.any(axis=(2, 3)), 1, 0))
    for m in (bm, jitted):
        np.testing.assert_array_equal(np.asarray(m.to_dense()), want)
        for state, count, idx in ((1, m.kv_num_blocks, m.kv_indices), (2, m.full_kv_num_blocks, m.full_kv_indices)):
            for h in range(2):
                for i in range(nq):
                    cols = np.flatnonzero(want[0, h, i] == state)
                    assert int(count[0, h, i]) == len(cols)
                    np.testing.assert_array_equal(np.asarray(idx[0, h, i, : len(cols)]), cols)
        for state, count, idx in ((1, m.q_num_blocks, m.q_indices), (2, m.full_q_num_blocks, m.full_q_indices)):
            for h in range(2):
                for j in range(nk):
                    rows = np.flatnonzero(want[0, h, :, j] == state)
                    assert int(count[0, h, j]) == len(rows)
                    np.testing.assert_array_equal(np.asarray(idx[0, h, j, : len(rows)]), rows)
    # The padding of the ragged last blocks does not count: a mask that is False only there
    # (positions past T and S) has every block fully visible.
    inside = jax_flash.create_block_mask(
        lambda b, h, qi, ki: (qi < t) & (ki < s), None, None, t, s, block_size=(bq, bk)
    )
    np.testing.assert_array_equal(np.asarray(inside.to_dense()), 2)


# ---- arguments -------------------------------------------------------------------------------

Q = jnp.zeros((2, 8, 4, 16), jnp.float32)
KV = jnp.zeros((2, 10, 2, 16), jnp.float32)
CAUSAL = lambda b, h, qi, ki: ki <= qi


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(mask_mod=lambda b, h, qi, ki: qi - ki), TypeError, r"mask_mod must return a bool scalar.*int32"),
        (dict(mask_mod=lambda b, h, qi, ki: jnp.ones(3, bool)), TypeError, r"mask_mod must return one scalar"),
        (dict(score_mod=lambda s, b, h, qi, ki: qi), TypeError, r"score_mod must return a floating-point scalar"),
        (dict(score_mod=3.0), TypeError, r"score_mod must be a function"),
        (
            dict(block_mask=jax_flash.create_block_mask(CAUSAL, None, None, 8, 10)),
            ValueError,
            r"block_mask needs the mask_mod",
        ),
        (
            dict(mask_mod=CAUSAL, block_mask=jax_flash.create_block_mask(CAUSAL, None, None, 8, 11)),
            ValueError,
            r"block_mask was made for \(T, S\) = \(8, 11\).*\(8, 10\)",
        ),
        (
            dict(mask_mod=CAUSAL, block_mask=jax_flash.create_block_mask(CAUSAL, 3, None, 8, 10)),
            ValueError,
            r"block_mask must have leading axes \[B\|1, N\|1\] = \[2\|1, 4\|1\]",
        ),
        (
            dict(mask_mod=CAUSAL, block_mask=np.zeros((1, 1, 1, 1))),
            TypeError,
            r"block_mask must be a jax_flash.BlockMask",
        ),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    for fn in (jax_flash.flex_attention, jax_flash.explain, jax_flash.flex_reference):
        if fn is jax_flash.flex_reference and "block_mask" in kwargs and "mask_mod" not in kwargs:
            continue  # the reference reads only mask_mod
        with pytest.raises(exc, match=match):
            fn(Q, KV, KV, **kwargs)


def test_create_block_mask_arguments():
    with pytest.raises(ValueError, match=r"block_size must be a positive int or a pair"):
        jax_flash.create_block_mask(CAUSAL, 1, 1, 8, 8, block_size=0)
    with pytest.raises(ValueError, match=r"T must be a positive int"):
        jax_flash.create_block_mask(CAUSAL, 1, 1, 0, 8)
    with pytest.raises(TypeError, match=r"mask_mod must return a bool scalar"):
        jax_flash.create_block_mask(lambda b, h, qi, ki: 1.0, 1, 1, 8, 8)


def test_pallas_refuses_what_it_cannot_evaluate():
    """The pallas kernels evaluate the user functions on tiles and read closed-over arrays one
    element per position: a function that reads a slice (or passes an array whole) is
    refused with the reason, in explain and by a call that asks for pallas; xla (or cpu, for a
    mask_mod) serves it.
    Compiled by Triton (not interpreted), block-mask blocks must be powers of two >= 16."""
    docs = jnp.arange(10, dtype=jnp.int32) // 3

    def window_sum(b, h, qi, ki):  # a [2]-slice of a closed-over array
        return lax.dynamic_slice(docs, (ki,), (2,)).sum() >= qi

    e = jax_flash.explain(Q, KV, KV, mask_mod=window_sum)
    assert e.selected in ("xla", "cpu") and "reads a slice" in e.reasons["pallas"], e.reasons["pallas"]
    with pytest.raises(ValueError, match=r'implementation="pallas" cannot run this call: .*reads a slice'):
        jax_flash.flex_attention(Q, KV, KV, mask_mod=window_sum, implementation="pallas")
    for size, ok in ((8, False), ((16, 48), False), ((16, 64), True), (128, True)):
        c = canonicalize_flex(
            Q,
            KV,
            KV,
            mask_mod=CAUSAL,
            block_mask=jax_flash.create_block_mask(CAUSAL, None, None, 8, 10, block_size=size),
        )
        why = pallas.flex_limit(c.spec, interpret=False)
        assert (why is None) == ok, (size, why)
        assert pallas.flex_limit(c.spec, interpret=True) is None


def test_pallas_config_leaves_room_for_tile_reads():
    """A user function that reads a closed-over array at every (q, kv) position (a T5 table, a
    block-sparse table) makes Triton stage a [bq, bk] tile of pointers through shared memory:
    the launch configuration drops pipeline stages until the table's model plus that tile fits
    (on an H200, 3 stages of the forward at H = 64 asked for 240 KiB of 227); reads along
    rows or columns only (document ids) and scalar reads (slopes[h]) change nothing."""
    from jax_flash.pallas import _flex_tiles
    from jax_flash.pallas._table import TABLE

    table = jnp.ones((4, 32), jnp.float32)
    docs = jnp.arange(300, dtype=jnp.int32) // 70
    t5 = lambda s, b, h, qi, ki: s + table[h, jnp.clip(jnp.abs(qi - ki) // 16, 0, 31)]
    doc_causal = lambda b, h, qi, ki: (docs[qi] == docs[ki]) & (ki <= qi)
    alibi = lambda s, b, h, qi, ki: s - table[h, 0] * (qi - ki)
    q = jnp.zeros((1, 300, 4, 64), jnp.bfloat16)
    budget = 227 * 1024
    for score_mod, reads in ((t5, 1), (alibi, 0), (None, 0)):
        bm = jax_flash.create_block_mask(doc_causal, None, None, 300, 300, block_size=128)
        c = canonicalize_flex(q, q, q, score_mod=score_mod, mask_mod=doc_causal, block_mask=bm)
        assert _flex_tiles.tile_reads(c.spec.flex.score_mod, True) == reads
        assert _flex_tiles.tile_reads(c.spec.flex.mask_mod, False) == 0
        fwd = pallas.flex_config(c.spec, TABLE[(64, "bfloat16", "fwd")], 64, "fwd", budget)
        assert (fwd.block_q, fwd.block_k) == (128, 128)
        assert fwd.num_stages == (2 if reads else TABLE[(64, "bfloat16", "fwd")].num_stages)


def test_cuda_flex_only_by_name(monkeypatch):
    """implementation=None does not pick cuda for a flex call (its block masks have not run on a
    GPU yet): with cuda first in the platform's order, the next implementation that serves the
    call runs it, explain says why, and asking for cuda by name runs it."""
    _available("cuda")
    from jax_flash import _registry

    monkeypatch.setattr(_registry, "preference", lambda: ("cuda", "xla"))
    shape, dtype = _kernel_case("cuda", Shape(1, 8, 10, 2, 1, 16))
    q, k, v = _inputs(shape, jnp.dtype(dtype))
    e = jax_flash.explain(q, k, v, mask_mod=CAUSAL, verbose=True)
    assert e.reasons["cuda"] is None and e.selected == "xla"
    assert "implementation=None does not pick cuda for a flex call" in str(e)
    assert jax_flash.explain(q, k, v, is_causal=True).selected == "cuda"
    out = jax_flash.flex_attention(q, k, v, mask_mod=CAUSAL, implementation="cuda")
    ref = jax_flash.flex_reference(q, k, v, mask_mod=CAUSAL)
    assert max_err(out, ref) <= 4 * EPS[dtype] * max(1.0, float(jnp.max(jnp.abs(ref.astype(jnp.float32)))))


@pytest.mark.parametrize("name", ["cpu", "cuda"])
def test_kernels_refuse_score_mod(name):
    """cpu and cuda serve mask_mod and block masks but cannot run a score_mod: they say so
    (explain, and the error of a call that asks for them), and implementation=None picks xla,
    never a silent fallback of a requested kernel."""
    _available(name)
    shape, dtype = _kernel_case(name, Shape(2, 8, 10, 4, 2, 16))
    q, k, v = _inputs(shape, jnp.dtype(dtype))
    score_mod = lambda s, b, h, qi, ki: s * 0.5
    e = jax_flash.explain(q, k, v, score_mod=score_mod, mask_mod=CAUSAL)
    assert "a score_mod needs the user function inside the tile" in e.reasons[name] and e.selected == "xla"
    with pytest.raises(ValueError, match=f'implementation="{name}" cannot run this call: {name} serves flex_attention'):
        jax_flash.flex_attention(q, k, v, score_mod=score_mod, implementation=name)
    assert jax_flash.explain(q, k, v, mask_mod=CAUSAL).reasons[name] is None


def test_cpu_explain_reports_bits():
    """explain (verbose) states the blocks the cpu kernels read and the capacity and bytes of
    mask_mod's bits: the block mask's, or without one every 128 x 128 block (T·S/8 bytes per
    row of blocks; none per batch row when mask_mod does not read b)."""
    _available("cpu")
    bm = jax_flash.create_block_mask(CAUSAL, None, None, 8, 10, block_size=4)  # 2 partial blocks
    text = str(jax_flash.explain(Q, KV, KV, mask_mod=CAUSAL, block_mask=bm, verbose=True))
    assert "bits of up to 2 partly visible blocks ([1, 1] rows of blocks, partial_capacity), 32 bytes" in text
    text = str(jax_flash.explain(Q, KV, KV, mask_mod=lambda b, h, qi, ki: ki <= qi + b, verbose=True))
    assert "no block_mask, every 8x10 block partly visible" in text  # 128 x 128, or less: T x S
    assert "bits of up to 2 partly visible blocks ([2, 1] rows of blocks, partial_capacity), 64 bytes" in text


@pytest.mark.parametrize("name", ["cpu", "cuda"])
@pytest.mark.parametrize("split", [0, 3], ids=["rule", "split_kv_3"])
def test_kernels_decode_and_vmap(name, split):
    """cpu and cuda: a decode step (T = 1, GQA 4:1, where the built-in path packs a kv head's
    query heads into one tile: not with a per-head mask_mod), with the forward's split-KV as its
    rule decides and forced to 3 key chunks, and the call under jax.vmap (run once per mapped
    element, so that mask_mod sees each call's own b), gradients too, against the reference."""
    _available(name)
    shape, dtype = _kernel_case(name, Shape(2, 1, 3 * CPU_TILE + 5, 8, 2, 16))
    q, k, v = (jnp.stack([x, -x]) for x in _inputs(shape, jnp.dtype(dtype)))  # a leading mapped axis of 2
    mask_mod = lambda b, h, qi, ki: (ki % 3 != h % 3) | (ki == b)

    def both(fn, **kw):
        def loss(q, k, v):
            out = fn(q, k, v, mask_mod=mask_mod, **kw)
            return jnp.sum(out * jnp.cos(out)), out

        return jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2), has_aux=True)))(*inputs)

    inputs = (q, k, v)
    with jax_flash.config(**{f"{name}_split_kv": split}):
        (grads, out) = both(jax_flash.flex_attention, implementation=name)
    (low_grads, low) = both(jax_flash.flex_reference)  # the reference at the input dtype
    if dtype == "float32":
        assert max_err(out, low) <= 1e-5
        for g, r in zip(grads, low_grads):
            assert max_err(g, r) <= GRAD_EPS["float32"] * max(1.0, float(jnp.max(jnp.abs(r))))
        return
    inputs = tuple(x.astype(jnp.float64) for x in (q, k, v))  # 16-bit: err <= 2 x the reference's own
    (ref_grads, ref) = both(jax_flash.flex_reference)
    assert max_err(out, ref) <= FACTOR * max_err(low, ref) + EPS[dtype]
    for g, lo, r in zip(grads, low_grads, ref_grads):
        assert max_err(g, r) <= FACTOR * max_err(lo, r) + GRAD_EPS[dtype] * max(1.0, float(jnp.max(jnp.abs(r))))


@pytest.mark.parametrize("block_size", [(24, 40), (128, 96), (5, 33), (300, 7)])
def test_cpu_block_sizes(block_size):
    """cpu: block masks whose blocks are not the kernels' 128 x 128 tiles nor multiples of 32
    keys (a bit row spans words, a block spans tiles, a tile many blocks) against the
    reference, forward and gradients, per (b, h) (documents differ per batch row)."""
    _available("cpu")
    shape = CPU_SHAPE
    q, k, v = _inputs(shape)
    rng = np.random.default_rng(3)
    docs = jnp.asarray(np.sort(rng.integers(0, 5, size=(shape.b, max(shape.t, shape.s))), axis=1), jnp.int32)
    mask_mod = lambda b, h, qi, ki: (docs[b, qi] == docs[b, ki]) & ((ki <= qi) | (h == 1))
    bm = jax_flash.create_block_mask(mask_mod, shape.b, shape.n, shape.t, shape.s, block_size=block_size)

    def run(fn, **kw):
        def loss(q, k, v):
            out = fn(q, k, v, mask_mod=mask_mod, **kw)
            return jnp.sum(out * jnp.sin(out)), out

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    grads, out = run(jax_flash.flex_attention, block_mask=bm, implementation="cpu")
    ref_grads, ref = run(jax_flash.flex_reference)
    assert max_err(out, ref) <= 1e-5
    for g, r in zip(grads, ref_grads):
        assert max_err(g, r) <= GRAD_EPS["float32"] * max(1.0, float(jnp.max(jnp.abs(r))))


_SHARDED = r"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp, numpy as np, jax_flash
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((2,), ("d",))
q = jax.random.normal(jax.random.PRNGKey(0), (2, 100, 4, 16))
k = jax.random.normal(jax.random.PRNGKey(1), (2, 90, 2, 16))
mask_mod = lambda b, h, qi, ki: (ki <= qi + 7 * b) & (ki % 5 != h)
bm = jax_flash.create_block_mask(mask_mod, 2, 4, 100, 90, block_size=32)
f = lambda q, k: jax_flash.flex_attention(q, k, k, mask_mod=mask_mod, block_mask=bm, implementation="cpu")
sharded = [jax.device_put(x, NamedSharding(mesh, P("d"))) for x in (q, k)]
out, grads = jax.jit(lambda q, k: (f(q, k), jax.grad(lambda q, k: jnp.sum(f(q, k) ** 2), (0, 1))(q, k)))(*sharded)
ref = lambda q, k: jax_flash.flex_reference(q, k, k, mask_mod=mask_mod)
ref_grads = jax.grad(lambda q, k: jnp.sum(ref(q, k) ** 2), (0, 1))(q, k)
assert float(jnp.max(jnp.abs(out - ref(q, k)))) < 1e-5
assert all(float(jnp.max(jnp.abs(g - r))) < 1e-4 for g, r in zip(grads, ref_grads))
print("ok")
"""


def test_cpu_sharded_under_jit():
    """cpu's flex call has no sharding rule yet: with inputs sharded over the batch on two
    host devices, under jit, XLA gathers them for the one call, and the results (forward and
    gradients) are the reference's."""
    _available("cpu")
    import os
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _SHARDED], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr[-3000:]
