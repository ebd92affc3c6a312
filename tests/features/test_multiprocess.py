"""Across processes: 2 processes x 4 CPU devices on localhost, joined by
`jax.distributed.initialize` (gloo CPU collectives), run `jax_flash.attention` under
`jax.jit` over all 8 devices (tests/features/multiprocess_worker.py): batch x heads sharding
(no collective at all), the ring, the all-to-all and the hybrid (the ring across the
processes, the all-to-all inside each), forward and gradients, each equal to the call on
one device. One launch runs every scenario.

The launcher never waits unbounded: a process that exits with an error ends the others at
once (a survivor would otherwise sit in a collective until the coordination service's
heartbeat gives up, about 100 s), and a deadline ends everything. Both failure modes are
tested: a process that dies after joining, and a coordinator that never answers (the
joining process gives up after its `initialization_timeout`).
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

WORKER = pathlib.Path(__file__).with_name("multiprocess_worker.py")
ROOT = WORKER.parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(mode: str, process_ids=(0, 1), init_timeout: int = 60, deadline: float = 240.0):
    """Start the worker processes; return (exit codes, outputs, seconds). The first process
    to exit non-zero ends the others (SIGKILL); past `deadline` seconds every process left is
    ended (its code then -9)."""
    port = free_port()
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT),
        PYTHONUNBUFFERED="1",
    )
    logs = []
    procs = []
    start = time.monotonic()
    for i in process_ids:
        out = tempfile.NamedTemporaryFile("w+", prefix=f"jax_flash_process{i}_", suffix=".log", delete=False)  # noqa: SIM115 (closed below)
        logs.append(out)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(port), str(i), mode, str(init_timeout)],
                env=env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        )
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() - start > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                for p in procs:
                    p.wait()
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
        os.unlink(log.name)
    return [p.returncode for p in procs], outputs, time.monotonic() - start


def test_two_processes_equal_one_device():
    codes, outputs, seconds = launch("run")
    text = "\n\n".join(f"--- process {i} (exit {c})\n{o[-3000:]}" for i, (c, o) in enumerate(zip(codes, outputs)))
    assert codes == [0, 0], text
    line = next(x for x in outputs[0].splitlines() if x.startswith("RESULT "))
    results = json.loads(line[len("RESULT ") :])
    print(f"{seconds:.1f} s:", json.dumps(results, indent=1))
    expect = {
        "batch x heads": set(),
        "ring": {"collective-permute"},
        "all-to-all": {"all-to-all"},
        "hybrid": {"all-to-all", "collective-permute"},
    }
    assert set(results) == set(expect), results
    for name, r in results.items():
        assert set(r["forward"]) == set(r["backward"]) == expect[name], (name, r)
        assert len(r["errors"]) == 4 and max(r["errors"]) <= 2e-5, (name, r)


def test_a_process_that_dies_ends_the_job():
    codes, outputs, seconds = launch("die", deadline=120)
    assert codes[1] == 7, (codes, outputs)
    assert codes[0] != 0, (codes, outputs)  # ended, not left waiting in its collective
    assert seconds < 60, seconds


def test_a_coordinator_that_never_answers_fails_in_bounded_time():
    # Only process 1: nobody serves the coordinator's port.
    codes, outputs, seconds = launch("run", process_ids=(1,), init_timeout=5, deadline=120)
    assert codes[0] not in (0, -9), (codes, outputs)  # it gave up itself, before the deadline
    assert "DEADLINE_EXCEEDED" in outputs[0] or "Deadline Exceeded" in outputs[0], outputs[0][-2000:]
    assert seconds < 60, seconds
