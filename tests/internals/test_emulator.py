"""Unit tests of the host emulation of the SIMT model and the PTX wrappers (cuda/emu/).

Compiles cuda/emu/tests/emu_test.cc with the emulator's sources and runs it: every emulated
PTX wrapper against the PTX ISA's fragment tables, the fiber runtime, and the strictness
checks (poisoned shared memory, cp.async landing only at wait_group, missing lanes, partial
__syncthreads), the race detector (a racy kernel per kind: RAW and WAR between warps and inside
a warp, a missing __syncwarp, ldmatrix and cp.async, and their correct variants, under four
schedules), the global-memory checks (out-of-bounds reads and writes, stores into operands, two
CTAs storing to one address, a read-modify-write in place of an atomic, atomics that are fine,
a plain access through a tagged pointer) and the approximate instructions' error bounds. Needs
only a C++17 host compiler; no GPU, no extension build. Also builds build/ptx_selftest.cu, and
runs it where there is a GPU.
"""

import concurrent.futures
import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CUDA_DIR = ROOT / "cuda"
EMU_TEST = CUDA_DIR / "emu" / "tests" / "emu_test.cc"
SIMT = CUDA_DIR / "emu" / "simt.cc"
PTX_EMU = CUDA_DIR / "emu" / "ptx_emu.cc"
SELFTEST = ROOT / "build" / "ptx_selftest.cu"
CXX = os.environ.get("CXX", "g++")
CXXFLAGS = ["-std=c++17", "-O1", "-Wall", "-Wextra", f"-I{CUDA_DIR}"]


def _need_cxx():
    if shutil.which(CXX) is None:
        pytest.skip(f"no C++ compiler ({CXX}) on PATH")


def _run_checked(cmd, what, timeout=300):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{what} failed: {' '.join(map(str, cmd))}\n{proc.stderr}"


def _compile_all(out_dir, units, extra_flags=()):
    """Compiles {name: (source, flags)} to out_dir/name.o, two at a time."""

    def one(item):
        name, (src, flags) = item
        obj = out_dir / f"{name}.o"
        _run_checked([CXX, *CXXFLAGS, *extra_flags, *flags, "-c", src, "-o", obj], f"compiling {name}")
        return name, obj

    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(one, units.items()))


def _link(out_dir, name, objs, extra_flags=()):
    exe = out_dir / name
    _run_checked([CXX, *extra_flags, *objs, "-o", exe], f"linking {name}")
    return exe


