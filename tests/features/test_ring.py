"""Ring attention (context parallelism) inside `jax.shard_map` on 2, 4 and 8 host devices,
against `jax_flash.reference` on the gathered arrays.

Each test runs one subprocess (the device count is fixed when JAX starts) that checks many
cases; a case prints one line and a failing one raises with its name.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jax_flash.parallel.ring import block_counts

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Shared by every subprocess: one case = one ring configuration checked against the
# reference (f64 for xla, f32 for cpu): out and lse, and the VJP of a random-weighted loss
# of both (so dlse is exercised too); optionally jax.test_util.check_grads.
PRELUDE = textwrap.dedent(
    """
    import sys, time
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import jax.test_util
    import jax_flash

    jax.config.update("jax_enable_x64", True)
    assert jax.device_count() == 8, jax.devices()
    SEQ = P(None, "sp")

    def shard_map(f, mesh, in_specs, out_specs):
        # The default check_vma=True: the ring's loop carries are typed as varying over
        # the mesh axis like its inputs.
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)

    def inputs(seed, b, t, s, n, kh, h, dtype, hv=None):
        r = np.random.default_rng(seed)
        q = r.normal(size=(b, t, n, h)) + 0.3  # off-zero mean: P·V is not ~0
        k = r.normal(size=(b, s, kh, h)) - 0.2
        v = r.normal(size=(b, s, kh, h if hv is None else hv)) + 0.5  # value head dim Hv
        return [jnp.asarray(x, dtype) for x in (q, k, v)]

    def case(name, p, layout="contiguous", b=2, t=16, s=None, n=2, kh=None, h=8,
             dtype=jnp.float64, impl="xla", tol=1e-9, grad_tol=None, check_grads=False,
             q_lengths=None, kv_lengths=None, segment_ids=None, hv=None, length_dtype=jnp.int32, **kw):
        start = time.perf_counter()
        s = t if s is None else s
        kh = n if kh is None else kh
        mesh = Mesh(np.array(jax.devices()[:p]), ("sp",))
        q, k, v = inputs(len(name), b, t, s, n, kh, h, dtype, hv)
        zz = layout == "zigzag"
        tr = (lambda x: jax_flash.zigzag(x, p)) if zz else (lambda x: x)
        un = (lambda x: jax_flash.unzigzag(x, p)) if zz else (lambda x: x)
        ql = None if q_lengths is None else jnp.asarray(q_lengths, length_dtype)
        kl = None if kv_lengths is None else jnp.asarray(kv_lengths, length_dtype)
        pair = isinstance(segment_ids, tuple)
        qs = ks = None
        if segment_ids is not None:
            qs, ks = (jnp.asarray(x, jnp.int32) for x in (segment_ids if pair else (segment_ids,) * 2))

        def seg_arg(qs, ks):
            if qs is None:
                return None
            return (qs, ks) if pair else qs

        def local(q, k, v, ql, kl, qs, ks):
            return jax_flash.ring_attention(
                q, k, v, axis_name="sp", layout=layout, implementation=impl,
                query_seq_lengths=ql, key_value_seq_lengths=kl, segment_ids=seg_arg(qs, ks),
                return_residual=True, **kw)

        seq = lambda x: None if x is None else SEQ
        rep = lambda x: None if x is None else P()
        ring = shard_map(local, mesh, (SEQ, SEQ, SEQ, rep(ql), rep(kl), seq(qs), seq(ks)),
                         (SEQ, SEQ))
        masks = (ql, kl, None if qs is None else tr(qs), None if ks is None else tr(ks))

        def ring_global(q, k, v):
            out, lse = ring(tr(q), tr(k), tr(v), *masks)
            return un(out), un(lse)

        def ref_global(q, k, v):
            return jax_flash.reference(
                q, k, v, query_seq_lengths=ql, key_value_seq_lengths=kl,
                segment_ids=seg_arg(qs, ks), return_residual=True,
                compute_dtype=jnp.float64, **kw)

        r = np.random.default_rng(1)
        w_out = jnp.asarray(r.normal(size=q.shape[:-1] + v.shape[-1:]), dtype)
        w_lse = jnp.asarray(r.normal(size=(b, t, n)), jnp.float32 if dtype != jnp.float64 else dtype)

        def with_vjp(f):
            def g(q, k, v):
                (out, lse), vjp = jax.vjp(f, q, k, v)
                return out, lse, vjp((w_out.astype(out.dtype), w_lse.astype(lse.dtype)))
            return jax.jit(g)

        out, lse, grads = with_vjp(ring_global)(q, k, v)
        f64 = [x.astype(jnp.float64) for x in (q, k, v)]
        want, want_lse, want_grads = with_vjp(ref_global)(*f64)
        assert not np.isnan(np.asarray(out)).any(), name
        np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=tol, rtol=tol,
                                   err_msg=name + ": out")
        np.testing.assert_allclose(np.asarray(lse, np.float64), want_lse, atol=tol, rtol=tol,
                                   err_msg=name + ": lse")
        gt = tol if grad_tol is None else grad_tol
        for label, got, exp in zip(("dq", "dk", "dv"), grads, want_grads):
            assert not np.isnan(np.asarray(got)).any(), name + label
            np.testing.assert_allclose(np.asarray(got, np.float64), exp, atol=gt, rtol=gt,
                                       err_msg=f"{name}: {label}")
        if check_grads:
            jax.test_util.check_grads(jax.jit(lambda q, k, v: ring_global(q, k, v)[0]),
                                      (q, k, v), order=1, modes=["rev"])
        print(f"ok {name} ({time.perf_counter() - start:.1f}s)", flush=True)
    """
)

# Positions, lengths and segment ids: every mask kind on 2, 4 and 8 devices, both layouts.
MASKS = textwrap.dedent(
    """
    B = 2
    # Segment ids that cross every chunk boundary (runs of 5 and 3 over 32 positions) and a
    # second row with one long segment then short ones.
    seg32 = np.stack([np.arange(32) // 5, np.minimum(np.arange(32) // 3, 4) + 7])
    case("full p2 gqa", 2, n=4, kh=2, check_grads=True)
    case("causal p2 zigzag", 2, "zigzag", is_causal=True, check_grads=True)
    case("causal p4 contiguous", 4, t=32, is_causal=True)
    case("causal p4 zigzag gqa", 4, "zigzag", t=32, n=6, kh=2, is_causal=True)
    case("causal p8 zigzag", 8, "zigzag", t=32, is_causal=True, scale=0.3)
    case("causal p8 contiguous softcap", 8, t=32, is_causal=True, logits_soft_cap=2.0)
    case("ragged p4 contiguous", 4, t=32, q_lengths=[21, 0], kv_lengths=[9, 32],
         is_causal=True)
    case("ragged p4 zigzag", 4, "zigzag", t=32, q_lengths=[32, 5], kv_lengths=[30, 17],
         is_causal=True, check_grads=True)
    # 64-bit lengths (jnp.asarray's default with x64) count the global sequence, past it too.
    case("ragged p4 int64 lengths", 4, t=32, q_lengths=[29, 40], kv_lengths=[2**40, 13],
         length_dtype=jnp.int64, is_causal=True)
    case("segments p4 contiguous", 4, t=32, segment_ids=seg32, is_causal=True)
    case("segments p8 zigzag ragged", 8, "zigzag", t=32, segment_ids=seg32,
         kv_lengths=[27, 32], is_causal=True)
    case("segments pair t!=s p2 full", 2, t=16, s=32, n=4, kh=1,
         segment_ids=(seg32[:, :16], np.sort(seg32, axis=1)))
    case("t!=s p4 full zigzag gqa", 4, "zigzag", t=16, s=32, n=4, kh=2, kv_lengths=[32, 11])
    case("value head dim hv!=h p2 zigzag causal gqa", 2, "zigzag", n=4, kh=2, h=12, hv=8,
         is_causal=True, kv_lengths=[16, 11])
    """
)

# Blocks at non-zero relative offsets need `MaskInputs.q_offset`: windows, T != S causal.
OFFSETS = textwrap.dedent(
    """
    case("window p4 contiguous", 4, t=32, local_window_size=(5, 3), check_grads=True)
    case("window p8 zigzag causal", 8, "zigzag", t=32, local_window_size=(6, 0),
         is_causal=True)
    case("causal t<s p4 contiguous", 4, t=16, s=32, is_causal=True)
    case("causal t>s p2 zigzag gqa", 2, "zigzag", t=32, s=16, n=4, kh=2, is_causal=True,
         kv_lengths=[16, 9])
    case("bottom-right causal t<s p4 zigzag", 4, "zigzag", t=16, s=32, is_causal=True,
         query_offset=16)
    case("per-row offsets window p4", 4, t=32, query_offset=np.array([3, -5]),
         local_window_size=(4, 2), q_lengths=[32, 29])
    """
)

# The compiled `cpu` kernels as the block implementation (float32), a few cases.
CPU = textwrap.dedent(
    """
    seg32 = np.stack([np.arange(32) // 5, np.arange(32) // 9])
    case("cpu causal p4 zigzag segments", 4, "zigzag", t=32, n=4, kh=2, h=16,
         dtype=jnp.float32, impl="cpu", tol=2e-5, segment_ids=seg32, is_causal=True,
         kv_lengths=[32, 23])
    case("cpu full p2 ragged", 2, t=32, h=16, dtype=jnp.float32, impl="cpu", tol=2e-5,
         q_lengths=[30, 7], logits_soft_cap=3.0)
    case("cpu value head dim hv!=h p2 causal", 2, t=32, h=24, hv=40, dtype=jnp.float32,
         impl="cpu", tol=2e-5, is_causal=True)
    case("cpu window t<s p4 contiguous", 4, t=16, s=32, h=16, dtype=jnp.float32,
         impl="cpu", tol=2e-5, local_window_size=(7, 2), is_causal=True, query_offset=16)
    """
)


# The compiled program: transfers issued before the block compute they overlap, no gather
# of K/V, per-device temporary memory O(T/P); and argument errors.
COMPILED = textwrap.dedent(
    r"""
    import re

    def ring_fn(p, impl, **kw):
        mesh = Mesh(np.array(jax.devices()[:p]), ("sp",))
        f = lambda q, k, v: jax_flash.ring_attention(q, k, v, axis_name="sp",
                                                     implementation=impl, **kw)
        return shard_map(f, mesh, (SEQ,) * 3, SEQ)

    def computations(hlo):
        # name -> list of op names in schedule order (compiled modules are scheduled).
        comps, name = {}, None
        for line in hlo.splitlines():
            m = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
            if m:
                name = "ENTRY" if line.startswith("ENTRY") else m.group(1)
                comps[name] = []
                continue
            m = re.search(r"= .*? ([a-z][a-z0-9-]*)\(", line)
            if name and m:
                op = m.group(1)
                if op == "custom-call":
                    op = "custom-call:" + re.search(r'custom_call_target="([^"]+)"', line).group(1)
                comps[name].append(op)
        return comps

    COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter")

    # Forward and forward+backward, causal, 4 devices, the cpu kernels (their custom calls
    # are the block compute). Collective-permute precedes the compute it overlaps: in the
    # entry computation (step 0) and in the ring loop's body (the middle steps).
    q = jnp.ones((1, 64, 2, 16), jnp.float32)
    g = ring_fn(4, "cpu", is_causal=True)
    for label, fn, target in (
        ("fwd", g, "jax_flash_fwd"),
        ("fwdbwd", jax.grad(lambda q, k, v: g(q, k, v).sum(), (0, 1, 2)), "jax_flash_bwd"),
    ):
        hlo = jax.jit(fn).lower(q, q, q).compile().as_text()
        comps = computations(hlo)
        ops = [o for c in comps.values() for o in c]
        for c in COLLECTIVES:
            assert not any(o.startswith(c) for o in ops), (label, c)
        entry = comps["ENTRY"]
        cp = [i for i, o in enumerate(entry) if o.startswith("collective-permute")]
        calls = [i for i, o in enumerate(entry) if o == "custom-call:" + target]
        assert cp and calls and cp[0] < calls[0], (label, entry)
        bodies = [b for b in re.findall(r"body=%([\w.-]+)", hlo)]
        assert bodies, label
        body = comps[bodies[0]]
        cp = [i for i, o in enumerate(body) if o.startswith("collective-permute")]
        compute = [i for i, o in enumerate(body) if o == "conditional"]
        assert cp and compute and cp[0] < compute[0], (label, body)
        print("ok hlo", label, flush=True)

    # Per-device temporary memory at a fixed global T shrinks like 1/P (the cpu kernels keep
    # their scratch outside XLA, so the figure is the ring's own buffers).
    B, T, N, H = 1, 2048, 4, 64
    q = jnp.ones((B, T, N, H), jnp.float32)
    temps = {}
    for p in (2, 8):
        g = ring_fn(p, "cpu", is_causal=True)
        chunk = q.nbytes // p
        fb = jax.grad(lambda q, k, v: g(q, k, v).sum(), (0, 1, 2))
        for label, fn, limit in (("fwd", g, 6), ("fwdbwd", fb, 12)):
            temp = jax.jit(fn).lower(q, q, q).compile().memory_analysis().temp_size_in_bytes
            temps[p, label] = temp
            print(f"temp p={p} {label}: {temp / chunk:.2f} chunks", flush=True)
            assert temp <= limit * chunk, (p, label, temp, chunk)
    for label in ("fwd", "fwdbwd"):
        assert temps[8, label] < temps[2, label] / 2, temps
    print("ok memory", flush=True)

    # Errors name the argument.
    def raises(exc, match, fn):
        try:
            fn()
        except exc as e:
            assert re.search(match, str(e)), (match, str(e))
            return
        raise AssertionError(f"no {exc.__name__} matching {match!r}")

    q = jnp.ones((1, 16, 2, 8))
    raises(ValueError, "layout", lambda: ring_fn(2, "xla", layout="striped")(q, q, q))
    raises(ValueError, "zigzag.*even", lambda: ring_fn(8, "xla", layout="zigzag")(
        jnp.ones((1, 24, 2, 8)), jnp.ones((1, 24, 2, 8)), jnp.ones((1, 24, 2, 8))))
    raises(ValueError, "axis_name 'nope'", lambda: shard_map(
        lambda q: jax_flash.ring_attention(q, q, q, axis_name="nope"),
        Mesh(np.array(jax.devices()[:2]), ("sp",)), (SEQ,), SEQ)(q))
    raises(TypeError, "axis_name", lambda: jax_flash.ring_attention(q, q, q, axis_name=3))
    raises(ValueError, "implementation must be", lambda: ring_fn(2, "tpu")(q, q, q))
    print("ok errors", flush=True)
    """
)


# Second derivatives: the jax_flash NotImplementedError of attention, at trace time, for the
# compiled blocks (cpu: an FFI call) and the xla ones (dynamic loops). Empty inputs: what
# jax_flash.attention gives on the gathered arrays (shapes, dtypes, values, gradients).
EDGES = textwrap.dedent(
    """
    mesh = Mesh(np.array(jax.devices()[:2]), ("sp",))

    def ring(impl, **kw):
        f = lambda q, k, v: jax_flash.ring_attention(q, k, v, axis_name="sp", implementation=impl,
                                                     return_residual=True, **kw)
        return shard_map(f, mesh, (SEQ,) * 3, (SEQ, SEQ))

    def loss(f):
        return lambda q, k, v: sum(jnp.sum(jnp.where(jnp.isfinite(x), x, 0) * 0.7) for x in f(q, k, v))

    q, k, v = inputs(0, 1, 8, 8, 2, 1, 8, jnp.float32)
    for impl in ("xla", "cpu"):
        g = loss(ring(impl, is_causal=True))
        first = jax.grad(g)(q, k, v)  # once: fine
        assert np.isfinite(np.asarray(first)).all(), impl
        for label, fn in (
            ("grad of grad", lambda: jax.grad(lambda q: jnp.sum(jax.grad(g)(q, k, v)))(q)),
            ("hessian", lambda: jax.hessian(lambda q: g(q, k, v))(q)),
        )[: 2 if impl == "xla" else 1]:
            try:
                jax.jit(fn)()
            except NotImplementedError as e:
                assert "ring_attention" in str(e) and "differentiable once" in str(e), (impl, label, e)
            else:
                raise AssertionError(f"{impl} {label}: no NotImplementedError")
        print("ok second order", impl, flush=True)

    # (B, T, S, N, K): B = 0, T = 0, S = 0, N = 0 (K = 1).
    for impl in ("xla", "cpu"):
        shapes = ((0, 4, 4, 2, 1), (1, 0, 4, 2, 1), (1, 4, 0, 2, 1), (2, 4, 4, 0, 1))
        for b, t, s, n, kh in shapes if impl == "xla" else shapes[1:3]:
            q, k, v = inputs(1, b, t, s, n, kh, 8, jnp.float32)
            r = ring(impl, is_causal=True)
            a = lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True, implementation=impl,
                                                    return_residual=True)
            ct = jnp.asarray(np.random.default_rng(2).normal(size=q.shape), jnp.float32) + 1
            for label, f in (("ring", r), ("attention", a)):
                def step(q, k, v, f=f):
                    (out, lse), vjp = jax.vjp(f, q, k, v)
                    return (out, lse) + vjp((ct, jnp.ones_like(lse)))
                res = jax.jit(step)(q, k, v)
                if label == "ring":
                    got = res
                else:
                    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), got, res):
                        assert x.shape == y.shape and x.dtype == y.dtype, (impl, b, t, s, n, name, x, y)
                        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{impl} {name}")
            if s == 0:
                assert np.all(np.asarray(got[1]) == -np.inf) and not np.asarray(got[0]).any()
        print("ok empty", impl, flush=True)
    # An empty ring still refuses an implementation that cannot make the call (cuda: float32).
    q, k, v = inputs(1, 1, 4, 0, 2, 1, 8, jnp.float32)
    try:
        jax.jit(ring("cuda", is_causal=True))(q, k, v)
    except ValueError as e:
        assert 'implementation="cuda" cannot run this ring' in str(e), e
    else:
        raise AssertionError("an empty ring accepted implementation='cuda' for float32")
    print("ok empty refuses", flush=True)
    """
)


def _run(body: str, timeout: int = 600) -> str:
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT)
    )
    r = subprocess.run(
        [sys.executable, "-c", PRELUDE + body + "\nprint('done')\n"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("done"), r.stdout + r.stderr[-6000:]
    return r.stdout


def test_ring_masks_layouts_devices():
    out = _run(MASKS)
    assert out.count("ok ") == MASKS.count('case("'), out


def test_ring_query_offsets():
    from jax_flash._spec import MaskInputs

    if "q_offset" not in MaskInputs._fields:
        pytest.fail("MaskInputs.q_offset is missing: windows and T != S rings need it")
    out = _run(OFFSETS)
    assert out.count("ok ") == OFFSETS.count('case("'), out


def test_ring_cpu_kernels():
    out = _run(CPU)
    assert out.count("ok ") == CPU.count('case("'), out


def test_ring_compiled_overlap_memory_errors():
    out = _run(COMPILED)
    assert "ok hlo fwd" in out and "ok hlo fwdbwd" in out and "ok memory" in out, out
    assert "ok errors" in out, out


def test_block_counts_balance():
    # Causal: contiguous grows with the device index, zigzag is flat with the same total.
    assert block_counts(4, is_causal=True) == [4, 8, 12, 16]
    assert block_counts(4, layout="zigzag", is_causal=True) == [9, 9, 9, 9]
    assert block_counts(8, layout="zigzag", is_causal=True) == [17] * 8
    assert block_counts(2) == [8, 8]
    # A narrow window skips every block further than one chunk away.
    assert block_counts(4, local_window_size=(8, 8), q_len=64) == [8, 12, 12, 8]


def test_zigzag_roundtrip_and_errors():
    import jax.numpy as jnp

    import jax_flash

    x = jnp.arange(2 * 24 * 3).reshape(2, 24, 3)
    z = jax_flash.zigzag(x, 3)
    # Device 1 of 3 holds chunks 1 and 4 of 6 (4 positions each).
    np.testing.assert_array_equal(z[0, 8:16, 0], x[0, [4, 5, 6, 7, 16, 17, 18, 19], 0])
    np.testing.assert_array_equal(jax_flash.unzigzag(z, 3), x)
    y = jnp.arange(3 * 8).reshape(3, 8)
    np.testing.assert_array_equal(jax_flash.zigzag(y, 2, axis=-1)[0], [0, 1, 6, 7, 2, 3, 4, 5])
    np.testing.assert_array_equal(jax_flash.unzigzag(jax_flash.zigzag(y, 2, axis=-1), 2, axis=-1), y)
    with pytest.raises(ValueError, match="multiple of 2 \\* axis_size"):
        jax_flash.zigzag(x, 5)
    with pytest.raises(ValueError, match="axis_size"):
        jax_flash.zigzag(x, 0)
    with pytest.raises(ValueError, match="layout"):
        block_counts(2, layout="striped")


def test_bench_multi_device_section(tmp_path):
    """`python -m jax_flash.bench --multi-device` (its own process: it asks for host devices
    before JAX starts): every variant runs, the ring moves K/V by collective-permute only
    and holds less per device than the all-gather fallback."""
    import json

    path = tmp_path / "md.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "jax_flash.bench",
            "--multi-device",
            "--devices",
            "4",
            "--seq-len",
            "512",
            "--heads",
            "4",
            "--reps",
            "1",
            "--json",
            str(path),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "zigzag    : [9, 9, 9, 9]" in r.stdout, r.stdout
    rows = {(x["variant"], x["pass"]): x for x in json.loads(path.read_text())["results"]}
    assert len(rows) == 14 and all(x["status"] == "ok" for x in rows.values()), r.stdout
    assert "x ring zigzag" in r.stdout, r.stdout  # the ratios against the peer
    for pass_ in ("fwd", "fwdbwd"):
        gather = rows["all-gather K/V", pass_]
        assert gather["collectives"]["all-gather"] >= 2, gather
        kinds = lambda row: {op for op, n in row["collectives"].items() if n}
        assert kinds(rows["all-to-all", pass_]) == {"all-to-all"}, rows["all-to-all", pass_]
        assert kinds(rows["hybrid", pass_]) == {"all-to-all", "collective-permute"}, rows["hybrid", pass_]
        # MHA, N = 4 heads over 4 devices: under jit the rule runs the all-to-all.
        assert kinds(rows["jit rule", pass_]) == {"all-to-all"}, rows["jit rule", pass_]
        assert rows["jit rule", pass_]["note"].startswith("all-to-all over"), rows["jit rule", pass_]
    # Bytes per device, from the HLO with the ring's loop counted by its trip count: the
    # forward ring moves each K and V chunk (128 x 4 x 64 f32 = 128 KiB) 3 times; the
    # all-to-all's results are this device's q, k, v and out (128 KiB each); the fallback
    # gathers all of K and V (512 KiB each).
    chunk = 128 * 4 * 64 * 4
    for layout in ("contiguous", "zigzag"):
        assert rows[f"ring {layout}", "fwd"]["collective_bytes"]["collective-permute"] == 3 * 2 * chunk
    assert rows["all-to-all", "fwd"]["collective_bytes"]["all-to-all"] == 4 * chunk
    assert rows["all-gather K/V", "fwd"]["collective_bytes"]["all-gather"] == 2 * 4 * chunk
    for pass_ in ("fwd", "fwdbwd"):
        for layout in ("contiguous", "zigzag"):
            ring = rows[f"ring {layout}", pass_]
            c = ring["collectives"]
            assert c["collective-permute"] > 0 and c["all-gather"] == 0, ring
            assert c["all-reduce"] == 0 and c["all-to-all"] == 0, ring
            assert ring["temp_bytes"] < gather["temp_bytes"], (ring, gather)
            assert ring["arg_bytes"] * 4 == rows["one device", pass_]["arg_bytes"], ring


def test_flax_ring_attention_fn_rejects_dense_masks():
    import jax.numpy as jnp

    import jax_flash.flax

    q = jnp.ones((1, 8, 2, 4))
    with pytest.raises(ValueError, match="takes no dense mask, bias or sinks"):
        jax_flash.flax.attention_fn(q, q, q, mask=jnp.ones((1, 2, 8, 8)), axis_name="seq")


def test_ring_second_order_and_empty():
    out = _run(EDGES)
    assert out.count("ok second order") == 2 and out.count("ok empty ") == 3, out
    assert "ok empty refuses" in out, out
