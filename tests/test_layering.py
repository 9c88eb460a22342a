"""Imports flow one way (DESIGN.md section 1): a package may import only packages of lower layers."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megafp8"

# Lower number = lower layer. Packages on the same layer must not import each other.
LAYERS = {"config": 0, "precision": 1, "parallel": 2, "optim": 3, "model": 3, "data": 3, "checkpoint": 4, "train": 5}
# Packages that must not know about process groups.
NO_DISTRIBUTED = {"config", "precision", "model", "data"}


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_every_package_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(LAYERS)


def test_imports_point_down_only():
    bad = []
    for package, layer in LAYERS.items():
        for path in (PACKAGE / package).rglob("*.py"):
            for name in imports_of(path):
                parts = name.split(".")
                if parts[0] == "megafp8" and len(parts) > 1 and parts[1] in LAYERS and parts[1] != package:
                    if LAYERS[parts[1]] >= layer:
                        bad.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
                if package in NO_DISTRIBUTED and name.startswith("torch.distributed"):
                    bad.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_checker_catches_a_backward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from megafp8.train import Trainer\nimport torch.distributed as dist\n")
    assert imports_of(bad) == {"megafp8.train", "torch.distributed"}


def _module_imports(package: Path = PACKAGE) -> dict[str, set[str]]:
    """The modules of `package` (megafp8) and the modules of it each imports anywhere in its file (function-level
    and type-checking imports included; relative imports resolved; `from package import name` counts as importing
    the submodule `name` when there is one)."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str):
        parts = name.split(".")
        while parts and ".".join(parts) not in modules:
            parts.pop()
        return ".".join(parts) or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - max(node.level - 1, 0)] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                edges.update(known(f"{module}.{alias.name}") or known(module) for alias in node.names)
        graph[name] = edges - {None, name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or v not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.append(frozenset(component))
    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_through_others():
    cycles = _cycles(_module_imports())
    assert not cycles, [sorted(c) for c in cycles]


def test_the_cycle_checker_finds_a_function_level_cycle(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [frozenset({"a", "b", "c"})]
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "loop.py").write_text("from pkg.saving import save\n")
    (package / "saving.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                       "    from pkg.loop import Loop\n")
    (package / "tools.py").write_text("def run():\n    from . import loop\n")
    imports = _module_imports(package)
    # a type-checking-only import and a function-level relative import each count
    assert imports["pkg.saving"] == {"pkg.loop"} and imports["pkg.tools"] == {"pkg.loop"}
    assert _cycles(imports) == [frozenset({"pkg.loop", "pkg.saving"})]


def test_the_tools_that_read_files_load_without_torch():
    """Preprocessing and the tools that compare and plot runs' metrics start in a fraction of a second: nothing they
    import pulls in torch (megafp8.data and megafp8.train import their torch-bound names on first use)."""
    import subprocess
    import sys

    modules = ["megafp8.data.preprocess", "megafp8.train.plots", "megafp8.data"]
    probe = f"import sys; import {', '.join(modules)}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], cwd=PACKAGE.parent, capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False", result.stdout + result.stderr


def test_the_lazily_imported_names_resolve():
    import megafp8.data
    import megafp8.train

    for package in (megafp8.data, megafp8.train):
        for name in package.__all__:
            assert callable(getattr(package, name)), f"{package.__name__}.{name}"
