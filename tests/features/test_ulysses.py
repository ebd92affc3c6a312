"""All-to-all sequence parallelism (`ulysses_attention`) and the all-to-all × ring hybrid
(`hybrid_attention`) inside `jax.shard_map` on host devices, against the unsharded
`jax_flash.attention` on the gathered arrays: out, lse and the VJP of a random-weighted
loss of both (dq, dk, dv, and dsinks / dbias where given).

Each multi-device test runs one subprocess (the device count is fixed when JAX starts)
that checks many cases; a case prints one line and a failing one raises with its name.
"""

from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jax_flash.parallel.ulysses import _expand_kv

ROOT = pathlib.Path(__file__).resolve().parents[2]

PRELUDE = textwrap.dedent(
    """
    import sys, time
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import jax_flash

    jax.config.update("jax_enable_x64", True)
    assert jax.device_count() == 8, jax.devices()

    def inputs(seed, b, t, s, n, kh, h, hv, dtype):
        r = np.random.default_rng(seed)
        q = r.normal(size=(b, t, n, h)) + 0.3
        k = r.normal(size=(b, s, kh, h)) - 0.2
        v = r.normal(size=(b, s, kh, hv)) + 0.5
        return [jnp.asarray(x, dtype) for x in (q, k, v)]

    def case(name, p, layout="contiguous", b=2, t=16, s=None, n=4, kh=None, h=8, hv=None,
             dtype=jnp.float64, impl="xla", tol=1e-10, q_lengths=None, kv_lengths=None,
             segment_ids=None, sinks=False, bias=None, mask=None, query_offset=None,
             len_dtype=jnp.int32, **kw):
        '''p: an int (ulysses_attention over axis "sp" of p devices) or a pair (pr, pa)
        (hybrid_attention, ring over "ring" of pr, all-to-all over "a2a" of pa devices).
        bias / mask: the global shape, broadcastable to [B, N, T, S].'''
        start = time.perf_counter()
        s = t if s is None else s
        kh = n if kh is None else kh
        hv = h if hv is None else hv
        hybrid = isinstance(p, tuple)
        if hybrid:
            pr, pa = p
            mesh = Mesh(np.array(jax.devices()[: pr * pa]).reshape(pr, pa), ("ring", "a2a"))
            seq_axes, pz = ("ring", "a2a"), pr
        else:
            mesh = Mesh(np.array(jax.devices()[:p]), ("sp",))
            seq_axes, pz = "sp", p
        SEQ = P(None, seq_axes)
        zz = layout == "zigzag"
        tr = (lambda x, axis=1: jax_flash.zigzag(x, pz, axis)) if zz else (lambda x, axis=1: x)
        un = (lambda x: jax_flash.unzigzag(x, pz, 1)) if zz else (lambda x: x)
        q, k, v = inputs(len(name), b, t, s, n, kh, h, hv, dtype)
        r = np.random.default_rng(7)
        stat_dt = jnp.float64 if dtype == jnp.float64 else jnp.float32
        diff = [q, k, v]
        if sinks:
            diff.append(jnp.asarray(r.normal(size=(n,)) + 0.5, stat_dt))
        if bias is not None:
            diff.append(jnp.asarray(r.normal(size=bias), dtype))
        mask_arr = None if mask is None else jnp.asarray(r.random(size=mask) < 0.8)
        ql = None if q_lengths is None else jnp.asarray(q_lengths, len_dtype)
        kl = None if kv_lengths is None else jnp.asarray(kv_lengths, len_dtype)
        qo = query_offset if query_offset is None or isinstance(query_offset, int) else jnp.asarray(query_offset, jnp.int32)
        pair = isinstance(segment_ids, tuple)
        seg = None
        if segment_ids is not None:
            seg = tuple(jnp.asarray(x, jnp.int32) for x in (segment_ids if pair else (segment_ids,)))

        def split(diff):
            q, k, v, *rest = diff
            sk = rest.pop(0) if sinks else None
            bs = rest.pop(0) if bias is not None else None
            return q, k, v, sk, bs

        def call(fn, diff, mk, ql, kl, qo, seg, **extra):
            q, k, v, sk, bs = split(diff)
            sid = None if seg is None else (tuple(seg) if pair else seg[0])
            dense = {} if bs is None and mk is None else dict(bias=bs, mask=mk)
            return fn(q, k, v, **dense, sinks=sk, query_seq_lengths=ql, key_value_seq_lengths=kl,
                      query_offset=qo, segment_ids=sid, return_residual=True,
                      implementation=impl, **extra, **kw)

        if hybrid:
            local_fn = lambda *a: call(jax_flash.hybrid_attention, *a, a2a_axis="a2a",
                                       ring_axis="ring", layout=layout)
        else:
            local_fn = lambda *a: call(jax_flash.ulysses_attention, *a, axis_name="sp", layout=layout)
        dense_spec = lambda x: P(*([None] * (x.ndim - 2)), seq_axes) if x.shape[-2] > 1 else P()
        diff_specs = [SEQ, SEQ, SEQ] + ([P()] if sinks else []) + ([dense_spec(diff[-1])] if bias is not None else [])
        opt = lambda x, spec: None if x is None else spec
        in_specs = (diff_specs, opt(mask_arr, None if mask_arr is None else dense_spec(mask_arr)), opt(ql, P()),
                    opt(kl, P()), None if qo is None or isinstance(qo, int) else P(),
                    opt(seg, tuple(SEQ for _ in seg) if seg is not None else None))
        sm = jax.shard_map(lambda d, mk, ql, kl, qo_, seg: local_fn(d, mk, ql, kl, qo if isinstance(qo, int) or qo is None else qo_, seg),
                           mesh=mesh, in_specs=in_specs, out_specs=(SEQ, SEQ))
        # zigzag: sequence-indexed arrays are reordered (bias/mask rows; their key columns stay in order)
        tr_dense = lambda x: None if x is None else (tr(x, x.ndim - 2) if x.shape[-2] > 1 else x)

        def sharded(diff):
            q, k, v, sk, bs = split(diff)
            d = [tr(q), tr(k), tr(v)] + ([sk] if sinks else []) + ([tr_dense(bs)] if bias is not None else [])
            out, lse = sm(d, tr_dense(mask_arr), ql, kl, None if qo is None or isinstance(qo, int) else qo,
                          None if seg is None else tuple(tr(x) for x in seg))
            return un(out), un(lse)

        def unsharded(diff):
            return call(jax_flash.attention, diff, mask_arr, ql, kl, qo, seg)

        w_out = jnp.asarray(r.normal(size=(b, t, n, hv)), dtype)
        w_lse = jnp.asarray(r.normal(size=(b, t, n)), stat_dt)

        def with_vjp(f):
            def g(diff):
                (out, lse), vjp = jax.vjp(f, diff)
                return out, lse, vjp((w_out, w_lse))[0]
            return jax.jit(g)

        out, lse, grads = with_vjp(sharded)(diff)
        want, want_lse, want_grads = with_vjp(unsharded)(diff)
        for label, got, exp in [("out", out, want), ("lse", lse, want_lse)] + list(
                zip(("dq", "dk", "dv") + (("dsinks",) if sinks else ()) + (("dbias",) if bias is not None else ()),
                    grads, want_grads)):
            got, exp = np.asarray(got, np.float64), np.asarray(exp, np.float64)
            assert got.shape == exp.shape, (name, label, got.shape, exp.shape)
            assert not np.isnan(exp).all(), (name, label)
            np.testing.assert_allclose(got, exp, atol=tol, rtol=tol, err_msg=f"{name}: {label}")
        print(f"ok {name} ({time.perf_counter() - start:.1f}s)", flush=True)

    def raises(name, exc, words, f, *args):
        try:
            f(*args)
        except exc as e:
            missing = [w for w in words if w not in str(e)]
            assert not missing, (name, missing, str(e))
            print(f"ok {name}: {type(e).__name__}", flush=True)
            return
        raise AssertionError(f"{name}: no {exc.__name__}")
    """
)


