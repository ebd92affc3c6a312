"""One process of tests/features/test_multiprocess.py: `python multiprocess_worker.py PORT
PROCESS_ID MODE INIT_TIMEOUT`, with XLA_FLAGS giving this process 4 CPU devices.

MODE "run": join the 2-process job (gloo CPU collectives), then for each scenario build the
global q, k, v with `make_array_from_callback`, run `jax_flash.attention` forward and the
gradients under `jax.jit` over the 8 devices of both processes, bring the results back with
`process_allgather` and compare them with the same call on one local device (no sharding,
no collectives). Process 0 prints one line `RESULT <json>`: per scenario the collectives in
the compiled forward and forward+backward and the largest absolute errors.
MODE "die": process 1 exits with status 7 right after joining; process 0 then waits in a
collective that never completes (the launcher must end it).
"""

from __future__ import annotations

import json
import os
import re
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_enable_x64", True)
port, process_id, mode, init_timeout = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}",
    num_processes=2,
    process_id=process_id,
    initialization_timeout=init_timeout,
)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import (  # noqa: E402
    Mesh,
    NamedSharding,
    PartitionSpec as P,
)

import jax_flash  # noqa: E402

assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
if mode == "die":
    if process_id == 1:
        os._exit(7)
    multihost_utils.process_allgather(np.ones(3))  # never completes: process 1 is gone
    sys.exit(0)

COLL = re.compile(r"\b(all-gather|all-reduce|all-to-all|reduce-scatter|collective-permute)(?:-start)?\(")


def collectives(compiled):
    found: dict = {}
    for m in COLL.finditer(compiled.as_text()):
        found[m.group(1)] = found.get(m.group(1), 0) + 1
    return found


B, T, N, K, H = 2, 64, 8, 4, 16
rng = np.random.default_rng(0)
q_np = rng.normal(size=(B, T, N, H)).astype(np.float32) + 0.3
k_np = rng.normal(size=(B, T, K, H)).astype(np.float32)
v_np = rng.normal(size=(B, T, K, H)).astype(np.float32) - 0.2
w_np = rng.normal(size=(B, T, N, H)).astype(np.float32)
devices = np.array(jax.devices())  # process 0's 4 devices, then process 1's
local = jax.local_devices()[0]

# (name, mesh shape, axis names, PartitionSpec of q/k/v, forced scheme or None, kwargs)
SCENARIOS = [
    ("batch x heads", (2, 4), ("batch", "heads"), P("batch", None, "heads"), None, {"is_causal": True}),
    ("ring", (8,), ("seq",), P(None, "seq"), "ring", {"is_causal": True}),
    ("all-to-all", (8,), ("seq",), P(None, "seq"), "all_to_all", {"is_causal": True}),
    # The ring across the processes (major axis), the all-to-all inside each.
    ("hybrid", (2, 4), ("ring", "a2a"), P(None, ("ring", "a2a")), "hybrid", {"is_causal": True}),
]
results = {}
for name, shape, axes, spec, scheme, kw in SCENARIOS:
    mesh = Mesh(devices.reshape(shape), axes)
    cfg = jax_flash.Config(sequence_parallel=scheme) if scheme else None
    f = lambda q, k, v, cfg=cfg, kw=kw: jax_flash.attention(q, k, v, implementation="cpu", config=cfg, **kw)
    w = jnp.asarray(w_np)
    g = jax.grad(lambda q, k, v, f=f, w=w: jnp.sum(f(q, k, v) * w), (0, 1, 2))
    ref = [jax.device_put(x, local) for x in (q_np, k_np, v_np)]
    want = [np.asarray(jax.jit(f)(*ref))] + [np.asarray(x) for x in jax.jit(g)(*ref)]
    sharding = NamedSharding(mesh, spec)
    args = [jax.make_array_from_callback(x.shape, sharding, lambda idx, x=x: x[idx]) for x in (q_np, k_np, v_np)]
    cf, cg = jax.jit(f).lower(*args).compile(), jax.jit(g).lower(*args).compile()
    got = [cf(*args), *cg(*args)]
    got = [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in got]
    errors = [float(np.max(np.abs(a - b))) for a, b in zip(got, want)]
    results[name] = {"forward": collectives(cf), "backward": collectives(cg), "errors": errors}

if process_id == 0:
    print("RESULT " + json.dumps(results), flush=True)
jax.distributed.shutdown()
