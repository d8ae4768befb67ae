"""The package's imports: no cycle, and no module imports one from a layer above its own.

Layers, top to bottom: entry points -> services -> the loop -> drafters -> backends -> pure helpers. Every import
counts, those inside functions too (a lazy import is still a dependency). The package root (``verispec/__init__``)
is the public face: it gathers names from every layer and nothing inside the package imports it.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "verispec"

# (layer, module prefixes), top first; a module belongs to the layer of its longest matching prefix
LAYERS = [
    ("entry points", ["verispec.cli", "verispec.__main__"]),
    ("services", ["verispec.server", "verispec.ray", "verispec.bench", "verispec.audit", "verispec.eagle.train",
                  "verispec.training", "verispec.medusa.train"]),
    ("the loop", ["verispec.batching", "verispec.engine", "verispec.controller"]),
    ("drafters", ["verispec.drafters", "verispec.eagle", "verispec.medusa", "verispec.compat"]),
    ("backends", ["verispec.backends"]),
    ("kernels", ["verispec.blockmm"]),
    ("pure helpers", ["verispec.verify", "verispec.sampling", "verispec.tree", "verispec.text", "verispec.stats",
                      "verispec.analysis", "verispec.errors", "verispec.hidden_states", "verispec.prefix",
                      "verispec.version", "verispec.jsonl", "verispec.options"]),
]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (relative and absolute, anywhere in the file)."""
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    packages = {module_name(p, root) for p in root.rglob("__init__.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        here = name if name in packages else name.rpartition(".")[0]  # the package a relative import starts from
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:  # `from . import x` may name a module
                    if f"{target}.{alias.name}" in files:
                        found.add(f"{target}.{alias.name}")
                    elif target in files:
                        found.add(target)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name in files)
        graph[name] = {m for m in found if m.startswith(root.name) and m != name}
    return graph


def layer_of(module: str) -> int:
    best, layer = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, layer = len(prefix), i
    if layer is None:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in tests/test_layers.py")
    return layer


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle found by a depth-first walk (each as the modules on it)."""
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def problems(root: Path) -> list[str]:
    graph = import_graph(root)
    out = [" -> ".join(c) for c in cycles(graph)]
    face = root.name  # the package root: a face for users, imported by nothing inside
    for module, targets in sorted(graph.items()):
        if module == face:
            continue
        for target in sorted(targets):
            if target == face:
                out.append(f"{module} imports the package root {face}; import the module that defines the name")
            elif layer_of(target) < layer_of(module):
                out.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
                           f"({LAYERS[layer_of(target)][0]}), a layer above it")
    return out


def test_the_package_has_no_import_cycle_and_imports_run_downwards():
    assert problems(PACKAGE) == []


def test_a_planted_cycle_and_an_upward_import_are_caught(tmp_path):
    copy = tmp_path / "verispec"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "weights"))
    with open(copy / "verify.py", "a") as fh:  # a pure helper that reaches up into the loop, which imports it
        fh.write("\n\ndef _planted():\n    from .engine import SpeculativeDecoder\n")
    found = problems(copy)
    assert any("verispec.verify" in p and "verispec.engine" in p and "->" in p for p in found), found
    assert any(p.startswith("verispec.verify (pure helpers) imports verispec.engine") for p in found), found


@pytest.mark.parametrize("module", ["verispec.engine", "verispec.verify", "verispec.sampling", "verispec.audit",
                                    "verispec.controller", "verispec.batching", "verispec.drafters.base",
                                    "verispec.drafters.ngram", "verispec.drafters.model", "verispec.drafters.eagle",
                                    "verispec.drafters.medusa", "verispec.drafters.registry"])
def test_the_loop_and_drafters_reach_the_target_through_the_protocol_only(module):
    """The engine, verification, sampling, the audit and the drafters may import the backends' protocol
    (``verispec.backends.base``) and the store of measured costs (``verispec.backends.measurements``), never a
    backend."""
    graph = import_graph(PACKAGE)
    allowed = {"verispec.backends.base", "verispec.backends.measurements"}
    backends = {m for m in graph[module] if m.startswith("verispec.backends") and m not in allowed}
    assert not backends, f"{module} imports backend module(s) {backends}"


# the backends' shared parts: the protocol, the registry, model references, stored measurements and timing, the
# choice of --backend auto, what bench's peers take, and PyTorch's CPU kernels; every other module under
# verispec.backends belongs to one backend
SHARED_BACKEND_MODULES = {"verispec.backends", "verispec.backends.base", "verispec.backends.registry",
                          "verispec.backends.references", "verispec.backends.measurements",
                          "verispec.backends.cache", "verispec.backends.steps",
                          "verispec.backends.timing", "verispec.backends.choice", "verispec.backends.probe",
                          "verispec.backends.peers", "verispec.backends.torch_cpu"}


def concrete_backend_imports(root: Path) -> list[str]:
    graph = import_graph(root)
    found = []
    for module, targets in sorted(graph.items()):
        if module.startswith(f"{root.name}.backends"):
            continue
        for target in sorted(targets):
            shared = target in SHARED_BACKEND_MODULES or target.startswith("verispec.backends.torch_cpu.")
            if target.startswith(f"{root.name}.backends.") and not shared:
                found.append(f"{module} imports {target}")
    return found


def test_nothing_outside_the_backends_imports_a_backend_module():
    """A backend is reached through ``load_model`` and its registered spec (``verispec.backends.registry``), never by
    importing its module: adding one touches no file above ``verispec.backends``."""
    assert concrete_backend_imports(PACKAGE) == []


def test_a_planted_backend_import_is_caught(tmp_path):
    copy = tmp_path / "verispec"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "weights"))
    with open(copy / "drafters" / "ngram.py", "a") as fh:
        fh.write("\n\ndef _planted():\n    from ..backends.llamacpp import default_threads\n")
    assert concrete_backend_imports(copy) == ["verispec.drafters.ngram imports verispec.backends.llamacpp"]
