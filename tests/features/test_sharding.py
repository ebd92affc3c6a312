"""Sharded inputs under plain `jax.jit` (and `shard_map`), on eight host devices.

Each implementation's checks run in one subprocess (the device count is fixed when JAX
starts). For every layout — batch-sharded, head-sharded (GQA), batch x head on a 2-D mesh,
query heads only (GQA, K/V replicated), queries over T (with lengths and segment ids, and
causal with per-row query offsets), the whole sequence (Q and K/V over T and S, on a
batch x seq mesh) and a batch-broadcast dense bias — forward and gradients equal the
unsharded call, and the compiled HLO is counted for collectives: none at all for batch and
heads; for query heads only, query shards and the broadcast bias the backward may only
all-reduce (dK/dV and dbias are sums over shards); the sequence-sharded call runs ring
attention inside the partitioned call (collective-permutes only, no all-gather of K/V).
What cannot be partitioned (K/V over S with replicated queries, a sharded head dim) falls
back to an all-gather with exactly one `ShardingFallbackWarning` per cause.
The rules are one module for every compiled implementation: `cpu` and `cuda` run every
layout, the interpreted `pallas` the batch, whole-sequence (ring) and bias layouts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    r"""
    import re, sys, warnings
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    jax.config.update("jax_enable_x64", True)
    impl, partitioner = sys.argv[1], sys.argv[2]
    if partitioner == "gspmd":
        jax.config.update("jax_use_shardy_partitioner", False)
    import jax_flash
    from jax_flash.parallel import partitioning

    plain_xla = impl == "xla"
    # The fallbacks are decided before any kernel runs: checked on cpu (fast) only.
    fallbacks = impl == "cpu"
    # The sharding rules are one module for every compiled implementation (cpu and cuda run
    # every layout); the interpreted pallas kernels run one layout of each kind of rule
    # (collective-free batch, the ring, the summed dbias), each compile minutes of CI time.
    every_layout = impl != "pallas"

    assert jax.device_count() == 8, jax.devices()
    devs = np.array(jax.devices())
    bf16 = impl == "cuda"
    dt = jnp.bfloat16 if bf16 else jnp.float32
    tol = 2e-2 if bf16 else 2e-5
    H = 32 if impl in ("cuda", "pallas") else 16
    COLL = re.compile(
        r"\b(all-gather|all-reduce|all-to-all|reduce-scatter|collective-permute)(?:-start)?\(")

    def compiled(f, *args):
        # The compiled call and its collectives, counted on op names in the HLO.
        c = jax.jit(f).lower(*args).compile()
        counts = {}
        for m in COLL.finditer(c.as_text()):
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
        return c, counts

    def data(b, t, s, n, kh, seed):
        ks = jax.random.split(jax.random.PRNGKey(seed), 4)
        q = (jax.random.normal(ks[0], (b, t, n, H)) + 0.3).astype(dt)
        k = jax.random.normal(ks[1], (b, s, kh, H)).astype(dt)
        v = (jax.random.normal(ks[2], (b, s, kh, H)) - 0.2).astype(dt)
        w = jax.random.normal(ks[3], (b, t, n, H)).astype(jnp.float32)  # output weights
        return q, k, v, w

    def close(got, want, what):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.all(np.isfinite(got)), what
        err = float(np.max(np.abs(got - want)))
        assert err <= tol * (1 + float(np.max(np.abs(want)))), f"{what}: max error {err}"

    def check(name, mesh, q_spec, kv_spec, f, arrays, specs, expect, argnums=(0, 1, 2)):
        # f(q, k, v, *arrays) -> out, arrays sharded by `specs`. expect: the collectives
        # allowed: "none" (forward and backward), "sums" (the backward may all-reduce),
        # "gathered" (a fallback: both all-gather), "ring" (collective-permutes only),
        # None (not checked).
        q, k, v, w = data(*SHAPES[name], seed=len(name))
        loss = lambda q, k, v, *a: jnp.sum(f(q, k, v, *a).astype(jnp.float32) * w)
        grad = jax.grad(loss, argnums)
        want = jax.jit(f)(q, k, v, *arrays)
        want_g = jax.jit(grad)(q, k, v, *arrays)
        put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
        args = (put(q, q_spec), put(k, kv_spec), put(v, kv_spec),
                *(put(a, s) for a, s in zip(arrays, specs)))
        (cf, fwd), (cg, bwd) = compiled(f, *args), compiled(grad, *args)
        close(cf(*args), want, f"{name} forward")
        for i, g, gw in zip(argnums, cg(*args), want_g):
            close(g, gw, f"{name} gradient of argument {i}")
        print(f"{sys.argv[1]} {partitioner} {name}: forward {fwd}, forward+backward {bwd}")
        if expect == "none":
            assert fwd == {} and bwd == {}, (name, fwd, bwd)
        elif expect == "sums":
            assert fwd == {} and set(bwd) <= {"all-reduce"}, (name, fwd, bwd)
        elif expect == "gathered":
            assert "all-gather" in fwd and "all-gather" in bwd, (name, fwd, bwd)
        elif expect == "ring":
            assert set(fwd) == set(bwd) == {"collective-permute"}, (name, fwd, bwd)

    # (B, T, S, N, K) per case.
    SHAPES = {"batch": (4, 24, 40, 4, 2), "heads": (2, 24, 24, 8, 4), "2d": (2, 24, 24, 8, 4),
              "query heads": (2, 24, 24, 8, 2), "T": (2, 32, 40, 2, 1), "T causal": (2, 32, 32, 2, 2),
              "S": (2, 32, 32, 4, 2), "bias": (4, 24, 24, 2, 2),
              "S only": (2, 8, 32, 2, 2), "H": (2, 16, 16, 2, 2)}

    mesh4 = lambda name: Mesh(devs[:4], (name,))
    heads = P(None, None, "heads")

    def rules():
        if not every_layout:
            return ring_and_bias()
        # Query heads sharded, K = 2 kv heads replicated: each device slices its kv head;
        # the backward all-reduces dK/dV over the head axis.
        sinks = jnp.linspace(-1.0, 2.5, 8, dtype=jnp.float32)  # sharded with the query heads
        f = lambda q, k, v, sinks: jax_flash.attention(q, k, v, sinks=sinks, implementation=impl)
        check("query heads", mesh4("heads"), heads, P(), f, (sinks,), (P("heads"),), "sums",
              argnums=(0, 1, 2, 3))

        # Queries over T, K/V replicated: shard-local query lengths and segment ids.
        qlens = jnp.asarray([29, 6], jnp.int32)
        seg_q = (jnp.arange(32)[None, :] // 5).repeat(2, 0).astype(jnp.int32)
        seg_k = (jnp.arange(40)[None, :] // 6).repeat(2, 0).astype(jnp.int32)
        f = lambda q, k, v, ql, sq, sk: jax_flash.attention(
            q, k, v, query_seq_lengths=ql, segment_ids=(sq, sk), implementation=impl)
        check("T", mesh4("seq"), P(None, "seq"), P(), f, (qlens, seg_q, seg_k),
              (P(), P(None, "seq"), P()), "sums")

        # Causal queries over T: each shard's query offset on top of the user's per-row one.
        offset = jnp.asarray([0, 5], jnp.int32)
        f = lambda q, k, v, off: jax_flash.attention(q, k, v, is_causal=True, query_offset=off,
                                                     implementation=impl)
        check("T causal", mesh4("seq"), P(None, "seq"), P(), f, (offset,), (P(),), "sums")

        ring_and_bias()

        if fallbacks:
            # Gathered, reported once per cause: K/V over S with the queries not sharded
            # over the same axis (the ring needs both), and a sharded head dim.
            f = lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True,
                                                    implementation=impl)
            check("S only", mesh4("seq"), P(), P(None, "seq"), f, (), (), "gathered")
            model = P(None, None, None, "model")
            check("H", mesh4("model"), model, model, f, (), (), "gathered")

    def ring_and_bias():
        # Q, K/V all sharded over the sequence (and the batch, a 2-D mesh): ring attention
        # inside the partitioned call, collective-permutes only (no all-gather of K/V).
        offset = jnp.asarray([0, 5], jnp.int32)
        lens = jnp.asarray([32, 19], jnp.int32)
        seg = (jnp.arange(32)[None, :] // 11 + jnp.arange(2)[:, None]).astype(jnp.int32)
        # The ring forced (the rule would run the all-to-all here: tests/features/
        # test_sequence_parallel.py checks the rule and the other schemes).
        ring = jax_flash.Config(sequence_parallel="ring")
        f = lambda q, k, v, lens, seg, off: jax_flash.attention(
            q, k, v, is_causal=True, key_value_seq_lengths=lens, segment_ids=seg,
            query_offset=off, implementation=impl, config=ring)
        mesh_bs = Mesh(devs.reshape(2, 4), ("batch", "seq"))
        check("S", mesh_bs, P("batch", "seq"), P("batch", "seq"), f, (lens, seg, offset),
              (P("batch"), P("batch", "seq"), P("batch")), "ring")

        if impl != "xla":
            # A dense bias broadcast over the batch: dbias sums over the batch shards.
            bias = jax.random.normal(jax.random.PRNGKey(7), (1, 2, 24, 24), jnp.float32)
            f = lambda q, k, v, bias: jax_flash.attention(q, k, v, bias=bias.astype(dt),
                                                          implementation=impl)
            check("bias", mesh4("batch"), P("batch"), P("batch"), f, (bias,), (P(),), "sums",
                  argnums=(0, 1, 2, 3))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        # Batch: lengths and segment ids shard with the batch.
        b = SHAPES["batch"][0]
        lens = jnp.asarray([40, 3, 17, 0], jnp.int32)
        seg_q = (jnp.arange(24)[None, :] // 7 + jnp.arange(b)[:, None]).astype(jnp.int32)
        seg_k = (jnp.arange(40)[None, :] // 11 + jnp.arange(b)[:, None]).astype(jnp.int32)
        f = lambda q, k, v, lens, sq, sk: jax_flash.attention(
            q, k, v, key_value_seq_lengths=lens, segment_ids=(sq, sk), is_causal=True,
            implementation=impl)
        check("batch", mesh4("batch"), P("batch"), P("batch"), f, (lens, seg_q, seg_k),
              (P("batch"),) * 3, "none")

        # Heads, GQA (K = 4 kv heads for N = 8), local window; sinks shard with the heads.
        sinks = jnp.linspace(-1.0, 2.5, 8, dtype=jnp.float32)
        f = lambda q, k, v, sinks: jax_flash.attention(
            q, k, v, local_window_size=(5, 2), sinks=sinks, implementation=impl)
        if every_layout:
            check("heads", mesh4("heads"), heads, heads, f, (sinks,), (P("heads"),), "none",
                  argnums=(0, 1, 2, 3))

        # Batch x heads on a 2-D mesh, causal with ragged query lengths.
        mesh2 = Mesh(devs.reshape(2, 4), ("batch", "heads"))
        bh = P("batch", None, "heads")
        qlens = jnp.asarray([24, 9], jnp.int32)
        f = lambda q, k, v, ql: jax_flash.attention(
            q, k, v, query_seq_lengths=ql, is_causal=True, implementation=impl)
        if every_layout:
            check("2d", mesh2, bh, bh, f, (qlens,), (P("batch"),), "none")

        # XLA partitions plain JAX itself: batch and heads collective-free (above), its
        # other layouts are XLA's choice. The rules of the compiled calls:
        if not plain_xla:
            rules()

    ours = [str(w.message) for w in caught
            if issubclass(w.category, partitioning.ShardingFallbackWarning)]
    for text in ours:
        print("warning:", text)
    if fallbacks:
        # Once per cause, though each is met in several compiles (forward and backward).
        s_warn = [t for t in ours if "key/value sequence axis S" in t and "'seq'" in t]
        h_warn = [t for t in ours if "head dim H" in t and "'model'" in t]
        assert len(s_warn) == len(h_warn) == 1 and len(ours) == 2, ours
    else:
        assert not ours, ours
    print("ok")
    """
)


def _run(impl, partitioner):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, impl, partitioner], env=env, capture_output=True, text=True, timeout=900
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
    print(r.stdout)


def test_sharded_under_jit(impl):
    """Shardy (the default partitioner): sharding rules."""
    _run(impl, "shardy")


def test_sharded_under_jit_gspmd():
    """GSPMD (jax_use_shardy_partitioner=False) drives the partition/infer callbacks."""
    from conftest import availability

    why = availability("cpu")
    if why is not None:
        pytest.skip(f"cpu unavailable here: {why}")
    _run("cpu", "gspmd")


SHARD_MAP_SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_flash

    impl = sys.argv[1]
    assert jax.device_count() == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    dt = jnp.bfloat16 if impl == "cuda" else jnp.float32
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(k1, (4, 24, 4, 64)).astype(dt)
    k = jax.random.normal(k2, (4, 40, 2, 64)).astype(dt)
    v = jax.random.normal(k3, (4, 40, 2, 64)).astype(dt)
    lens = jnp.asarray([40, 3, 17, 0], jnp.int32)
    f = lambda q, k, v, lens: jax_flash.attention(
        q, k, v, key_value_seq_lengths=lens, is_causal=True, implementation=impl)
    want = jax.jit(f)(q, k, v, lens)
    tol = 1e-2 if dt == jnp.bfloat16 else 1e-5

    shard = NamedSharding(mesh, P("batch"))
    args = [jax.device_put(x, shard) for x in (q, k, v, lens)]
    smap = getattr(jax, "shard_map", None)
    if smap is None:
        from jax.experimental.shard_map import shard_map as smap
    kwargs = dict(mesh=mesh, in_specs=(P("batch"),) * 4, out_specs=P("batch"))
    try:
        g = smap(f, check_vma=False, **kwargs)
    except TypeError:
        g = smap(f, check_rep=False, **kwargs)
    got = jax.jit(g)(*args)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol)

    loss = lambda q, k, v: jnp.sum(jax.jit(g)(q, k, v, args[3]).astype(jnp.float32))
    dq = jax.grad(loss)(*args[:3])
    dq_want = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v, lens).astype(jnp.float32)))(q, k, v)
    np.testing.assert_allclose(np.asarray(dq, np.float32), np.asarray(dq_want, np.float32), atol=tol)

    # The default shard_map (check_vma=True) with queries sharded over the sequence and K/V
    # gathered, the same on every device: the results vary like the queries and the
    # cotangents of K/V are the sums of every device's part (interpret-mode pallas_call
    # does not take check_vma, see TOOLCHAIN).
    if impl != "pallas":
        seq = Mesh(np.array(jax.devices()), ("seq",))
        full = lambda q, k, v, lens: jax_flash.attention(
            q, k, v, key_value_seq_lengths=lens, implementation=impl)
        def body(q, k, v, lens):
            gather = lambda x: jax.lax.all_gather(x, "seq", axis=1, tiled=True)
            return full(q, gather(k), gather(v), lens)
        h = smap(body, mesh=seq, in_specs=(P(None, "seq"),) * 3 + (P(),), out_specs=P(None, "seq"))
        cot = jax.random.normal(jax.random.PRNGKey(9), q.shape).astype(dt)
        loss = lambda fn: lambda q, k, v: jnp.sum((fn(q, k, v, lens) * cot).astype(jnp.float32))
        got = jax.jit(jax.grad(loss(h), (0, 1, 2)))(q, k, v)
        want = jax.jit(jax.grad(loss(full), (0, 1, 2)))(q, k, v)
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                       atol=5 * tol, err_msg=name)
    print("ok")
    """
)


def test_shard_map(impl):
    """Inside shard_map (every mesh axis manual) the calls run unpartitioned on the shards."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    r = subprocess.run(
        [sys.executable, "-c", SHARD_MAP_SCRIPT, impl], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def test_vmap_folds_a_broadcast_bias():
    """Under vmap the partitioned calls fold the mapped axis into the batch (custom_partitioning
    has no batching rule): a bias broadcast over the batch, unbatched or batched, keeps its
    per-instance gradient (pallas against xla)."""
    import jax
    import jax.numpy as jnp

    import jax_flash
    from conftest import availability

    why = availability("pallas")
    if why is not None:
        pytest.skip(f"pallas unavailable here: {why}")
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    v_, b, t, n, h = 2, 2, 16, 2, 16
    q, k, v = (jax.random.normal(key, (v_, b, t, n, h), jnp.float32) for key in ks[:3])
    mask = jax.random.uniform(ks[3], (1, 1, t, t)) > 0.2

    def loss(q, k, v, bias, impl):
        o = jax_flash.attention(q, k, v, bias=bias, mask=mask, implementation=impl)
        return jnp.sum(o * jnp.cos(o))

    for bias, axis in (
        (jax.random.normal(ks[4], (1, n, t, t), jnp.float32), None),
        (jax.random.normal(ks[4], (v_, 1, 1, t, t), jnp.float32), 0),
    ):
        g = jax.vmap(jax.value_and_grad(loss, (0, 1, 2, 3)), in_axes=(0, 0, 0, axis, None))
        got = jax.jit(g, static_argnums=4)(q, k, v, bias, "pallas")
        want = jax.jit(g, static_argnums=4)(q, k, v, bias, "xla")
        assert got[1][3].shape == (v_, *bias.shape[(0 if axis is None else 1) :])
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert x.shape == y.shape
            assert float(jnp.max(jnp.abs(x - y))) < 1e-4 * (1 + float(jnp.max(jnp.abs(y))))
