"""Peak resident memory: `python -m jax_flash.bench --peak-memory` (Linux), each
(implementation, case) of the attention section's options in a process of its own
(`--peak-memory-probe`, one cell)."""

from __future__ import annotations

import ctypes
import gc
import json
import subprocess
import sys
from typing import Optional

import jax

from jax_flash.bench.attention import PEER_TORCH, prepare, available_impls, parse_args
from jax_flash.bench.common import fmt_seq, short


def _status_kib(field: str) -> Optional[int]:
    """A field of /proc/self/status in KiB (VmRSS: resident now, VmHWM: its peak), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_memory_probe(argv) -> dict:
    """One cell in this (fresh) process: `impl pass causal H T B N dtype`. Compiles it (jax),
    then resets the peak resident size (/proc/self/clear_refs) and runs it once: the peak
    during the call, the resident size before it (inputs, runtime, compiled code) and the
    difference, the call's own memory. Prints and returns them as JSON."""
    impl, pass_, causal, head_dim, seq_len, batch, heads, dtype = argv
    cell = (impl, pass_, causal == "yes", int(head_dim), int(seq_len), int(batch), int(heads), dtype)
    r, fn, args = prepare(*cell, None)
    row = {"impl": impl, "pass": pass_, "causal": causal == "yes", "head_dim": int(head_dim),
           "seq_len": int(seq_len), "dtype": dtype, "status": r.status}
    if fn is not None:
        run = fn if impl == PEER_TORCH else (lambda: jax.block_until_ready(fn(*args)))
        if args:
            jax.block_until_ready(args)
        gc.collect()
        try:  # hand freed heap (the compiler's) back, so that "before" is what is held
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
        before = _status_kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError as e:
            row["status"] = f"failed: cannot reset the peak resident size ({e})"
            before = None
        if before is not None:
            run()
            peak = _status_kib("VmHWM")
            row.update(before_mib=before / 1024, peak_mib=peak / 1024, call_mib=(peak - before) / 1024)
    print(json.dumps(row), flush=True)
    return row


def peak_memory_main(argv) -> list[dict]:
    """--peak-memory: each (implementation, case) of the usual options in a process of its own
    (Linux): the peak resident memory during one call and the call's own share (above what
    was resident before it), side by side, with each implementation's ratio to torch's."""
    argv = [a for a in argv if a != "--peak-memory"]
    args = parse_args(argv)
    impls, skipped = available_impls(args.impls, args.dtype)
    for name, why in skipped.items():
        print(f"  not measured: {name}: {why}")
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    passes = {"both": ("fwd", "fwdbwd"), "fwd": ("fwd",), "fwdbwd": ("fwdbwd",)}[args.passes]
    rows = []
    print("| impl | dtype | H | T = S | causal | pass | peak MiB | before MiB | call MiB | peak x torch | call x torch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for h in args.head_dims:
        for t in args.seq_lens:
            for c in causals:
                for p_ in passes:
                    case = []
                    for impl in impls:
                        cmd = [sys.executable, "-m", "jax_flash.bench", "--peak-memory-probe", impl, p_,
                               "yes" if c else "no", str(h), str(t), str(args.batch), str(args.heads), args.dtype]
                        done = subprocess.run(cmd, capture_output=True, text=True)
                        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
                        row = json.loads(lines[-1]) if lines else {
                            "impl": impl, "status": f"failed: {short(RuntimeError(done.stderr.strip()[-300:]))}"}
                        case.append(row)
                    peer = next((r for r in case if r["impl"] == PEER_TORCH and "peak_mib" in r), None)
                    for row in case:
                        if "peak_mib" not in row:
                            print(f"| {row['impl']} | {args.dtype} | {h} | {fmt_seq(t)} | {'yes' if c else 'no'} "
                                  f"| {p_} | {row['status']} | | | | |")
                            continue
                        ratio = lambda key: f"{row[key] / peer[key]:.2f}" if peer and peer[key] > 0 else ""
                        print(f"| {row['impl']} | {args.dtype} | {h} | {fmt_seq(t)} | {'yes' if c else 'no'} | {p_} "
                              f"| {row['peak_mib']:.0f} | {row['before_mib']:.0f} | {row['call_mib']:.0f} "
                              f"| {ratio('peak_mib')} | {ratio('call_mib')} |", flush=True)
                    rows.extend(case)
    print("\npeak: the process's peak resident memory during one call (after compiling it); before: "
          "resident before the call (inputs, runtime, compiled code); call: peak - before.")
    return rows
