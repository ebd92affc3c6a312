"""The native extension modules' stubs (jax_flash/_*.pyi) against the built modules: the same
functions with the same parameters, as nanobind's own stub generator reads them."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

import jax_flash

PACKAGE = pathlib.Path(jax_flash.__file__).parent
# The extension modules: the main one, every module with a stub, and every one built into the
# source tree (a new module without a stub then fails here).
MODULES = sorted(
    {"_jax_flash_ext"}
    | {p.stem for p in PACKAGE.glob("_*.pyi")}
    | {p.name.split(".")[0] for p in (*PACKAGE.glob("_*.so"), *PACKAGE.glob("_*.pyd"))}
)


def _functions(source: str) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """name -> (positional-only parameters' count as a tuple of '_', other parameters' names)."""
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            a = node.args
            named = tuple(x.arg for x in (*a.args, *a.kwonlyargs))
            out[node.name] = (("_",) * len(a.posonlyargs), named)
    return out


@pytest.mark.parametrize("name", MODULES)
def test_stub_matches_the_built_module(name):
    stubgen = pytest.importorskip("nanobind.stubgen")
    try:
        ext = importlib.import_module(f"jax_flash.{name}")
    except ImportError as e:
        if name == "_jax_flash_ext":  # the package cannot work without it
            raise
        pytest.skip(f"jax_flash.{name} is not built here (an optional module): {e}")
    stub = PACKAGE / f"{name}.pyi"
    assert stub.is_file(), f"jax_flash.{name} has no stub {stub.name}"
    gen = stubgen.StubGen(ext, include_docstrings=False)
    gen.put(ext)
    built = _functions(gen.get())
    assert built, f"nanobind's stub generator found no function in jax_flash.{name}"
    assert _functions(stub.read_text()) == built
