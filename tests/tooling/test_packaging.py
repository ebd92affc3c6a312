"""The package's metadata: one version, the license it declares, its type information."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import tomllib

import pytest

import jax_flash

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_is_written_once():
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    provider = PYPROJECT["tool"]["scikit-build"]["metadata"]["version"]
    assert provider["provider"] == "scikit_build_core.metadata.regex"
    # The source tree's file; against an installed wheel (tests copied out of the tree), the
    # installed copy of the same file.
    path = ROOT / provider["input"]
    if not path.exists():
        path = pathlib.Path(jax_flash.__file__).parent.parent / provider["input"]
    source = path.read_text()
    # scikit-build-core's default pattern for the regex provider
    found = re.findall(r'(?im)^(?:__version__|VERSION)(?: ?: ?str)? *= *([\'"])v?(.+?)\1', source)
    assert [v for _, v in found] == [jax_flash.__version__]
    try:
        installed = importlib.metadata.version("jax_flash")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("jax_flash is not installed (run from the source tree)")
    # A wheel's flavour is the local label of its version (X.Y.Z+cpu, +cu12; docs/installation.md).
    public, _, label = installed.partition("+")
    assert public == jax_flash.__version__
    assert label in ("", "cpu", "cu12", "emu", "cpu.emu", "cu12.emu"), installed


def test_license_and_type_information_ship():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text().splitlines()[1]
    package = pathlib.Path(jax_flash.__file__).parent
    assert (package / "py.typed").is_file() and (package / "_jax_flash_ext.pyi").is_file()
    assert PYPROJECT["tool"]["scikit-build"]["wheel"]["packages"] == ["jax_flash"]
