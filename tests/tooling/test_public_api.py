"""Every function and class the package exports (`__all__` of jax_flash, jax_flash.flax and
jax_flash.haiku) is fully annotated: each parameter and the return of a function, of each
overload it declares, and of a class's constructor, public methods and properties. The
package ships py.typed, so these annotations are what a type checker sees of it."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import typing

import pytest

# module -> the package it needs (the integrations' modules import their framework).
MODULES = {"jax_flash": None, "jax_flash.flax": "flax", "jax_flash.haiku": "haiku"}
# A class's dunder methods that belong to its public signature.
PUBLIC_DUNDERS = ("__init__", "__call__")


def _unannotated(fn, *, bound: bool) -> list[str]:
    """The parameters of `fn` without an annotation, and "return" if it has none; `bound`:
    the first parameter is self or cls (not annotated by convention)."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())[1 if bound else 0 :]
    missing = [p.name for p in params if p.annotation is inspect.Parameter.empty]
    if sig.return_annotation is inspect.Signature.empty:
        missing.append("return")
    return missing


def _function(fn, *, bound: bool = False) -> dict[str, list[str]]:
    """{signature: unannotated names} of a function and of each of its overloads."""
    found = {}
    for i, overload in enumerate(typing.get_overloads(fn)):
        if missing := _unannotated(overload, bound=bound):
            found[f"overload {i}"] = missing
    if missing := _unannotated(fn, bound=bound):
        found["implementation" if typing.get_overloads(fn) else "signature"] = missing
    return found


def _class(cls: type) -> dict[str, list[str]]:
    """{member: unannotated names} of the members a class defines itself (not inherited)."""
    found = {}
    if dataclasses.is_dataclass(cls):
        untyped = [f.name for f in dataclasses.fields(cls) if f.type in (None, inspect.Parameter.empty)]
        if untyped:
            found["fields"] = untyped
    for member, value in vars(cls).items():
        if member.startswith("_") and member not in PUBLIC_DUNDERS:
            continue
        if isinstance(value, property):
            if value.fget is not None and (missing := _unannotated(value.fget, bound=True)):
                found[member] = missing
            continue
        if isinstance(value, staticmethod):
            fn, bound = value.__func__, False
        elif isinstance(value, classmethod):
            fn, bound = value.__func__, True
        elif inspect.isfunction(value):
            fn, bound = value, True
        else:
            continue  # a class attribute (its annotation is the class's own business)
        for where, missing in _function(fn, bound=bound).items():
            found[f"{member} ({where})"] = missing
    return found


def _public_names() -> list[tuple[str, str]]:
    names = []
    for module_name, needs in MODULES.items():
        if needs is not None and importlib.util.find_spec(needs) is None:
            continue  # collected without it; the test of that name would only skip
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) or callable(obj):
                names.append((module_name, name))
    return names


def test_every_export_is_collected():
    """The list below is not empty and holds the main entry points (a broken __all__ or an
    import error would otherwise pass the annotation test vacuously)."""
    names = {name for _, name in _public_names()}
    assert {
        "attention",
        "explain",
        "paged_attention",
        "ring_attention",
        "flex_attention",
        "create_block_mask",
        "BlockMask",
    } <= names, names


@pytest.mark.parametrize(("module_name", "name"), _public_names(), ids=lambda x: x)
def test_public_name_is_annotated(module_name, name):
    obj = getattr(importlib.import_module(module_name), name)
    missing = _class(obj) if inspect.isclass(obj) else _function(obj)
    assert not missing, f"{module_name}.{name} lacks annotations: {missing}"