ULYSSES = textwrap.dedent(
    """
    seg = np.repeat(np.array([[0, 1, 1, 2], [3, 3, 4, 5]]), 4, axis=1)  # [2, 16]
    case("mha causal P=4", 4, is_causal=True)
    case("gqa K<P causal zigzag P=8 (N=8, K=2)", 8, n=8, kh=2, layout="zigzag", is_causal=True)
    case("gqa K>=P window+query_offset T!=S P=4 (N=8, K=4)", 4, n=8, kh=4, t=16, s=24,
         local_window_size=(3, 2), query_offset=5)
    case("query_offset array + causal + soft cap P=2", 2, query_offset=[3, -2], is_causal=True,
         logits_soft_cap=2.0)
    case("lengths + segment ids, causal P=4", 4, q_lengths=[13, 16], kv_lengths=[16, 9],
         segment_ids=seg, is_causal=True)
    case("segment id pair T!=S + kv lengths P=4", 4, t=16, s=32, kv_lengths=[30, 17],
         segment_ids=(seg, np.repeat(seg, 2, axis=1)))
    case("sinks, empty rows, GQA P=4 (N=8, K=2)", 4, n=8, kh=2, sinks=True, kv_lengths=[16, 0],
         is_causal=True)
    case("Hv != H, K not a multiple of P (N=6, K=3, P=2)", 2, n=6, kh=3, h=8, hv=4, is_causal=True)
    case("bias [1,N,T,S] + mask [B,1,1,S] P=4", 4, bias=(1, 4, 16, 16), mask=(2, 1, 1, 16))
    case("bias [N,1,S] + mask [B,1,T,S] zigzag causal P=2", 2, bias=(4, 1, 16), mask=(2, 1, 16, 16),
         layout="zigzag", is_causal=True)
    case("cpu kernels f32 causal GQA P=4 (N=4, K=2)", 4, n=4, kh=2, dtype=jnp.float32, impl="cpu",
         tol=2e-5, is_causal=True, local_window_size=(5, 0))

    # dropout over one device is the unsharded call (same keep-mask)
    mesh1 = Mesh(np.array(jax.devices()[:1]), ("sp",))
    q, k, v = inputs(0, 2, 16, 16, 4, 4, 8, 8, jnp.float32)
    key = jax.random.key(3)
    f1 = jax.jit(jax.shard_map(lambda q, k, v: jax_flash.ulysses_attention(
        q, k, v, axis_name="sp", dropout_rate=0.3, dropout_rng=key, implementation="xla"),
        mesh=mesh1, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp")))
    want = jax_flash.attention(q, k, v, dropout_rate=0.3, dropout_rng=key, implementation="xla")
    np.testing.assert_array_equal(np.asarray(f1(q, k, v)), np.asarray(want))
    print("ok dropout P=1 equals the unsharded call", flush=True)

    # collectives of the compiled forward+backward: all-to-alls, no all-gather of K/V
    mesh4 = Mesh(np.array(jax.devices()[:4]), ("sp",))
    q, k, v = inputs(1, 1, 64, 64, 8, 4, 8, 8, jnp.float32)
    f4 = jax.shard_map(lambda q, k, v: jax_flash.ulysses_attention(
        q, k, v, axis_name="sp", is_causal=True, implementation="xla"),
        mesh=mesh4, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))
    loss = lambda q, k, v: jnp.sum(f4(q, k, v) ** 2)
    fwd = jax.jit(f4).lower(q, k, v).compile().as_text()
    bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
    count = lambda txt, op: sum(1 for line in txt.splitlines() if f" {op}(" in line or f" {op}-start(" in line)
    assert count(fwd, "all-to-all") == 4 and count(fwd, "all-gather") == 0, (count(fwd, "all-to-all"), count(fwd, "all-gather"))
    assert count(bwd, "all-to-all") == 8 and count(bwd, "all-gather") == 0 and count(bwd, "collective-permute") == 0
    print(f"ok collectives: forward {count(fwd, 'all-to-all')} all-to-alls, forward+backward "
          f"{count(bwd, 'all-to-all')}, no all-gather", flush=True)
    """
)

