"""build/mutation_check.py cannot rot: every mutation still applies to the kernel source (no
stale original text), and the --fast subset (the deterministic dQ kernel's sign, caught,
and the speed-only swizzle, surviving) runs end to end: scratch copy, emulation-only rebuild,
tests (about two minutes on 2 cores).
The full check (every mutation, tens of minutes) is run by hand; its table is in
docs/verification.md."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "build" / "mutation_check.py"


def _run(*args, timeout):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def test_every_mutation_applies():
    r = _run("--list", timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "STALE" not in r.stdout


def test_fast_mutation_check():
    if shutil.which("cmake") is None or shutil.which("git") is None:
        pytest.skip("cmake and git are needed to build the scratch copy")
    r = _run("--fast", timeout=1500)
    print(r.stdout[-4000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    for name in ("det_ds_sign",):
        assert any(line.startswith(name) and " caught " in line for line in r.stdout.splitlines()), name
    assert any(line.startswith("swizzle_off") and "survived (speed-only)" in line for line in r.stdout.splitlines())
