"""Context parallelism: `python -m jax_flash.bench --multi-device`.

Sequence parallelism at a fixed global T over P devices (host devices on a CPU: the flag sets
XLA_FLAGS before JAX starts): the ring (contiguous, zigzag), the all-to-all
(`ulysses_attention`), the hybrid (`hybrid_attention`: the ring over 2 devices, the
all-to-all over P/2) and what `jax.jit` runs by its rule on sequence-sharded arrays, compared
with one device computing everything and with the all-gather fallback (every device gathers
the whole K/V and attends its query chunk to it): per-device compiled temporary memory,
per-device arguments, time, the collectives in the compiled program, the bytes each kind of
collective produces per device (`collective_bytes`: loops counted by their trip counts),
ratios against the ring (zigzag) of the same pass, and the causal block counts per device of
the ring with and without zigzag.

`--processes 2` runs the same table over 2 processes on this machine (each with P/2 host
devices, joined by `jax.distributed.initialize`, gloo CPU collectives): the collectives then
cross process boundaries; process 0 prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash.bench.attention import FLASH, pass_fn
from jax_flash.bench.common import environment, int_list, is_oom, short

MD_VARIANTS = ("one device", "ring contiguous", "ring zigzag", "all-to-all", "hybrid", "jit rule", "all-gather K/V")
PEER = "ring zigzag"  # the ratios' reference
_COLLECTIVE_OPS = ("collective-permute", "all-gather", "all-reduce", "all-to-all", "reduce-scatter")


@dataclasses.dataclass
class DeviceResult:
    variant: str
    pass_: str
    causal: bool
    devices: int
    seq_len: int
    status: str = "ok"
    time_s: float | None = None
    temp_bytes: int | None = None  # compiled temporary memory of one device
    arg_bytes: int | None = None  # arguments held by one device
    collectives: dict | None = None  # op -> count in the compiled program
    collective_bytes: dict | None = None  # op -> bytes its results hold per device, loops unrolled
    note: str = ""  # what ran (the jit rule's choice)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["pass"] = d.pop("pass_")
        return d


def count_collectives(hlo_text: str) -> dict:
    """{op: count} of the collective ops of a compiled HLO module (sync and -start forms;
    op names only, not metadata)."""
    import re

    return {op: len(re.findall(rf"\b{op}(?:-start)?\(", hlo_text)) for op in _COLLECTIVE_OPS}


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f16": 2, "bf16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
_DTYPE_BYTES.update({"f64": 8, "s64": 8, "u64": 8})


def collective_bytes(hlo_text: str) -> dict:
    """{op: bytes} the collective ops of a compiled HLO module produce on one device (their
    result buffers: for a collective-permute the bytes received, as many as sent; for an
    all-to-all its whole result, 1/P of it this device's own), a `while` body counted its
    known trip count of times, a conditional by its largest branch. Async pairs are counted
    once, by their -done."""
    import re

    comps: dict = {}
    name = None
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            name = head.group(1)
            comps[name] = []
            if line.startswith("ENTRY"):
                comps["__entry__"] = comps[name]
        elif name is not None and line.strip() == "}":
            name = None
        elif name is not None:
            comps[name].append(line)
    op_re = re.compile(r"=\s*(.*?)\s(" + "|".join(_COLLECTIVE_OPS) + r")(-done)?\(")

    def size(types: str) -> int:
        total = 0
        for dt, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", types):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            total += n * _DTYPE_BYTES.get(dt, 0)
        return total

    memo: dict = {}

    def of(comp: str) -> dict:
        if comp in memo:
            return memo[comp]
        memo[comp] = {}
        out: dict = {}
        for line in comps.get(comp, []):
            m = op_re.search(line)
            if m and f"{m.group(2)}-start(" not in line:
                out[m.group(2)] = out.get(m.group(2), 0) + size(m.group(1))
            w = re.search(r"\swhile\(.*body=%?([\w.\-]+)", line)
            if w:
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                for op, b in of(w.group(1)).items():
                    out[op] = out.get(op, 0) + b * (int(trip.group(1)) if trip else 1)
            br = re.search(r"branch_computations=\{([^}]*)\}", line)
            if br:
                branches = [of(x.strip().lstrip("%")) for x in br.group(1).split(",")]
                for op in {o for b in branches for o in b}:
                    out[op] = out.get(op, 0) + max(b.get(op, 0) for b in branches)
            for callee in re.findall(r"\b(?:to_apply|calls)=%?([\w.\-]+)", line):
                for op, b in of(callee).items():
                    out[op] = out.get(op, 0) + b
        memo[comp] = out
        return out

    return of("__entry__") if "__entry__" in comps else {}


def _global(x: np.ndarray, sharding) -> jax.Array:
    """`x` (the same on every process) as a global array: each process places its shards."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def _grid(mesh):
    """The hybrid's 2-D mesh over the same devices (ring over 2, all-to-all over P/2) and the
    sequence's PartitionSpec on it (ring major: the same layout as "seq")."""
    from jax.sharding import Mesh, PartitionSpec as P

    return Mesh(mesh.devices.reshape(2, mesh.devices.size // 2), ("ring", "a2a")), P(None, ("ring", "a2a"))


def _md_fn(variant: str, mesh, causal: bool, impl: str | None) -> Callable:
    from jax import lax
    from jax.sharding import PartitionSpec as P

    if variant in ("one device", "jit rule"):
        # "jit rule": the same call on sequence-sharded arrays; jax.jit's partitioning rule
        # picks the scheme.
        return lambda q, k, v: jax_flash.attention(q, k, v, is_causal=causal, implementation=impl)
    seq = P(None, "seq")
    if variant == "all-to-all":

        def local(q, k, v):
            return jax_flash.ulysses_attention(q, k, v, axis_name="seq", is_causal=causal, implementation=impl)

        return jax.shard_map(local, mesh=mesh, in_specs=(seq,) * 3, out_specs=seq)
    if variant == "hybrid":
        grid, seq2 = _grid(mesh)

        def local(q, k, v):
            return jax_flash.hybrid_attention(
                q, k, v, a2a_axis="a2a", ring_axis="ring", is_causal=causal, implementation=impl
            )

        return jax.shard_map(local, mesh=grid, in_specs=(seq2,) * 3, out_specs=seq2)
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
            return jax_flash.attention(q, k_all, v_all, is_causal=causal, query_offset=offset, implementation=impl)

    # The gathered K/V are replicated over the axis while the queries vary: without the
    # varying-type check the gradient of the gather is the usual reduce-scatter.
    check_vma = variant.startswith("ring")
    return jax.shard_map(local, mesh=mesh, in_specs=(seq,) * 3, out_specs=seq, check_vma=check_vma)


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
    impl: str | None = None,
    variants=MD_VARIANTS,
) -> list[DeviceResult]:
    """Every variant at global T = S = seq_len over `devices` devices. Never raises."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:devices]), ("seq",))
    shape = (batch, seq_len, heads, head_dim)
    keys = jax.random.split(jax.random.key(0), 4)
    host = [jax.random.normal(kk, shape, jnp.float32).astype(dtype) for kk in keys]
    host_np = [np.asarray(x) for x in host]
    results = []
    for causal in causals:
        for pass_ in passes:
            for variant in variants:
                r = DeviceResult(variant, pass_, causal, 1 if variant == "one device" else devices, seq_len)
                results.append(r)
                try:
                    if variant == "one device":
                        args = [
                            jax.device_put(x, jax.local_devices()[0]) for x in host[: 4 if pass_ == "fwdbwd" else 3]
                        ]
                    else:
                        # make_array_from_callback: also when the mesh spans processes.
                        sharding = (
                            NamedSharding(*_grid(mesh)) if variant == "hybrid" else NamedSharding(mesh, P(None, "seq"))
                        )
                        args = [_global(x, sharding) for x in host_np[: 4 if pass_ == "fwdbwd" else 3]]
                    if variant == "jit rule":
                        words = jax_flash.explain(*args[:3], is_causal=causal, implementation=impl).sequence_parallel
                        text = (words or "not sequence-parallel").split(": ", 1)[-1]
                        r.note = text.split(" (the fewest")[0].split(" (forced")[0]
                    fn = pass_fn(_md_fn(variant, mesh, causal, impl), pass_)
                    compiled = jax.jit(fn).lower(*args).compile()
                    mem = compiled.memory_analysis()
                    assert mem is not None, "no memory analysis on this backend"
                    r.temp_bytes = int(mem.temp_size_in_bytes)
                    r.arg_bytes = int(mem.argument_size_in_bytes)
                    hlo_text = compiled.as_text()
                    assert hlo_text is not None, "no HLO text of the compiled program"
                    r.collectives = count_collectives(hlo_text)
                    r.collective_bytes = collective_bytes(hlo_text)
                    jax.block_until_ready(compiled(*args))  # warm-up
                    times = []
                    for _ in range(max(1, reps)):
                        t0 = time.perf_counter()
                        jax.block_until_ready(compiled(*args))
                        times.append(time.perf_counter() - t0)
                    r.time_s = statistics.median(times)
                except Exception as e:  # reported in the table
                    r.status = "OOM" if is_oom(e) else f"failed: {short(e)}"
    return results


def format_multi_device(results: list[DeviceResult]) -> str:
    head = (
        f"{'variant':16s} {'pass':6s} {'causal':6s} {'devices':>7s} {'time ms':>9s} {'x ' + PEER:>14s} "
        f"{'temp MiB/dev':>12s} {'x ' + PEER:>14s} {'args MiB/dev':>12s}  collectives (count, MiB/dev)"
    )
    lines = [head, "-" * len(head)]
    peers = {(r.pass_, r.causal): r for r in results if r.variant == PEER and r.status == "ok"}
    for r in results:
        if r.status != "ok":
            lines.append(f"{r.variant:16s} {r.pass_:6s} {r.causal!s:6s} {r.devices:7d} {r.status}")
            continue
        # An "ok" cell has every measurement (measure_multi_device sets them before the status could change).
        assert r.collectives is not None and r.time_s is not None and r.collective_bytes is not None
        assert r.temp_bytes is not None and r.arg_bytes is not None
        coll = (
            ", ".join(f"{n} {op} {r.collective_bytes.get(op, 0) / 2**20:.2f}" for op, n in r.collectives.items() if n)
            or "none"
        )
        peer = peers.get((r.pass_, r.causal))
        t_ratio = f"{r.time_s / peer.time_s:14.2f}" if peer and peer.time_s else f"{'-':>14s}"
        m_ratio = f"{r.temp_bytes / peer.temp_bytes:14.2f}" if peer and peer.temp_bytes else f"{'-':>14s}"
        lines.append(
            f"{r.variant:16s} {r.pass_:6s} {r.causal!s:6s} {r.devices:7d} "
            f"{r.time_s * 1e3:9.2f} {t_ratio} {r.temp_bytes / 2**20:12.2f} {m_ratio} {r.arg_bytes / 2**20:12.2f}"
            f"  {coll}" + (f"  [{r.note}]" if r.note else "")
        )
    return "\n".join(lines)


def _md_parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m jax_flash.bench --multi-device",
        description="Context parallelism at a fixed global T: ring attention (contiguous, "
        "zigzag) vs one device vs the all-gather fallback, per-device memory and time.",
    )
    p.add_argument("--multi-device", action="store_true", help="run this section")
    p.add_argument("--devices", type=int, default=8, help="devices of the sequence axis (host devices on a CPU)")
    p.add_argument(
        "--seq-len",
        type=int_list,
        default=None,
        help="global T = S (suffix k = 1024; default 4k on a CPU, 32k on a GPU)",
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--causal", default="yes", choices=["both", "yes", "no"])
    p.add_argument("--passes", default="both", choices=["fwd", "fwdbwd", "both"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--impl",
        default=None,
        choices=FLASH,
        help="implementation of every attention call (default: jax_flash's choice)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--processes", type=int, default=1, help="processes on this machine sharing the devices")
    p.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _launch(argv, processes: int) -> int:
    """Run this section as `processes` processes on this machine; process 0 prints. The first
    process to fail ends the others."""
    import socket
    import subprocess
    import sys
    import tempfile

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs, logs = [], []
    for i in range(processes):
        log = None if i == 0 else tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed below)
        logs.append(log)
        cmd = [sys.executable, "-m", "jax_flash.bench", *argv, "--process-id", str(i)]
        cmd += ["--coordinator", f"127.0.0.1:{port}"]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None))
    while any(x.poll() is None for x in procs) and all(x.poll() in (None, 0) for x in procs):
        time.sleep(0.2)
    for x in procs:
        if x.poll() is None:
            x.kill()
        x.wait()
    for i, (x, log) in enumerate(zip(procs, logs)):
        if log is not None:
            if x.returncode:
                log.seek(0)
                print(f"--- process {i} exited with {x.returncode}:\n{log.read()[-4000:]}", file=sys.stderr)
            log.close()
    return next((x.returncode for x in procs if x.returncode), 0)


def multi_device_main(argv) -> list[DeviceResult]:
    """`python -m jax_flash.bench --multi-device [...]`."""
    args = _md_parse_args(argv)
    if args.processes > 1 and args.process_id is None:
        code = _launch(argv, args.processes)
        if code:
            raise SystemExit(f"multi-device: a process exited with {code}")
        return []
    flag = f"--xla_force_host_platform_device_count={args.devices // args.processes}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # Read when the CPU backend starts (not yet, unless JAX was used before this call).
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    if args.processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.processes,
            process_id=args.process_id,
            initialization_timeout=60,
        )
    # Every process prints; the launch shows process 0 (the others when they fail).
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    seq_len = (args.seq_len or [32768 if on_gpu else 4096])[0]
    dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    p = args.devices
    print(
        f"jax_flash {jax_flash.__version__}, jax {jax.__version__}, backend "
        f"{jax.default_backend()}, {jax.device_count()} devices ({jax.devices()[0].device_kind}) in "
        f"{jax.process_count()} process(es)"
    )
    if jax.device_count() < p:
        print(
            f"multi-device: needs {p} devices, have {jax.device_count()} "
            f"(on a CPU run it in a fresh process, or set XLA_FLAGS={flag})"
        )
        return []
    if seq_len % (2 * p):
        raise SystemExit(f"--seq-len must be a multiple of 2 * devices = {2 * p}")
    print(
        f"global T = S = {seq_len}, B={args.batch} N={args.heads} H={args.head_dim} {dtype}, "
        f"sequence over {p} devices ({seq_len // p} each), implementation "
        f"{args.impl or 'auto'}"
    )
    if jax.default_backend() == "cpu":
        print("(host devices share this machine's cores: times add up over the devices)")
    print()
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    passes = {"both": ("fwd", "fwdbwd"), "fwd": ("fwd",), "fwdbwd": ("fwdbwd",)}[args.passes]
    results = measure_multi_device(
        p,
        seq_len,
        batch=args.batch,
        heads=args.heads,
        head_dim=args.head_dim,
        dtype=dtype,
        causals=causals,
        passes=passes,
        reps=args.reps,
        impl=args.impl,
    )
    print(format_multi_device(results))
    print()
    from jax_flash.parallel.ring import block_counts

    counts = {}
    for layout in ("contiguous", "zigzag"):
        counts[layout] = block_counts(p, layout=layout, is_causal=True)
        print(
            f"causal blocks per device, {layout:10s}: {counts[layout]} "
            f"(max {max(counts[layout])}, total {sum(counts[layout])})"
        )
    print(f"(units: one (T/{2 * p}) x (S/{2 * p}) block; the step time follows the max)")
    if args.json and jax.process_index() == 0:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "environment": environment(),
                    "config": vars(args),
                    "results": [r.to_json() for r in results],
                    "causal_block_counts": counts,
                },
                f,
                indent=1,
            )
        print(f"wrote {args.json}")
    return results
