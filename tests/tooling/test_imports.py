"""Imports run one way (docs/architecture.md): every module of jax_flash imports alone, the
import graph of jax_flash/ has no circle, every import goes down the layer table below (or
stays in its layer), and no module reaches into another's private names.

The graph is read from the source (ast): top-level imports and the ones inside functions
alike, since a lazy import is an import all the same. The registry loads an implementation
by name (`importlib`, `_registry._MODULES`): that is how the layers above reach the
implementations without importing them, and it is no edge here.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The package the suite imports: the source tree, or an installed wheel's copy in site-packages.
PACKAGE = Path(importlib.util.find_spec("jax_flash").origin).parent

# Top to bottom. A module may import modules of its own layer or of a lower one. An entry
# names a module or a package prefix (the longest entry that matches a module decides).
LAYERS = (
    # Tooling: benchmarks and tuners, beside the product; they may import anything.
    ("tooling", ("jax_flash.bench", "jax_flash.pallas._tune")),
    # The public entry points: attention and explain, the dense reference, the export
    # helper, the flax / haiku integrations and the all-to-all sequence parallelism built on
    # `attention`, the package's face.
    (
        "front end",
        (
            "jax_flash",
            "jax_flash._api",
            "jax_flash._flex_api",
            "jax_flash._export",
            "jax_flash.reference",
            "jax_flash.flax",
            "jax_flash.haiku",
            "jax_flash.parallel.ulysses",
        ),
    ),
    # Features that reach the implementations through the registry, never by import.
    ("capabilities", ("jax_flash.inference", "jax_flash.inference.paged")),
    # The four implementations and their private parts (FFI calls, Pallas kernels).
    (
        "implementations",
        (
            "jax_flash.xla",
            "jax_flash.cpu",
            "jax_flash.cuda",
            "jax_flash.pallas",
            "jax_flash._ffi",
        ),
    ),
    # How a compiled call partitions over a mesh, and the ring that runs inside it (and
    # behind `ring_attention`): the implementations wrap their calls in it.
    ("parallel", ("jax_flash.parallel",)),
    # The one custom_vjp and the registry it dispatches through (by name).
    ("dispatch", ("jax_flash._vjp", "jax_flash._registry")),
    # Spec, settings, argument normalisation, masks, dropout bits, numerics, the schedule
    # rules and the Pallas tile table (data), split-KV chunking, the lse merge, the extension
    # and what it says of its build.
    (
        "shared",
        (
            "jax_flash._types",
            "jax_flash._spec",
            "jax_flash._paged_spec",
            "jax_flash._config",
            "jax_flash._normalize",
            "jax_flash._numerics",
            "jax_flash._masking",
            "jax_flash._flex",
            "jax_flash._dropout",
            "jax_flash._merge",
            "jax_flash._heuristics",
            "jax_flash.pallas._table",
            "jax_flash.inference.split_kv",
            "jax_flash._build",
            "jax_flash._jax_flash_ext",
            "jax_flash._jax_flash_emu",
        ),
    ),
)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(package: Path = PACKAGE) -> dict[str, Path]:
    """{module name: file} of every Python module of the package (no `__main__`)."""
    return {
        _module_name(p, package.parent): p
        for p in sorted(package.rglob("*.py"))
        if p.name != "__main__.py" and "__pycache__" not in p.parts
    }


def layer_of(module: str) -> int:
    """Index into LAYERS (0 = top) of the longest entry naming `module` or a package above it."""
    best, index = -1, None
    for i, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and len(entry) > best:
                best, index = len(entry), i
    if index is None:
        raise KeyError(f"{module} has no layer in tests/tooling/test_imports.py LAYERS")
    return index


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class Imports(ast.NodeVisitor):
    """The jax_flash modules one file imports (anywhere in it), and the private names it
    takes from them."""

    def __init__(self, module: str, is_package: bool, modules: set[str]):
        self.module, self.is_package, self.modules = module, is_package, modules
        self.edges: dict[str, int] = {}  # imported module -> first line
        self.aliases: dict[str, str] = {}  # local name -> jax_flash module it is bound to
        self.private: list[str] = []

    def _target(self, name: str) -> str:
        """The module that importing `name` runs last: `name` itself, else its package."""
        while name and name not in self.modules:
            name = name.rpartition(".")[0]
        return name

    def _edge(self, name: str, line: int):
        target = self._target(name)
        if target and target != self.module:
            self.edges.setdefault(target, line)

    def visit_Import(self, node: ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] == "jax_flash":
                self._edge(alias.name, node.lineno)
                if alias.asname:
                    self.aliases[alias.asname] = alias.name

    def visit_ImportFrom(self, node: ast.ImportFrom):
        source = _resolve(self.module, self.is_package, node)
        if source.split(".")[0] != "jax_flash":
            return
        for alias in node.names:
            full = f"{source}.{alias.name}"
            if full in self.modules:  # a submodule
                self._edge(full, node.lineno)
                self.aliases[alias.asname or alias.name] = full
            else:
                self._edge(source, node.lineno)
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    self.private.append(f"line {node.lineno}: from {source} import {alias.name}")

    def visit_Attribute(self, node: ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id in self.aliases:
            attr = node.attr
            target = f"{self.aliases[node.value.id]}.{attr}"
            if attr.startswith("_") and not attr.startswith("__") and target not in self.modules:
                self.private.append(f"line {node.lineno}: {node.value.id}.{attr}")
        self.generic_visit(node)


def import_graph(package: Path = PACKAGE):
    """({module: {imported module: line}}, {module: [private names it reaches]})."""
    modules = package_modules(package)
    names = set(modules) | {"jax_flash._jax_flash_ext", "jax_flash._jax_flash_emu"}
    graph, private = {}, {}
    for name, path in modules.items():
        visitor = Imports(name, path.name == "__init__.py", names)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        graph[name], private[name] = visitor.edges, visitor.private
    return graph, private


def cycles(graph: dict[str, dict]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer_violations(graph: dict[str, dict]) -> list[str]:
    out = []
    for source, targets in sorted(graph.items()):
        for target, line in sorted(targets.items()):
            if layer_of(source) > layer_of(target):
                out.append(
                    f"{source} (line {line}, {LAYERS[layer_of(source)][0]}) imports {target} "
                    f"({LAYERS[layer_of(target)][0]}, a layer above)"
                )
    return out


def test_every_module_has_a_layer():
    missing = []
    for module in package_modules():
        try:
            layer_of(module)
        except KeyError as e:
            missing.append(str(e))
    assert not missing, missing


def test_no_import_circles():
    graph, _ = import_graph()
    assert not cycles(graph), f"import circles in jax_flash/: {cycles(graph)}"


def test_imports_go_down_the_layers():
    graph, _ = import_graph()
    bad = layer_violations(graph)
    assert not bad, "imports against the layers (docs/architecture.md):\n" + "\n".join(bad)


def test_no_private_names_across_modules():
    _, private = import_graph()
    bad = {m: names for m, names in private.items() if names}
    assert not bad, f"modules that take another module's private names: {bad}"


def test_the_check_sees_a_circle_and_an_upward_import(tmp_path):
    """The checks above can fail: a copy of the package with one lazy import added inside a
    function (split_kv -> xla, the circle this layout removed) has a circle and an import up
    the layers, and a private name taken."""
    copy = tmp_path / "jax_flash"
    for path in package_modules().values():
        target = copy / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    split_kv = copy / "inference" / "split_kv.py"
    split_kv.write_text(
        split_kv.read_text() + "\n\ndef _planted():\n    from jax_flash import xla\n\n    return xla._Tiles\n"
    )
    graph, private = import_graph(copy)
    assert ["jax_flash.inference.split_kv", "jax_flash.xla"] in cycles(graph)
    assert any(
        v.startswith("jax_flash.inference.split_kv ") and "imports jax_flash.xla" in v for v in layer_violations(graph)
    )
    assert any("xla._Tiles" in p for p in private["jax_flash.inference.split_kv"])


# Run in one fresh interpreter: for each module, every jax_flash module is dropped from
# sys.modules, then the module alone is imported (jax stays loaded: it is not ours).
_IMPORT_EACH = """
import importlib, json, sys, traceback
failures = {}
for name in json.loads(sys.argv[1]):
    for loaded in [m for m in sys.modules if m == "jax_flash" or m.startswith("jax_flash.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ImportError as e:
        missing = getattr(e, "name", None) or ""
        if missing.split(".")[0] in OPTIONAL:
            continue  # an optional dependency of that module (flax, haiku) is not installed
        failures[name] = traceback.format_exc()
    except Exception:
        failures[name] = traceback.format_exc()
print(json.dumps(failures))
"""


def test_each_module_imports_alone():
    code = "OPTIONAL = ('flax', 'haiku', 'matplotlib')\n" + _IMPORT_EACH
    run = subprocess.run(
        [sys.executable, "-c", code, json.dumps(list(package_modules()))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    failures = json.loads(run.stdout.strip().splitlines()[-1])
    assert not failures, "\n\n".join(f"{name}:\n{tb}" for name, tb in failures.items())
