"""Which kernel image a GPU runs (jax_flash.cuda.kernel_image), and the default architectures:
every capability from 8.0 up has an image (a cubin, or the compute_80 PTX the driver
JIT-compiles, e.g. on sm_110), and a build without one for the GPU is refused before any
launch, with the reason in `explain`."""

from __future__ import annotations

import pathlib
import re
import tomllib

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import _build, _ffi, _registry, cuda as jf_cuda

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _wheel_architectures():
    """The architectures of JAX_FLASH_CUDA=ON (the wheels, CI), from cuda/CMakeLists.txt."""
    cmake = (ROOT / "cuda" / "CMakeLists.txt").read_text()
    return re.search(r'set\(JAX_FLASH_WHEEL_ARCHS "([^"]+)"', cmake).group(1)


def test_wheel_architectures_cover_every_later_gpu_and_source_builds_choose():
    archs = _wheel_architectures().split(";")
    assert archs == ["80-real", "90-real", "100-real", "120-real", "80-virtual"]
    for major in range(8, 16):
        for minor in range(10):
            assert jf_cuda.kernel_image((major, minor), archs) is not None, (major, minor)
    # Ampere and Ada (8.6, 8.9) run the sm_80 cubin, Blackwell B200/B300 (10.0, 10.3) the sm_100
    # one, sm_110 the PTX.
    assert [jf_cuda.kernel_image(cc, archs) for cc in ((8, 6), (8, 9), (10, 0), (10, 3), (11, 0), (12, 1))] == [
        "sm_80",
        "sm_80",
        "sm_100",
        "sm_100",
        "compute_80 PTX",
        "sm_120",
    ]
    # A source build chooses by JAX_FLASH_CUDA (AUTO: the visible GPUs); an explicit list is
    # empty by default, in CMake and in pyproject.toml alike.
    cmake = (ROOT / "cuda" / "CMakeLists.txt").read_text()
    assert 'set(JAX_FLASH_CUDA_ARCHS "" CACHE' in cmake and 'set(JAX_FLASH_CUDA "AUTO" CACHE' in cmake
    toml = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["scikit-build"]["cmake"]["define"]
    assert toml["JAX_FLASH_CUDA_ARCHS"]["default"] == "" and toml["JAX_FLASH_CUDA"]["default"] == "AUTO"


@pytest.mark.parametrize(
    "cc, archs, image",
    [
        ((8, 0), "80-real,80-virtual,90-real,120-real,120-virtual", "sm_80"),
        ((8, 9), "80-real,80-virtual,90-real,120-real,120-virtual", "sm_80"),
        ((9, 0), "80-real,80-virtual,90-real,120-real,120-virtual", "sm_90"),
        ((10, 0), "80-real,80-virtual,90-real,120-real,120-virtual", "compute_80 PTX"),
        ((10, 3), "80-real,80-virtual,90-real,120-real,120-virtual", "compute_80 PTX"),
        ((12, 1), "80-real,80-virtual,90-real,120-real,120-virtual", "sm_120"),
        ((13, 0), "80-real,80-virtual,90-real,120-real,120-virtual", "compute_120 PTX"),
        ((10, 0), "80-real,90-real,120-real,120-virtual", None),  # the old default
        ((9, 0), "90a-real", "sm_90a"),
        ((10, 0), "90a-real,90a-virtual", None),
        ((8, 6), "86", "sm_86"),
        ((8, 0), "86", None),
        ((9, 0), "native", "unknown"),
    ],
)
def test_kernel_image(cc, archs, image):
    assert jf_cuda.kernel_image(cc, archs.split(",")) == image


def _pretend_gpu(monkeypatch, cc, archs):
    monkeypatch.delenv("JAX_FLASH_EMULATE_CUDA", raising=False)
    monkeypatch.setattr(_registry, "platform", lambda: "gpu")
    monkeypatch.setattr(_ffi, "has_cuda_kernels", lambda: True)
    monkeypatch.setattr(jf_cuda, "_compute_capability", lambda: cc)
    monkeypatch.setattr(jf_cuda, "_architectures", lambda: tuple(archs.split(",")))
    # A driver for the kernels' runtime (tests/internals/test_build_info.py fakes older ones).
    monkeypatch.setattr(_build, "cuda_driver_version", lambda: 13000)
    monkeypatch.setattr(_build, "cuda_runtime_version", lambda: 13000)


def _spec():
    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    from jax_flash._normalize import canonicalize

    return canonicalize(q, q, q, None, None).spec


