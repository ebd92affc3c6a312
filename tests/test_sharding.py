"""Sharded inputs: jit over batch-sharded arrays and shard_map over the batch axis, on four
host devices (a subprocess, since the device count is fixed when JAX starts)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
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
    got = jax.jit(f)(*args)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol)

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
    print("ok")
    """
)


def test_sharded(impl):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    r = subprocess.run([sys.executable, "-c", SCRIPT, impl], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
