"""The extension module's stub (jax_flash/_jax_flash_ext.pyi) against the built module: the
same functions with the same parameters, as nanobind's own stub generator reads them."""

from __future__ import annotations

import ast
import pathlib

import pytest

import jax_flash

STUB = pathlib.Path(jax_flash.__file__).parent / "_jax_flash_ext.pyi"


def _functions(source: str) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """name -> (positional-only parameters' count as a tuple of '_', other parameters' names)."""
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            a = node.args
            named = tuple(x.arg for x in (*a.args, *a.kwonlyargs))
            out[node.name] = (("_",) * len(a.posonlyargs), named)
    return out


def test_stub_matches_the_built_module():
    ext = pytest.importorskip("jax_flash._jax_flash_ext")
    stubgen = pytest.importorskip("nanobind.stubgen")
    gen = stubgen.StubGen(ext, include_docstrings=False)
    gen.put(ext)
    built = _functions(gen.get())
    assert built, "nanobind's stub generator found no function in the extension"
    assert _functions(STUB.read_text()) == built
