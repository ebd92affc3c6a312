"""Context parallelism: `python -m jax_flash.bench --multi-device`.

Context parallelism at a fixed global T over P devices (host devices on a CPU: the flag sets
XLA_FLAGS before JAX starts), compared with one device computing everything and with the
all-gather fallback (every device gathers the whole K/V and attends its query chunk to it):
per-device compiled temporary memory, per-device arguments, time, the collectives in the
compiled program, and the causal block counts per device of the ring with and without zigzag.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash.bench.attention import FLASH, pass_fn
from jax_flash.bench.common import int_list, is_oom, short, environment

MD_VARIANTS = ("one device", "ring contiguous", "ring zigzag", "all-gather K/V")
_COLLECTIVE_OPS = ("collective-permute", "all-gather", "all-reduce", "all-to-all", "reduce-scatter")


@dataclasses.dataclass
class DeviceResult:
    variant: str
    pass_: str
    causal: bool
    devices: int
    seq_len: int
    status: str = "ok"
    time_s: Optional[float] = None
    temp_bytes: Optional[int] = None  # compiled temporary memory of one device
    arg_bytes: Optional[int] = None  # arguments held by one device
    collectives: Optional[dict] = None  # op -> count in the compiled program

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["pass"] = d.pop("pass_")
        return d


def count_collectives(hlo_text: str) -> dict:
    """{op: count} of the collective ops of a compiled HLO module (sync and -start forms;
    op names only, not metadata)."""
    import re

    return {
        op: len(re.findall(rf"\b{op}(?:-start)?\(", hlo_text)) for op in _COLLECTIVE_OPS
    }


def _md_fn(variant: str, mesh, causal: bool, impl: Optional[str]) -> Callable:
    from jax import lax
    from jax.sharding import PartitionSpec as P

    if variant == "one device":
        return lambda q, k, v: jax_flash.attention(q, k, v, is_causal=causal, implementation=impl)
    seq = P(None, "seq")
    if variant.startswith("ring"):
        layout = variant.split()[1]

        def local(q, k, v):
            return jax_flash.ring_attention(
                q, k, v, axis_name="seq", is_causal=causal, layout=layout, implementation=impl
            )

    else:

        def local(q, k, v):
            k_all = lax.all_gather(k, "seq", axis=1, tiled=True)
            v_all = lax.all_gather(v, "seq", axis=1, tiled=True)
            offset = lax.axis_index("seq") * q.shape[1]
            return jax_flash.attention(
                q, k_all, v_all, is_causal=causal, query_offset=offset, implementation=impl
            )

    # The gathered K/V are replicated over the axis while the queries vary: without the
    # varying-type check the gradient of the gather is the usual reduce-scatter.
    check_vma = variant.startswith("ring")
    return jax.shard_map(local, mesh=mesh, in_specs=(seq,) * 3, out_specs=seq,
                         check_vma=check_vma)


def measure_multi_device(
    devices: int,
    seq_len: int,
    *,
    batch: int = 1,
    heads: int = 8,
    head_dim: int = 64,
    dtype: str = "float32",
    causals=(True,),
    passes=("fwd", "fwdbwd"),
    reps: int = 3,
    impl: Optional[str] = None,
    variants=MD_VARIANTS,
) -> list[DeviceResult]:
    """Every variant at global T = S = seq_len over `devices` devices. Never raises."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:devices]), ("seq",))
    shape = (batch, seq_len, heads, head_dim)
    keys = jax.random.split(jax.random.key(0), 4)
    host = [jax.random.normal(kk, shape, jnp.float32).astype(dtype) for kk in keys]
    results = []
    for causal in causals:
        for pass_ in passes:
            for variant in variants:
                r = DeviceResult(variant, pass_, causal, 1 if variant == "one device" else devices,
                                 seq_len)
                results.append(r)
                where = (jax.devices()[0] if variant == "one device"
                         else NamedSharding(mesh, P(None, "seq")))
                args = [jax.device_put(x, where) for x in host[: 4 if pass_ == "fwdbwd" else 3]]
                try:
                    fn = pass_fn(_md_fn(variant, mesh, causal, impl), pass_)
                    compiled = jax.jit(fn).lower(*args).compile()
                    mem = compiled.memory_analysis()
                    r.temp_bytes = int(mem.temp_size_in_bytes)
                    r.arg_bytes = int(mem.argument_size_in_bytes)
                    r.collectives = count_collectives(compiled.as_text())
                    jax.block_until_ready(compiled(*args))  # warm-up
                    times = []
                    for _ in range(max(1, reps)):
                        t0 = time.perf_counter()
                        jax.block_until_ready(compiled(*args))
                        times.append(time.perf_counter() - t0)
                    r.time_s = statistics.median(times)
                except Exception as e:  # noqa: BLE001 - reported in the table
                    r.status = "OOM" if is_oom(e) else f"failed: {short(e)}"
    return results