def test_gpu_without_an_image_is_refused(monkeypatch):
    _pretend_gpu(monkeypatch, (10, 0), "80-real,90-real,120-real,120-virtual")
    why = jf_cuda.IMPLEMENTATION.unsupported(_spec())
    assert why is not None and "no kernel image for compute capability 10.0" in why and "80-virtual" in why


def test_gpu_that_jits_the_ptx_is_explained(monkeypatch):
    _pretend_gpu(monkeypatch, (10, 3), "80-real,80-virtual,90-real,120-real,120-virtual")
    spec = _spec()
    assert jf_cuda.IMPLEMENTATION.unsupported(spec) is None
    note = jf_cuda.IMPLEMENTATION.note(spec)
    assert "compute_80 PTX" in note and "JIT" in note
    notes = _registry.notes(spec, {"cuda": None})
    assert notes["cuda"] == note
    summary = _registry.summaries(spec, {"cuda": None})["cuda"]
    assert summary.startswith("compute_80 PTX JIT-compiled by the driver (no cubin for this GPU), warp16 layout"), (
        summary
    )
    _pretend_gpu(monkeypatch, (9, 0), "80-real,80-virtual,90-real,120-real,120-virtual")
    assert jf_cuda.IMPLEMENTATION.note(spec).startswith("runs the sm_90 cubin; layout warp16")
    assert jf_cuda.IMPLEMENTATION.summary(spec).startswith("warp16 layout"), jf_cuda.IMPLEMENTATION.summary(spec)


def test_explain_names_the_layout(monkeypatch):
    """The note says which warp layout a call runs (JAX_FLASH_CUDA_LAYOUT), per head dim, and an
    unknown value is a ValueError naming the variable when a call is traced."""
    monkeypatch.setenv("JAX_FLASH_EMULATE_CUDA", "1")
    monkeypatch.delenv("JAX_FLASH_CUDA_LAYOUT", raising=False)
    q64 = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    q128 = jnp.zeros((1, 8, 2, 128), jnp.bfloat16)
    e = jax_flash.explain(q64, q64, q64, implementation="cuda")
    if e.reasons["cuda"] is not None:
        pytest.skip(e.reasons["cuda"])
    assert "layout warp16" in e.notes["cuda"]
    monkeypatch.setenv("JAX_FLASH_CUDA_LAYOUT", "warp32")
    note = jax_flash.explain(q64, q64, q64, implementation="cuda").notes["cuda"]
    assert "layout warp32: forward 4 warps x 32 rows, backward 128 keys per CTA" in note
    note = jax_flash.explain(q128, q128, q128, implementation="cuda").notes["cuda"]
    assert "forward 8 warps x 16 rows (no warp32 kernel at this head dim)" in note
    monkeypatch.setenv("JAX_FLASH_CUDA_LAYOUT", "wide")
    assert "JAX_FLASH_CUDA_LAYOUT='wide'" in jax_flash.explain(q64, q64, q64, implementation="cuda").notes["cuda"]
    with pytest.raises(ValueError, match="JAX_FLASH_CUDA_LAYOUT='wide'"):
        jax.jit(lambda q: jax_flash.attention(q, q, q, implementation="cuda")).lower(q64)


def test_explain_prints_the_note(monkeypatch):
    """One plain line per implementation; verbose=True adds the rule behind it (the note)."""
    monkeypatch.setenv("JAX_FLASH_EMULATE_CUDA", "1")
    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    e = jax_flash.explain(q, q, q, implementation="cuda")
    if e.reasons["cuda"] is not None:
        pytest.skip(e.reasons["cuda"])
    assert "emulation" in e.notes["cuda"] and e.notes["cuda"] not in str(e)
    line = next(l for l in str(e).splitlines() if l[3:].startswith("cuda "))
    assert "available: host emulation (JAX_FLASH_EMULATE_CUDA=1), warp16 layout, split-KV" in line, line
    verbose = str(jax_flash.explain(q, q, q, implementation="cuda", verbose=True))
    assert e.notes["cuda"] in verbose and line in verbose.splitlines()


def test_extension_reports_its_architectures():
    try:
        from jax_flash import _jax_flash_ext as ext
    except ImportError as e:
        pytest.skip(f"extension not built: {e}")
    text = ext.cuda_architectures()
    assert (text != "") == bool(ext.has_cuda())
    if text:
        assert all(jf_cuda._parse_arch(a) is not None or a in ("native", "all", "all-major") for a in text.split(","))
