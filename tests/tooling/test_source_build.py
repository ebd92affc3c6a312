"""How a source build chooses its CUDA kernels (cuda/CMakeLists.txt, docs/installation.md):
CMake's configure step alone, with an `nvidia-smi` on PATH that lists made-up GPUs or none.

- AUTO with GPUs visible: a cubin per compute capability of 8.0 or newer, none for older ones;
- AUTO without a GPU: no CUDA kernels, said with the way to change it;
- JAX_FLASH_CUDA=OFF with an explicit list: an error naming both.

Needs nvcc (skipped without it); each configure takes a few seconds.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    shutil.which("nvcc") is None or shutil.which("cmake") is None, reason="nvcc or cmake not found"
)


def _configure(tmp_path, *, gpus: str | None, **defines: str) -> subprocess.CompletedProcess:
    """cmake -S cuda with a PATH whose nvidia-smi prints `gpus` (None: no nvidia-smi at all)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    nvcc_dir = str(pathlib.Path(shutil.which("nvcc")).resolve().parent)
    path = [str(bin_dir), nvcc_dir, str(pathlib.Path(sys.executable).parent)]
    # Everything else on PATH, less any real nvidia-smi.
    path += [
        p for p in os.environ.get("PATH", "").split(os.pathsep) if p and not (pathlib.Path(p) / "nvidia-smi").exists()
    ]
    if gpus is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\nprintf '{gpus}'\n")
        smi.chmod(0o755)
    args = [f"-D{k}={v}" for k, v in defines.items()]
    return subprocess.run(
        [
            "cmake",
            "-S",
            str(ROOT / "cuda"),
            "-B",
            str(tmp_path / "build"),
            f"-DPython_EXECUTABLE={sys.executable}",
            *args,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": os.pathsep.join(path)},
        timeout=300,
    )


def _jax_flash_lines(r: subprocess.CompletedProcess) -> str:
    return "\n".join(line for line in (r.stdout + r.stderr).splitlines() if "jax_flash" in line)


def test_auto_builds_for_the_visible_gpus_only(tmp_path):
    r = _configure(tmp_path, gpus="9.0\\n8.6\\n9.0\\n7.5\\n")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = _jax_flash_lines(r)
    assert "CUDA kernels for 90-real;86-real (AUTO: the visible GPUs (compute capability 9.0, 8.6, 7.5)" in lines
    assert "JAX_FLASH_CUDA=ON builds every architecture" in lines


def test_auto_without_a_gpu_builds_the_cpu_kernels_only(tmp_path):
    r = _configure(tmp_path, gpus=None)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = _jax_flash_lines(r)
    assert "no CUDA kernels, CPU kernels only (AUTO: no NVIDIA GPU visible (nvidia-smi))" in lines
    assert 'JAX_FLASH_CUDA_ARCHS="90-real" an explicit list' in lines


def test_off_with_a_list_is_an_error(tmp_path):
    r = _configure(tmp_path, gpus=None, JAX_FLASH_CUDA="OFF", JAX_FLASH_CUDA_ARCHS="90-real")
    assert r.returncode != 0
    assert "JAX_FLASH_CUDA=OFF with JAX_FLASH_CUDA_ARCHS=90-real" in r.stdout + r.stderr
