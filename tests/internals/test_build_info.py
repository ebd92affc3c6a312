"""What the installed extension says of its build (`jax_flash.build_info()`), and the checks
that use it before a launch: the CUDA driver against the kernels' runtime (a faked driver
version), and Pallas's Triton backend missing from JAX (a simulated module layout)."""

from __future__ import annotations

import importlib.util
import re
import sys
import types

import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import _build, _ffi, _registry, cuda as jf_cuda, pallas as jf_pallas
from jax_flash._normalize import canonicalize
from jax_flash.pallas import _triton_kernels

WHEEL_ARCHS = "80-real,90-real,100-real,120-real,80-virtual"


def _extension():
    try:
        from jax_flash import _jax_flash_ext as ext
    except ImportError as e:
        pytest.skip(f"extension not built: {e}")
    return ext


def test_build_info_reports_the_extension():
    ext = _extension()
    info = jax_flash.build_info()
    raw = ext.build_info()
    assert info.extension
    assert info.emulator == (importlib.util.find_spec("jax_flash._jax_flash_emu") is not None)
    # CUDA kernels <=> a runtime version <=> architectures; the flavour names the runtime's major.
    assert bool(ext.has_cuda()) == (raw["cuda_runtime_version"] > 0) == bool(raw["cuda_architectures"])
    if ext.has_cuda():
        assert info.cuda_runtime == _build.version_text(raw["cuda_runtime_version"])
        assert info.flavour == f"cuda{raw['cuda_runtime_version'] // 1000}"
        assert info.sass or info.ptx
    else:
        assert (info.cuda_runtime, info.flavour, info.sass, info.ptx) == (None, "cpu", (), ())
    # Why those architectures, in the words of cuda/CMakeLists.txt.
    assert info.cuda_selection.startswith(("AUTO:", "JAX_FLASH_CUDA=ON", "JAX_FLASH_CUDA=OFF", "JAX_FLASH_CUDA_ARCHS"))
    # The cpu kernels: every ISA the dispatcher may choose, and the one this CPU runs among them.
    assert "generic" in info.cpu_isas and ext.cpu_isa("") in info.cpu_isas
    text = str(info)
    assert info.cuda_selection in text and ", ".join(info.cpu_isas) in text and info.flavour in text


def test_images_of_the_architecture_list():
    assert _build._images(WHEEL_ARCHS) == (("sm_80", "sm_90", "sm_100", "sm_120"), ("compute_80",))
    assert _build._images("86") == (("sm_86",), ("compute_86",))
    assert _build._images("") == ((), ())


def test_python_m_jax_flash_prints_the_build(capsys):
    _extension()
    from jax_flash.__main__ import main

    main()
    out = capsys.readouterr().out
    assert str(jax_flash.build_info()) in out and "jax_flash.attention would run:" in out


# --- the CUDA driver -----------------------------------------------------------------


def _pretend_gpu(monkeypatch, *, driver: int, runtime: int = 13000, cc=(9, 0), archs=WHEEL_ARCHS):
    monkeypatch.delenv("JAX_FLASH_EMULATE_CUDA", raising=False)
    monkeypatch.setattr(_registry, "platform", lambda: "gpu")
    monkeypatch.setattr(_ffi, "has_cuda_kernels", lambda: True)
    monkeypatch.setattr(jf_cuda, "_compute_capability", lambda: cc)
    monkeypatch.setattr(jf_cuda, "_architectures", lambda: tuple(archs.split(",")))
    monkeypatch.setattr(_build, "cuda_driver_version", lambda: driver)
    monkeypatch.setattr(_build, "cuda_runtime_version", lambda: runtime)


def _spec():
    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    return canonicalize(q, q, q, None, None).spec


def test_driver_too_old_for_the_runtime_names_driver_and_flavour(monkeypatch):
    _pretend_gpu(monkeypatch, driver=12080)
    why = jf_cuda.IMPLEMENTATION.unsupported(_spec())
    assert why is not None
    assert "CUDA 13.0 runtime" in why and "CUDA 13.0 or newer" in why and "580.65.06" in why
    assert "this driver supports CUDA 12.8" in why and 'pip install "jax_flash[cuda12]"' in why
    # implementation=None runs another one and says why not cuda.
    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    e = jax_flash.explain(q, q, q)
    assert e.selected != "cuda" and e.reasons["cuda"] == why and why in str(e)
    # An explicit request is refused with the reason, never run.
    with pytest.raises(ValueError, match=re.escape("580.65.06")):
        jax_flash.attention(q, q, q, implementation="cuda")


