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