HYBRID = textwrap.dedent(
    """
    seg = np.repeat(np.array([[0, 0, 1, 2], [3, 3, 3, 5]]), 4, axis=1)  # [2, 16]
    case("hybrid 2x2 zigzag causal GQA (N=4, K=2)", (2, 2), kh=2, layout="zigzag", is_causal=True)
    case("hybrid 2x4 (ring 2, a2a 4) window+query_offset, lengths, segment ids, K<P (N=8, K=2)",
         (2, 4), n=8, kh=2, local_window_size=(4, 1), query_offset=2, q_lengths=[16, 11],
         kv_lengths=[14, 16], segment_ids=seg)
    case("hybrid 4x2 (ring 4, a2a 2) zigzag causal, sinks, Hv != H, T=32", (4, 2), t=32, hv=4,
         sinks=True, layout="zigzag", is_causal=True, kv_lengths=[32, 0])
    case("hybrid 4x2 int64 lengths (global, beyond T), no mask", (4, 2), q_lengths=[40, 7],
         kv_lengths=[16, 13], len_dtype=jnp.int64)
    """
)

ERRORS = textwrap.dedent(
    """
    mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
    mesh2 = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("ring", "a2a"))
    SEQ, SEQ2 = P(None, "sp"), P(None, ("ring", "a2a"))
    x6 = jax.ShapeDtypeStruct((1, 16, 6, 8), jnp.float32)
    x4 = jax.ShapeDtypeStruct((1, 16, 4, 8), jnp.float32)

    def trace(f, mesh, spec, *shapes):
        return jax.eval_shape(jax.shard_map(f, mesh=mesh, in_specs=(spec,) * len(shapes),
                                            out_specs=spec), *shapes)

    uly = lambda **kw: (lambda q, k, v: jax_flash.ulysses_attention(q, k, v, axis_name="sp", **kw))
    raises("N % P", ValueError, ["N=6", "P=4", "'sp'", "ring_attention", "hybrid_attention"],
           trace, uly(), mesh, SEQ, x6, x6, x6)
    raises("hybrid N % Pa", ValueError, ["N=6", "P=4", "'a2a'", "ring_attention"], trace,
           lambda q, k, v: jax_flash.hybrid_attention(q, k, v, a2a_axis="a2a", ring_axis="ring"),
           mesh2, SEQ2, x6, x6, x6)
    raises("dropout P>1", NotImplementedError, ["dropout", "head"], trace,
           uly(dropout_rate=0.1, dropout_rng=jax.random.key(0)), mesh, SEQ, x4, x4, x4)
    raises("hybrid bias", NotImplementedError, ["bias"], trace,
           lambda q, k, v: jax_flash.hybrid_attention(q, k, v, a2a_axis="a2a", ring_axis="ring",
                                                      bias=jnp.zeros((1, 4, 2, 16))),
           mesh2, SEQ2, x4, x4, x4)
    raises("hybrid dropout", NotImplementedError, ["dropout"], trace,
           lambda q, k, v: jax_flash.hybrid_attention(q, k, v, a2a_axis="a2a", ring_axis="ring",
                                                      dropout_rate=0.1, dropout_rng=jax.random.key(0)),
           mesh2, SEQ2, x4, x4, x4)
    raises("unbound axis", ValueError, ["'seq'", "shard_map"], trace,
           lambda q, k, v: jax_flash.ulysses_attention(q, k, v, axis_name="seq"), mesh, SEQ, x4, x4, x4)
    raises("bias of local keys", ValueError, ["bias", "global key length"], trace,
           uly(bias=jnp.zeros((1, 4, 4, 4))), mesh, SEQ, x4, x4, x4)
    raises("sinks shape", ValueError, ["sinks", "(4,)"], trace, uly(sinks=jnp.zeros(2)), mesh, SEQ,
           x4, x4, x4)
    raises("zigzag odd chunk", ValueError, ["zigzag"], trace, uly(layout="zigzag"), mesh, SEQ,
           *(jax.ShapeDtypeStruct((1, 12, 4, 8), jnp.float32),) * 3)
    """
)


