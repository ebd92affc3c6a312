"""Sequence-sharded calls under plain `jax.jit`: the partitioning rule runs the ring, the
all-to-all or the hybrid (`jax_flash.parallel.partitioning.sequence_decision`).

The rule (the fewest bytes one device sends, forward plus backward) is checked in this
process on its figures. On eight host devices (one subprocess: the device count is fixed
when JAX starts), each case compares forward and gradients with the unsharded call, checks
that `explain` names the scheme the case expects, and counts the collectives in the compiled
HLO: all-to-all only for the all-to-all, collective-permute only for the ring, both for the
hybrid, and never an all-gather of K/V (the only all-gather allowed is of int32 segment ids).
`Config.sequence_parallel` forces a scheme; a forced scheme that cannot run is a ValueError.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest

from jax_flash import _heuristics
from jax_flash._config import Config
from jax_flash._spec import AttentionSpec
from jax_flash.parallel.partitioning import sequence_decision


@dataclasses.dataclass
class _Mesh:
    shape: dict


def _spec(n, k, t=4096, b=1, h=128, dtype="bfloat16", sequence_parallel="auto"):
    return AttentionSpec(
        batch=b,
        q_len=t,
        kv_len=t,
        num_heads=n,
        num_kv_heads=k,
        head_dim=h,
        dtype=dtype,
        scale=1.0,
        config=Config(sequence_parallel=sequence_parallel).over(Config()),
    )


def test_bytes_rule():
    """The figures of the rule, by hand: B=1, T=S=4096, H=Hv=128, bf16 (2 B), f32 statistics."""
    spec = _spec(n=8, k=8)
    # Ring over 4: the K/V chunk (1024 x 8 x 256 x 2 B = 4 MiB) moves 3 times forward; backward
    # 3 times plus the f32 dK/dV accumulators (8 MiB) 4 times.
    mib = 1 << 20
    assert _heuristics.sequence_parallel_bytes("ring", spec, 4, 1, 4) == (12 * mib, 12 * mib + 32 * mib)
    # All-to-all over 4: 3/4 of q (2 MiB), k+v (4 MiB), out (2 MiB), lse (32 KiB f32) forward;
    # backward twice q, k+v, out (with dout), lse (with dlse).
    fwd = 3 * (8 * mib) // 4 + 3 * (1024 * 8 * 4) // 4
    bwd = 3 * (16 * mib) // 4 + 3 * (2 * 1024 * 8 * 4) // 4
    assert _heuristics.sequence_parallel_bytes("all_to_all", spec, 1, 4, 4) == (fwd, bwd)
    # Hybrid ring 2 x a2a 4: the all-to-all over 4 on chunks of T/8, then the ring over 2 on
    # chunks of T/2 with 2 heads.
    f_a, b_a = _heuristics.sequence_parallel_bytes(
        "all_to_all", dataclasses.replace(spec, q_len=2048, kv_len=2048), 1, 4, 4
    )
    kv = 2048 * 2 * 256
    assert _heuristics.sequence_parallel_bytes("hybrid", spec, 2, 4, 4) == (f_a + kv * 2, b_a + kv * 2 + 2 * kv * 4)


@pytest.mark.parametrize(
    ("n", "k", "axes", "want"),
    [
        (8, 8, {"seq": 4}, "all_to_all"),  # MHA: 3/4 of four arrays beats 3 K/V chunk hops
        (8, 8, {"seq": 2}, "all_to_all"),  # the backward's f32 accumulators tip it
        (8, 1, {"seq": 4}, "ring"),  # MQA: the kv head repeated 4 times costs more than 3 hops
        (6, 6, {"seq": 4}, "ring"),  # 6 heads over 4 devices: no all-to-all
        (4, 4, {"ring": 2, "a2a": 4}, "hybrid"),  # 4 heads over 8 devices: no all-to-all
        (16, 16, {"ring": 2, "a2a": 4}, "all_to_all"),
    ],
)
def test_rule_chooses(n, k, axes, want):
    d = sequence_decision("xla", _spec(n, k), _Mesh(axes), tuple(axes))
    assert d.scheme == want, d.words()
    moved = dict(d.moved)
    assert all(sum(moved[want]) <= sum(b) for b in moved.values()), d.words()


def test_forced_scheme_that_cannot_run_is_an_error():
    mesh = _Mesh({"seq": 4})
    with pytest.raises(ValueError, match=r"sequence_parallel='all_to_all'.*N=6 query heads"):
        sequence_decision("xla", _spec(6, 6, sequence_parallel="all_to_all"), mesh, ("seq",))
    with pytest.raises(ValueError, match=r"'hybrid'.*two mesh axes"):
        sequence_decision("xla", _spec(8, 8, sequence_parallel="hybrid"), mesh, ("seq",))
    d = sequence_decision("xla", _spec(8, 8, sequence_parallel="ring"), mesh, ("seq",))
    assert d.scheme == "ring" and d.forced and "forced" in d.words()


def test_the_variable_forces_a_scheme(monkeypatch):
    mesh = _Mesh({"seq": 4})
    spec = dataclasses.replace(_spec(8, 8), config=None)  # settings resolved when used
    monkeypatch.setenv("JAX_FLASH_SEQUENCE_PARALLEL", "ring")
    assert sequence_decision("xla", spec, mesh, ("seq",)).scheme == "ring"
    monkeypatch.setenv("JAX_FLASH_SEQUENCE_PARALLEL", "ulysses")
    with pytest.raises(ValueError, match="JAX_FLASH_SEQUENCE_PARALLEL='ulysses' is not a sequence-parallel scheme"):
        sequence_decision("xla", spec, mesh, ("seq",))
    with pytest.raises(ValueError, match="sequence_parallel must be one of"):
        Config(sequence_parallel="ulysses")


SCRIPT = textwrap.dedent(
    r"""
    import re, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_flash

    assert jax.device_count() == 8, jax.devices()
    devs = np.array(jax.devices())
    COLL = re.compile(r"\b(all-gather|all-reduce|all-to-all|reduce-scatter|collective-permute)(?:-start)?\(")
    # An all-gather's result type: "%name = s32[2,32]{1,0} all-gather(".
    GATHER = re.compile(r"=\s*\(?(\w+)\[[^\n]*?\ball-gather(?:-start)?\(")
    EXPECT = {"all_to_all": {"all-to-all"}, "ring": {"collective-permute"},
              "hybrid": {"all-to-all", "collective-permute"}}
    WORDS = {"all_to_all": "all-to-all over", "ring": "ring over", "hybrid": "hybrid: all-to-all over"}

    def counts(c):
        text = c.as_text()
        found = {}
        for m in COLL.finditer(text):
            found[m.group(1)] = found.get(m.group(1), 0) + 1
        types = GATHER.findall(text)
        assert len(types) == found.get("all-gather", 0), (types, found)  # every all-gather typed
        return found, set(types)

    def case(name, mesh_shape, axis_names, seq, b, t, n, kh, h, hv, want, config=None, **kw):
        mesh = Mesh(devs[: int(np.prod(mesh_shape))].reshape(mesh_shape), axis_names)
        r = np.random.default_rng(len(name))
        q = jnp.asarray(r.normal(size=(b, t, n, h)) + 0.3, jnp.float32)
        k = jnp.asarray(r.normal(size=(b, t, kh, h)), jnp.float32)
        v = jnp.asarray(r.normal(size=(b, t, kh, hv)) - 0.2, jnp.float32)
        w = jnp.asarray(r.normal(size=(b, t, n, hv)), jnp.float32)
        extra = {key: val for key, val in kw.items() if isinstance(val, jax.Array)}
        static = {key: val for key, val in kw.items() if key not in extra}
        cfg = jax_flash.Config(sequence_parallel=config) if config else None
        f = lambda q, k, v, e: jax_flash.attention(q, k, v, implementation="cpu", config=cfg, **static, **e)
        g = jax.grad(lambda q, k, v, e: jnp.sum(f(q, k, v, e) * w), (0, 1, 2))
        want_out, want_g = jax.jit(f)(q, k, v, extra), jax.jit(g)(q, k, v, extra)
        seq_spec = P(None, seq) if not isinstance(seq, P) else seq
        put = lambda x: jax.device_put(x, NamedSharding(mesh, seq_spec))
        args = (put(q), put(k), put(v))
        e_sh = {key: jax.device_put(val, NamedSharding(mesh, P(*seq_spec[:val.ndim])))
                for key, val in extra.items()}
        cf, cg = jax.jit(f).lower(*args, e_sh).compile(), jax.jit(g).lower(*args, e_sh).compile()
        (fwd, fwd_g), (bwd, bwd_g) = counts(cf), counts(cg)
        errs = [float(jnp.max(jnp.abs(cf(*args, e_sh) - want_out)))]
        errs += [float(jnp.max(jnp.abs(x - y))) for x, y in zip(cg(*args, e_sh), want_g)]
        with jax_flash.config(**({"sequence_parallel": config} if config else {})):
            words = str(jax_flash.explain(*args, implementation="cpu", **static, **extra))
        print(f"{name}: forward {fwd}, forward+backward {bwd}, max errors {errs}\n  {words.splitlines()[-1]}")
        assert max(errs) <= 2e-5, (name, errs)
        assert "sequence parallel: " + "sequence over mesh axes" in words and WORDS[want] in words, (name, words)
        allowed = EXPECT[want] | ({"all-gather"} if "segment_ids" in extra else set())
        assert set(fwd) <= allowed and set(bwd) <= allowed, (name, fwd, bwd)
        assert EXPECT[want] <= set(fwd) and EXPECT[want] <= set(bwd), (name, fwd, bwd)
        # No all-gather of K/V: the only gathered arrays are int32 segment ids.
        assert fwd_g <= {"s32"} and bwd_g <= {"s32"}, (name, fwd_g, bwd_g)

    seg = (jnp.arange(32)[None, :] // 11 + jnp.arange(2)[:, None]).astype(jnp.int32)
    lens = jnp.asarray([32, 19], jnp.int32)
    # MHA over 4 devices, Hv != H, causal, lengths and segment ids: the all-to-all.
    case("all-to-all", (4,), ("seq",), "seq", 2, 32, 4, 4, 16, 8, "all_to_all",
         is_causal=True, key_value_seq_lengths=lens, segment_ids=seg)
    # MQA (one kv head), a window and a per-row query offset: the ring.
    off = jnp.asarray([0, 5], jnp.int32)
    case("ring", (4,), ("seq",), "seq", 2, 32, 4, 1, 16, 16, "ring",
         local_window_size=(9, 3), query_offset=off)
    # The same call, the all-to-all forced: the kv head repeated to every device.
    case("all-to-all forced", (4,), ("seq",), "seq", 2, 32, 4, 1, 16, 16, "all_to_all",
         config="all_to_all", local_window_size=(9, 3), query_offset=off)
    # 4 heads over 2 x 4 devices (ring major, all-to-all minor), GQA: the hybrid.
    case("hybrid", (2, 4), ("ring", "a2a"), ("ring", "a2a"), 2, 32, 4, 2, 16, 16, "hybrid",
         is_causal=True, segment_ids=seg)
    # The ring forced over both axes.
    case("ring forced over two axes", (2, 4), ("ring", "a2a"), ("ring", "a2a"), 2, 32, 4, 2, 16, 16,
         "ring", config="ring", is_causal=True)
    # Batch x sequence: the all-to-all on each batch shard.
    case("b x all-to-all", (2, 4), ("batch", "seq"), P("batch", "seq"), 2, 32, 8, 4, 16, 16,
         "all_to_all", is_causal=True)
    print("ok")
    """
)


def test_sequence_sharded_under_jit():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
    print(r.stdout)
