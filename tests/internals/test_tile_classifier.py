"""The tile classifiers against brute-force per-element visibility.

Compiles tests/internals/tile_classifier.cc for the host (the CUDA headers with
JAX_FLASH_EMULATE, as the emulator compiles them) and runs it: the CUDA kernels' Mask
(cuda/kernels/mask.h: keys_of_rows, rows_of_keys, is_interior, interior_row_blocks, the
segment ranges) and the
cpu kernels' MaskGeometry and ClassifyTile (cuda/cpu/problem.h) on every tile shape in use
(kernels/tile.h TileShapeFor over every compiled (H, Hv) and layout; cpu/tiling.h), with
lengths, window edges and query offsets within ±2 of every tile boundary and segment ids split
at them. Needs only a C++17 compiler; no extension, no GPU.

The mutants prove the check can fail: each copies one header into a temporary include
directory with one bound moved by one, and the program built on it must report a failure.
"""

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = next(p for p in pathlib.Path(__file__).resolve().parents if (p / "cuda" / "kernels" / "mask.h").exists())
CUDA_DIR = ROOT / "cuda"
SOURCE = pathlib.Path(__file__).resolve().parent / "tile_classifier.cc"
CXX = os.environ.get("CXX", "g++")
CXXFLAGS = ["-std=c++17", "-Wall", "-Wextra", "-Wno-unknown-pragmas"]

# (header under cuda/, text, replacement): each moves one bound of a classifier by one.
MUTANTS = {
    "cuda is_interior: one key past the row's interval": (
        "kernels/mask.h",
        "key_hi(t0) >= s0 + cols;",
        "key_hi(t0) >= s0 + cols - 1;",
    ),
    "cuda rows_of_keys: the last row dropped": (
        "kernels/mask.h",
        "min(q_valid, s1 - band_lo)}",
        "min(q_valid, s1 - band_lo - 1)}",
    ),
    "cuda interior_row_blocks: one block early": (
        "kernels/mask.h",
        "const int first = CeilDiv(max(0, s0 + cols - 1 - band_hi), block_q);",
        "const int first = CeilDiv(max(0, s0 + cols - 2 - band_hi), block_q);",
    ),
    "cuda interior_row_blocks: the last valid row's block": (
        "kernels/mask.h",
        "min(q_valid / block_q,",
        "min(CeilDiv(q_valid, block_q),",
    ),
    "cpu keys_of_row: the window's last key dropped": ("cpu/problem.h", "t + band.hi + 1)}", "t + band.hi)}"),
    "cpu ClassifyTile: full one key early": ("cpu/problem.h", "first.hi >= s0 + cols;", "first.hi >= s0 + cols - 1;"),
}


def _build(out_dir: pathlib.Path, include_first=None, optimize="-O1") -> pathlib.Path:
    if shutil.which(CXX) is None:
        pytest.skip(f"no C++ compiler ({CXX}) on PATH")
    exe = out_dir / "tile_classifier"
    includes = ([f"-I{include_first}"] if include_first else []) + [f"-I{CUDA_DIR}"]
    proc = subprocess.run(
        [CXX, *CXXFLAGS, optimize, *includes, str(SOURCE), "-o", str(exe)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"compiling {SOURCE.name} failed:\n{proc.stderr}"
    return exe


def _run(exe: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120)


def test_tile_classifiers_match_brute_force(tmp_path):
    proc = _run(_build(tmp_path))
    out = proc.stdout + proc.stderr
    print(out)
    assert proc.returncode == 0 and " 0 failed" in out, f"tile classifier check failed:\n{out}"
    # Every kernel of kernels/tile.h was swept (a shape list gone empty would pass vacuously).
    for kind in ("forward (", "forward, GQA packing", "backward dK/dV", "backward dQ", "cpu 128x128"):
        assert kind in out, f"no sweep of {kind!r}:\n{out}"


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_tile_classifier_check_catches_a_moved_bound(tmp_path, name):
    header, text, replacement = MUTANTS[name]
    original = (CUDA_DIR / header).read_text()
    assert original.count(text) == 1, f"the mutant's text {text!r} is no longer in cuda/{header} once"
    patched = tmp_path / "include" / header
    patched.parent.mkdir(parents=True)
    patched.write_text(original.replace(text, replacement))
    # Quoted includes of the patched header resolve to the copy: its directory comes first.
    # Unoptimised (a quicker build; the program stops at the first failures), the part the
    # header belongs to.
    exe = _build(tmp_path, tmp_path / "include", optimize="-O0")
    proc = _run(exe, "cpu" if header.startswith("cpu/") else "cuda")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "FAIL" in out, f"mutant {name!r} ({header}) was not detected:\n{out}"