def _run(body: str, timeout: int = 600) -> str:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", PRELUDE + body + "\nprint('done')\n"], env=env,
                       cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0 and r.stdout.strip().endswith("done"), r.stdout + r.stderr[-6000:]
    return r.stdout


def test_ulysses_equals_unsharded():
    out = _run(ULYSSES)
    assert out.count("ok ") == 13, out


def test_hybrid_equals_unsharded_on_2x2_2x4_4x2():
    out = _run(HYBRID)
    assert out.count("ok ") == 4, out


def test_errors():
    out = _run(ERRORS)
    assert out.count("ok ") == 9, out


@pytest.mark.parametrize("n,kh,p", [(8, 2, 4), (8, 1, 8), (8, 4, 2), (8, 8, 4), (6, 3, 2), (12, 6, 4), (12, 4, 6)])
def test_expanded_kv_heads_serve_each_devices_query_heads(n, kh, p):
    """After the repeat, device d's block of kv heads is exactly what its query heads use,
    with the local grouping N/K' of the local call; no device holds all K when gcd(K, P) > 1."""
    k = np.arange(kh, dtype=np.float32).reshape(1, 1, kh, 1)
    kx = np.asarray(_expand_kv(k, p))[0, 0, :, 0]
    kp = kx.shape[0]
    assert kp == math.lcm(kh, p) and kp % p == 0 and n % kp == 0
    for d in range(p):
        local = kx[d * kp // p:(d + 1) * kp // p]
        for i in range(n // p):
            global_head = d * n // p + i
            assert local[i // (n // kp)] == global_head // (n // kh)
        if math.gcd(kh, p) > 1:
            assert len(set(local.tolist())) < kh
