"""build/device_check.sh without a GPU: its plan fits the budget, and its plumbing (time caps,
states, logs, incremental JSON, the summary, a stop by signal) works, with each step's
command replaced by a stub (DEVICE_CHECK_CMD_<step>). Also: build/ptx_selftest.cu tests every
wrapper of cuda/kernels/ptx.h. The script's real dry run (`--dry-run`: build, emulated suite,
tiny benchmark) takes minutes and is not part of the suite.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "build" / "device_check.sh"
STEPS = ["machine", "build", "ptx_selftest", "correctness", "bench", "mosaic", "profile", "memcheck", "racecheck"]
# What the device machine brings back from $OUT: at most 8 files with plain names.
MAX_FILES = 8


def _env(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVICE_CHECK_")}
    env.update(OUT=str(tmp_path / "out"), **extra)
    return env


def _plan(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEVICE_CHECK_")}
    env.update(extra)
    proc = subprocess.run(["bash", str(SCRIPT), "--plan"], capture_output=True, text=True, env=env, timeout=30)
    caps = {m[1]: int(m[2]) for m in re.finditer(r"^\s+\d+ (\w+)\s+(\d+) s", proc.stdout + proc.stderr, re.M)}
    return proc, caps


@pytest.mark.parametrize("budget", [None, "600", "300", "100", "20"])
def test_plan_caps_sum_within_the_budget(budget):
    proc, caps = _plan(**({} if budget is None else {"DEVICE_CHECK_BUDGET_S": budget}))
    assert proc.returncode == 0, proc.stderr
    assert list(caps) == STEPS  # every step, in priority order
    limit = int(budget or 540)
    assert sum(caps.values()) <= limit and all(c >= 1 for c in caps.values())
    if budget is None:
        assert sum(caps.values()) == 540  # the default budget is used in full


def test_plan_refuses_caps_over_the_budget(tmp_path):
    proc, caps = _plan(DEVICE_CHECK_CAP_bench="1000", OUT=str(tmp_path / "out"))
    assert proc.returncode == 2
    assert "over the budget" in proc.stderr and caps["bench"] == 1000
    assert not (tmp_path / "out").exists()  # nothing ran


def _stubbed_run(tmp_path, budget=16, **stubs):
    cmds = {f"DEVICE_CHECK_CMD_{k}": v for k, v in stubs.items()}
    env = _env(tmp_path, DEVICE_CHECK_BUDGET_S=str(budget), **cmds)
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=env, timeout=budget + 30
    )
    return proc, time.monotonic() - t0, tmp_path / "out"


def _summary_states(stdout):
    rows = re.findall(r"^(\w+)\s+(ran|passed|failed|cut|skipped)\s+(\d+)\s+(\d+)", stdout, re.M)
    return {r[0]: r[1] for r in rows}


def test_stubbed_run_records_every_outcome(tmp_path):
    proc, seconds, out = _stubbed_run(
        tmp_path,
        machine="echo 'jax 0.0 (stub)'",
        build="echo compiling; echo built",
        ptx_selftest="echo 'FAIL ex2_approx: 3 mismatches'; exit 1",
        correctness="echo '== 4 passed =='",
        bench="echo 'bench: 2 of 2 cells measured'",
        mosaic='echo \'{"check": "mosaic_forward", "ok": true}\'',
        profile="echo 'ncu: not found'; exit 77",
        memcheck="echo checking; sleep 60",  # past its 1 s cap
        racecheck="echo 'compute-sanitizer: not found'; exit 77",
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a failed and a cut step
    assert seconds < 16 + 5
    expected = {
        "machine": "ran",
        "build": "passed",
        "ptx_selftest": "failed",
        "correctness": "passed",
        "bench": "passed",
        "mosaic": "passed",
        "profile": "skipped",
        "memcheck": "cut",
        "racecheck": "skipped",
    }
    # The summary table is printed last and names every step.
    tail = proc.stdout[proc.stdout.rindex("---- device_check:") :]
    assert _summary_states(tail) == expected
    assert "failed in" in tail.splitlines()[0]
    data = json.loads((out / "device_check.json").read_text())
    assert [s["step"] for s in data["steps"]] == STEPS
    assert {s["step"]: s["state"] for s in data["steps"]} == expected
    assert data["result"] == "failed" and data["dry_run"] is True and data["budget_s"] == 16
    by = {s["step"]: s for s in data["steps"]}
    assert by["ptx_selftest"]["note"] == "FAIL ex2_approx: 3 mismatches" and by["ptx_selftest"]["rc"] == 1
    assert by["memcheck"]["note"].startswith("cut at its limit of 1 s") and by["memcheck"]["seconds"] <= 2
    assert "jax 0.0 (stub)" in data["machine"]["text"]
    assert sum(s["cap_s"] for s in data["steps"]) <= 16
    # Each step's output is in its log; the machine's went into the JSON.
    assert (out / "build.log").read_text() == "compiling\nbuilt\n"
    assert (out / "memcheck.log").read_text() == "checking\n"
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= MAX_FILES and all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files), files
    assert "machine.log" not in files
    assert data["profile"] == "ncu: not found" and "profile.log" not in files  # the profile's text is in the JSON
    assert json.loads(data["mosaic"])["ok"] is True and "mosaic.log" not in files  # and the mosaic step's


def test_stubbed_run_elastic_steps_take_unused_time(tmp_path):
    proc, _, out = _stubbed_run(
        tmp_path,
        budget=20,
        machine="true",
        build="true",
        ptx_selftest="true",
        correctness='echo "limit $STEP_LIMIT"',
        bench='echo "limit $STEP_LIMIT"',
        mosaic="true",
        profile="true",
        memcheck="true",
        racecheck="true",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((out / "device_check.json").read_text())
    by = {s["step"]: s for s in data["steps"]}
    later = by["mosaic"]["cap_s"] + by["profile"]["cap_s"] + by["memcheck"]["cap_s"] + by["racecheck"]["cap_s"]
    # Nothing used its time: correctness gets all but the later steps' caps, and so does bench.
    # (less the seconds the stubs before took).
    assert by["correctness"]["limit_s"] >= 20 - later - by["bench"]["cap_s"] - 3 > by["correctness"]["cap_s"]
    assert by["bench"]["limit_s"] >= 20 - later - 3 > by["bench"]["cap_s"]
    assert (out / "bench.log").read_text() == f"limit {by['bench']['limit_s']}\n"
    assert data["result"] == "passed"


def test_failed_build_skips_the_steps_that_need_it(tmp_path):
    stale = tmp_path / "out"
    stale.mkdir()
    for name in ("bench.json", "bench.log", "correctness.log"):  # a previous run's
        (stale / name).write_text("old")
    proc, _, out = _stubbed_run(
        tmp_path,
        machine="true",
        build="echo 'nvcc: error'; exit 2",
        ptx_selftest="echo PASS",
        correctness="echo ran",
        bench="echo ran",
        mosaic="echo ran",
        profile="echo ran",
        memcheck="echo ran",
        racecheck="echo ran",
    )
    assert proc.returncode == 1
    states = {s["step"]: (s["state"], s["note"]) for s in json.loads((out / "device_check.json").read_text())["steps"]}
    assert states["build"] == ("failed", "nvcc: error")
    assert states["ptx_selftest"][0] == "passed"  # does not need the build
    assert states["mosaic"][0] == "passed"  # neither does the Mosaic GPU kernel
    for step in ("correctness", "bench", "profile", "memcheck", "racecheck"):
        assert states[step] == ("skipped", "needs the build, which failed")
        assert not (out / f"{step}.log").exists()
    assert not (out / "bench.json").exists()


def test_a_stopped_run_leaves_its_summary(tmp_path):
    cmds = dict(
        machine="true",
        build="true",
        ptx_selftest="true",
        correctness="echo started; sleep 60",
        bench="true",
        mosaic="true",
        profile="true",
        memcheck="true",
        racecheck="true",
    )
    env = _env(tmp_path, DEVICE_CHECK_BUDGET_S="100", **{f"DEVICE_CHECK_CMD_{k}": v for k, v in cmds.items()})
    proc = subprocess.Popen(["bash", str(SCRIPT), "--dry-run"], stdout=subprocess.PIPE, text=True, env=env)
    status, log = tmp_path / "out" / "device_check.json", tmp_path / "out" / "correctness.log"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # wait until correctness runs
        if log.exists() and log.read_text() == "started\n":
            assert '"step": "correctness", "state": "running"' in status.read_text()
            break
        time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("correctness never started")
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=20)
    assert proc.returncode == 143
    states = {s["step"]: s["state"] for s in json.loads(status.read_text())["steps"]}
    assert states == {
        "machine": "ran",
        "build": "passed",
        "ptx_selftest": "passed",
        "correctness": "cut",
        "bench": "skipped",
        "mosaic": "skipped",
        "profile": "skipped",
        "memcheck": "skipped",
        "racecheck": "skipped",
    }
    assert _summary_states(stdout[stdout.rindex("---- device_check:") :])["correctness"] == "cut"


def _ptx_wrappers() -> set[str]:
    """The wrappers of cuda/kernels/ptx.h: functions of namespace ptx with an emulation."""
    text = (ROOT / "cuda" / "kernels" / "ptx.h").read_text()
    defined = set(re.findall(r"__device__ __forceinline__ [\w:<>]+\s+(\w+)\(", text))
    emulated = set(re.findall(r"emu::(\w+)", text))
    assert emulated <= defined, emulated - defined
    assert defined - emulated <= {"smem_address"}, defined - emulated  # a helper, not an instruction
    return emulated


def test_ptx_selftest_covers_every_wrapper():
    wrappers = _ptx_wrappers()
    assert {"mma_m16n8k16_bf16", "ldmatrix_x4", "cp_async_16", "ex2_approx"} <= wrappers  # the parse works
    selftest = (ROOT / "build" / "ptx_selftest.cu").read_text()
    untested = sorted(w for w in wrappers if not re.search(rf"ptx::{w}\b", selftest))
    assert not untested, f"build/ptx_selftest.cu does not run these wrappers of ptx.h: {untested}"


def test_gpu_pass_runs_without_pytest():
    # tests/internals/test_gpu.py's own runner, with pytest hidden: conftest and the shared suite import
    # through its stand-in, and a selection that runs nothing exits 5 (not a pass).
    code = (
        "import runpy, sys; sys.modules['pytest'] = None; sys.path.insert(0, 'tests'); "
        "sys.argv = ['tests/internals/test_gpu.py', '-k', 'no such test']; "
        "runpy.run_path('tests/internals/test_gpu.py', run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "no tests ran" in proc.stdout