def _run(exe, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and " 0 failed" in out, f"emulator unit tests failed:\n{out}"
    return out


@pytest.fixture(scope="module")
def objects(tmp_path_factory):
    _need_cxx()
    out = tmp_path_factory.mktemp("emu")
    objs = _compile_all(
        out,
        {
            "emu_test": (EMU_TEST, []),
            "simt": (SIMT, []),
            "ptx_emu": (PTX_EMU, []),
            # The portable context switch (ucontext), used where the x86-64 one is not.
            "simt_ucontext": (SIMT, ["-DJAX_FLASH_EMU_UCONTEXT"]),
        },
    )
    return out, objs


@pytest.fixture(scope="module")
def emu_test_exe(objects):
    out, objs = objects
    return _link(out, "emu_test", [objs["emu_test"], objs["simt"], objs["ptx_emu"]])


def test_emulator_unit_tests(emu_test_exe):
    print(_run(emu_test_exe))


@pytest.mark.parametrize("schedule", ["reverse", "shuffle:7"])
def test_emulator_unit_tests_other_schedules(emu_test_exe, schedule):
    # The tests that pass an explicit schedule keep it; the rest run under this one.
    _run(emu_test_exe, {"JAX_FLASH_EMU_SCHEDULE": schedule})


def test_emulator_unit_tests_ucontext(objects):
    out, objs = objects
    exe = _link(out, "emu_test_ucontext", [objs["emu_test"], objs["simt_ucontext"], objs["ptx_emu"]])
    _run(exe, {"JAX_FLASH_EMU_SCHEDULE": "shuffle:11"})


def test_emulator_unit_tests_asan(tmp_path):
    # AddressSanitizer through the fiber switches: no stray access, no leak on the error paths.
    _need_cxx()
    probe = tmp_path / "probe.cc"
    probe.write_text("int main() { return 0; }\n")
    if (
        subprocess.run(
            [CXX, "-fsanitize=address", str(probe), "-o", str(tmp_path / "probe")], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("no AddressSanitizer runtime")
    flags = ["-g", "-fsanitize=address", "-fno-omit-frame-pointer"]
    objs = _compile_all(tmp_path, {"emu_test": (EMU_TEST, []), "simt": (SIMT, []), "ptx_emu": (PTX_EMU, [])}, flags)
    exe = _link(tmp_path, "emu_test_asan", list(objs.values()), ["-fsanitize=address"])
    _run(exe, {"JAX_FLASH_EMU_SCHEDULE": "shuffle:5"})


def test_ptx_selftest_builds(objects, tmp_path):
    """build/ptx_selftest.cu: its emulated side always compiles; with nvcc the whole program
    builds, and on a machine with an sm_80+ GPU it runs every wrapper on the hardware and
    compares with the emulation lane by lane."""
    _, objs = objects
    side = _compile_all(tmp_path, {"emu_side": (SELFTEST, ["-DJAX_FLASH_EMULATE", "-x", "c++"])})["emu_side"]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("emulated side compiles; no nvcc for the GPU side")
    exe = tmp_path / "ptx_selftest"
    # sm_80 SASS plus compute_80 PTX: runs on every supported GPU (JIT-compiled on newer ones).
    arch = os.environ.get("JAX_FLASH_SELFTEST_ARCH", "sm_80")
    _run_checked(
        [
            nvcc,
            "-std=c++17",
            "-O2",
            f"-arch={arch}",
            f"-I{CUDA_DIR}",
            SELFTEST,
            side,
            objs["simt"],
            objs["ptx_emu"],
            "-o",
            exe,
        ],
        "nvcc",
        timeout=600,
    )
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    if run.returncode == 2 and "NO DEVICE" in run.stdout:
        pytest.skip(f"built with nvcc; not run: {run.stdout.strip()}")
    assert run.returncode == 0, f"GPU and emulation differ:\n{run.stdout}{run.stderr}"


def test_ptx_selftest_host_driver(objects, tmp_path):
    """build/ptx_selftest.cu with both sides emulated (JAX_FLASH_SELFTEST_HOST_DRIVER): its
    comparisons pass on identical sides, and the emulated approximate instructions stay within
    their documented bounds; with one side perturbed every check fails (the self-test can fail)."""
    _, objs = objects
    sides = _compile_all(
        tmp_path,
        {
            "emu_side": (SELFTEST, ["-DJAX_FLASH_EMULATE", "-x", "c++"]),
            "host_side": (SELFTEST, ["-DJAX_FLASH_EMULATE", "-DJAX_FLASH_SELFTEST_HOST_DRIVER", "-x", "c++"]),
        },
    )
    exe = _link(tmp_path, "host_selftest", [sides["host_side"], sides["emu_side"], objs["simt"], objs["ptx_emu"]])
    for perturb in ("0", "1"):
        run = subprocess.run(
            [str(exe)],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, JAX_FLASH_SELFTEST_PERTURB=perturb),
        )
        assert run.returncode == 0, run.stdout + run.stderr
        checks = [line for line in run.stdout.splitlines() if line.startswith(("PASS ", "FAIL "))]
        assert len(checks) >= 12 and all(c.startswith("FAIL " if perturb == "1" else "PASS ") for c in checks), (
            run.stdout
        )


def test_emulator_is_a_module_of_its_own():
    """The emulated targets live in jax_flash._jax_flash_emu (built with JAX_FLASH_EMULATOR=ON for
    tests and CI), never in the extension a user installs; jax_flash registers both where they are
    built and says so where the emulator is not."""
    import importlib.util

    pytest.importorskip("jax")
    if importlib.util.find_spec("jax_flash._jax_flash_ext") is None:
        pytest.skip("the extension is not built")
    from jax_flash import _ffi, _jax_flash_ext

    emulated = {"jax_flash_emu_fwd", "jax_flash_emu_bwd", "jax_flash_emu_paged_fwd"}
    for platform, capsules in _jax_flash_ext.registrations().items():
        assert not emulated & set(capsules), f"the extension holds emulated targets on {platform}"
    if importlib.util.find_spec("jax_flash._jax_flash_emu") is None:
        why = _ffi.missing("jax_flash_emu_fwd", "cpu")
        assert why is not None and "JAX_FLASH_EMULATOR=ON" in why, why
        return
    from jax_flash import _jax_flash_emu

    assert set(_jax_flash_emu.registrations()) == {"cpu"}
    assert set(_jax_flash_emu.registrations()["cpu"]) == emulated
    assert emulated <= _ffi.targets()["cpu"] and _ffi.missing("jax_flash_emu_bwd", "cpu") is None
