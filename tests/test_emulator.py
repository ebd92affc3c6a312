"""Unit tests of the host emulation of the SIMT model and the PTX wrappers (cuda/emu/).

Compiles cuda/emu/tests/emu_test.cc with the emulator's sources and runs it: every emulated
PTX wrapper against the PTX ISA's fragment tables, the fiber runtime, and the strictness
checks (poisoned shared memory, cp.async landing only at wait_group, missing lanes, partial
__syncthreads). Needs only a C++17 host compiler; no GPU, no extension build.
"""

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CUDA_DIR = ROOT / "cuda"
SOURCES = [
    CUDA_DIR / "emu" / "tests" / "emu_test.cc",
    CUDA_DIR / "emu" / "simt.cc",
    CUDA_DIR / "emu" / "ptx_emu.cc",
]
CXX = os.environ.get("CXX", "g++")


def _build(tmp_path, name, extra_flags=()):
    if shutil.which(CXX) is None:
        pytest.skip(f"no C++ compiler ({CXX}) on PATH")
    exe = tmp_path / name
    cmd = [CXX, "-std=c++17", "-O1", "-Wall", "-Wextra", *extra_flags, f"-I{CUDA_DIR}",
           *map(str, SOURCES), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"compile failed: {' '.join(cmd)}\n{proc.stderr}"
    return exe


def _run(exe, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and " 0 failed" in out, f"emulator unit tests failed:\n{out}"
    return out


@pytest.fixture(scope="module")
def emu_test_exe(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("emu"), "emu_test")


def test_emulator_unit_tests(emu_test_exe):
    out = _run(emu_test_exe)
    print(out)


@pytest.mark.parametrize("schedule", ["reverse", "shuffle:7"])
def test_emulator_unit_tests_other_schedules(emu_test_exe, schedule):
    # The tests that pass an explicit schedule keep it; the rest run under this one.
    _run(emu_test_exe, {"JAX_FLASH_EMU_SCHEDULE": schedule})


def test_emulator_unit_tests_asan(tmp_path):
    # AddressSanitizer through the fiber switches: no stray access, no leak on the error paths.
    if shutil.which(CXX) is None:
        pytest.skip(f"no C++ compiler ({CXX}) on PATH")
    probe = tmp_path / "probe.cc"
    probe.write_text("int main() { return 0; }\n")
    if subprocess.run([CXX, "-fsanitize=address", str(probe), "-o", str(tmp_path / "probe")],
                      capture_output=True).returncode != 0:
        pytest.skip("no AddressSanitizer runtime")
    exe = _build(tmp_path, "emu_test_asan", ["-g", "-fsanitize=address", "-fno-omit-frame-pointer"])
    _run(exe, {"JAX_FLASH_EMU_SCHEDULE": "shuffle:5"})


def test_emulator_unit_tests_ucontext(tmp_path):
    # The portable context switch (ucontext), used where the x86-64 one is not.
    exe = _build(tmp_path, "emu_test_ucontext", ["-DJAX_FLASH_EMU_UCONTEXT"])
    _run(exe, {"JAX_FLASH_EMU_SCHEDULE": "shuffle:11"})


SELFTEST = ROOT / "build" / "ptx_selftest.cu"


def test_ptx_selftest_builds(tmp_path):
    """build/ptx_selftest.cu: its emulated side always compiles; with nvcc the whole program
    builds, and on a machine with an sm_80+ GPU it runs every wrapper on the hardware and
    compares with the emulation lane by lane."""
    if shutil.which(CXX) is None:
        pytest.skip(f"no C++ compiler ({CXX}) on PATH")
    objs = []
    for name, src, flags in [("emu_side", SELFTEST, ["-DJAX_FLASH_EMULATE", "-x", "c++"]),
                             ("simt", CUDA_DIR / "emu" / "simt.cc", []),
                             ("ptx_emu", CUDA_DIR / "emu" / "ptx_emu.cc", [])]:
        obj = tmp_path / f"{name}.o"
        cmd = [CXX, "-std=c++17", "-O1", "-Wall", "-Wextra", f"-I{CUDA_DIR}", *flags, "-c", str(src), "-o", str(obj)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"compile failed: {' '.join(cmd)}\n{proc.stderr}"
        objs.append(str(obj))
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("emulated side compiles; no nvcc for the GPU side")
    exe = tmp_path / "ptx_selftest"
    # sm_80 SASS plus compute_80 PTX: runs on every supported GPU (JIT-compiled on newer ones).
    arch = os.environ.get("JAX_FLASH_SELFTEST_ARCH", "sm_80")
    cmd = [nvcc, "-std=c++17", "-O2", f"-arch={arch}", f"-I{CUDA_DIR}", str(SELFTEST), *objs, "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"nvcc failed: {' '.join(cmd)}\n{proc.stderr}"
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    if run.returncode == 2 and "NO DEVICE" in run.stdout:
        pytest.skip(f"built with nvcc; not run: {run.stdout.strip()}")
    assert run.returncode == 0, f"GPU and emulation differ:\n{run.stdout}{run.stderr}"