def test_driver_of_no_known_flavour(monkeypatch):
    _pretend_gpu(monkeypatch, driver=11080, runtime=12040)
    why = jf_cuda.IMPLEMENTATION.unsupported(_spec())
    assert "CUDA 12.4 runtime" in why and "525.60.13" in why and "CUDA 11.8" in why and "flavour" not in why
    _pretend_gpu(monkeypatch, driver=0)
    assert "no NVIDIA driver library was found" in jf_cuda.IMPLEMENTATION.unsupported(_spec())


def test_driver_of_the_runtimes_major_version_runs_cubins(monkeypatch):
    # Minor-version compatibility: a 13.2 runtime's cubins run on a 13.0 driver.
    _pretend_gpu(monkeypatch, driver=13000, runtime=13020)
    assert jf_cuda.IMPLEMENTATION.unsupported(_spec()) is None
    _pretend_gpu(monkeypatch, driver=13000, runtime=13000)
    assert jf_cuda.IMPLEMENTATION.unsupported(_spec()) is None


def test_ptx_needs_a_driver_as_new_as_its_toolkit(monkeypatch):
    # sm_110 has no cubin in the wheel list: it JIT-compiles the compute_80 PTX.
    _pretend_gpu(monkeypatch, driver=13000, runtime=13020, cc=(11, 0))
    why = jf_cuda.IMPLEMENTATION.unsupported(_spec())
    assert why is not None and "compute_80 PTX" in why and "CUDA 13.2" in why and "JIT" in why
    _pretend_gpu(monkeypatch, driver=13020, runtime=13020, cc=(11, 0))
    assert jf_cuda.IMPLEMENTATION.unsupported(_spec()) is None


def test_build_without_kernels_says_why_and_what_to_install(monkeypatch):
    monkeypatch.delenv("JAX_FLASH_EMULATE_CUDA", raising=False)
    monkeypatch.setattr(_registry, "platform", lambda: "gpu")
    monkeypatch.setattr(_ffi, "has_cuda_kernels", lambda: False)
    monkeypatch.setattr(_ffi, "missing", lambda target, plat: None)
    monkeypatch.setattr(
        _build,
        "build_info",
        lambda: _build.BuildInfo(True, None, "cpu", (), (), "AUTO: no NVIDIA GPU visible (nvidia-smi)", (), False, ""),
    )
    why = jf_cuda.IMPLEMENTATION.unsupported(_spec())
    assert (
        "AUTO: no NVIDIA GPU visible" in why and 'pip install "jax_flash[cuda13]"' in why and "JAX_FLASH_CUDA=ON" in why
    )


# --- Pallas's Triton backend -----------------------------------------------------------


def test_jax_without_pallas_triton_makes_pallas_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, _triton_kernels.TRITON_MODULE, None)
    why = jf_pallas.IMPLEMENTATION.unsupported(_spec())
    assert why is not None and "has no Pallas Triton backend" in why and "jax.experimental.pallas.triton" in why
    q = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
    e = jax_flash.explain(q, q, q)
    assert e.selected != "pallas" and e.reasons["pallas"] == why
    with pytest.raises(ValueError, match="has no Pallas Triton backend"):
        jax_flash.attention(q, q, q, implementation="pallas")


def test_pallas_notes_the_deprecation_on_jax_0_11(monkeypatch):
    monkeypatch.setattr(_triton_kernels, "jax_version", lambda: (0, 10))
    assert _triton_kernels.triton_deprecation() is None
    assert "deprecates" not in jf_pallas.IMPLEMENTATION.note(_spec())
    monkeypatch.setattr(_triton_kernels, "jax_version", lambda: (0, 11))
    note = jf_pallas.IMPLEMENTATION.note(_spec())
    assert "deprecates Pallas's Triton backend" in note


def test_triton_compiler_params_of_either_jax_layout(monkeypatch):
    """jax 0.10-0.12 name the Triton parameters `CompilerParams`, earlier ones
    `TritonCompilerParams`: each module layout gives the call's warps and stages."""
    cfg = types.SimpleNamespace(num_warps=4, num_stages=2)

    class Params:
        def __init__(self, num_warps, num_stages):
            self.num_warps, self.num_stages = num_warps, num_stages

    for layout in ({"CompilerParams": Params}, {"TritonCompilerParams": Params}):
        monkeypatch.setitem(sys.modules, _triton_kernels.TRITON_MODULE, types.SimpleNamespace(**layout))
        params = _triton_kernels.compiler_params(cfg)
        assert isinstance(params, Params) and (params.num_warps, params.num_stages) == (4, 2)