def format_multi_device(results: list[DeviceResult]) -> str:
    head = (f"{'variant':16s} {'pass':6s} {'causal':6s} {'devices':>7s} {'time ms':>9s} "
            f"{'temp MiB/dev':>12s} {'args MiB/dev':>12s}  collectives")
    lines = [head, "-" * len(head)]
    for r in results:
        if r.status != "ok":
            lines.append(f"{r.variant:16s} {r.pass_:6s} {str(r.causal):6s} {r.devices:7d} "
                         f"{r.status}")
            continue
        coll = ", ".join(f"{n} {op}" for op, n in r.collectives.items() if n) or "none"
        lines.append(
            f"{r.variant:16s} {r.pass_:6s} {str(r.causal):6s} {r.devices:7d} "
            f"{r.time_s * 1e3:9.2f} {r.temp_bytes / 2**20:12.2f} {r.arg_bytes / 2**20:12.2f}"
            f"  {coll}"
        )
    return "\n".join(lines)


def _md_parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m jax_flash.bench --multi-device",
        description="Context parallelism at a fixed global T: ring attention (contiguous, "
        "zigzag) vs one device vs the all-gather fallback, per-device memory and time.",
    )
    p.add_argument("--multi-device", action="store_true", help="run this section")
    p.add_argument("--devices", type=int, default=8,
                   help="devices of the sequence axis (host devices on a CPU)")
    p.add_argument("--seq-len", type=int_list, default=None,
                   help="global T = S (suffix k = 1024; default 4k on a CPU, 32k on a GPU)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--causal", default="yes", choices=["both", "yes", "no"])
    p.add_argument("--passes", default="both", choices=["fwd", "fwdbwd", "both"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--impl", default=None, choices=FLASH,
                   help="implementation of every attention call (default: jax_flash's choice)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    return p.parse_args(argv)


def multi_device_main(argv) -> list[DeviceResult]:
    """`python -m jax_flash.bench --multi-device [...]`."""
    args = _md_parse_args(argv)
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # Read when the CPU backend starts (not yet, unless JAX was used before this call).
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    seq_len = (args.seq_len or [32768 if on_gpu else 4096])[0]
    dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    p = args.devices
    print(f"jax_flash {jax_flash.__version__}, jax {jax.__version__}, backend "
          f"{jax.default_backend()}, {jax.device_count()} devices ({jax.devices()[0].device_kind})")
    if jax.device_count() < p:
        print(f"multi-device: needs {p} devices, have {jax.device_count()} "
              f"(on a CPU run it in a fresh process, or set XLA_FLAGS={flag})")
        return []
    if seq_len % (2 * p):
        raise SystemExit(f"--seq-len must be a multiple of 2 * devices = {2 * p}")
    print(f"global T = S = {seq_len}, B={args.batch} N={args.heads} H={args.head_dim} {dtype}, "
          f"sequence over {p} devices ({seq_len // p} each), implementation "
          f"{args.impl or 'auto'}")
    if jax.default_backend() == "cpu":
        print("(host devices share this machine's cores: times add up over the devices)")
    print()
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    passes = {"both": ("fwd", "fwdbwd"), "fwd": ("fwd",), "fwdbwd": ("fwdbwd",)}[args.passes]
    results = measure_multi_device(
        p, seq_len, batch=args.batch, heads=args.heads, head_dim=args.head_dim, dtype=dtype,
        causals=causals, passes=passes, reps=args.reps, impl=args.impl,
    )
    print(format_multi_device(results))
    print()
    from jax_flash.parallel.ring import block_counts

    counts = {}
    for layout in ("contiguous", "zigzag"):
        counts[layout] = block_counts(p, layout=layout, is_causal=True)
        print(f"causal blocks per device, {layout:10s}: {counts[layout]} "
              f"(max {max(counts[layout])}, total {sum(counts[layout])})")
    print(f"(units: one (T/{2 * p}) x (S/{2 * p}) block; the step time follows the max)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "config": vars(args),
                       "results": [r.to_json() for r in results],
                       "causal_block_counts": counts}, f, indent=1)
        print(f"wrote {args.json}")
    return results
