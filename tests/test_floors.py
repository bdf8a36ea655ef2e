"""The floors of docs/architecture.md, as the code's imports have them: each package
imports only its own modules and the packages on lower floors, and inference/ reaches
into training/ through training/workdir.py alone."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOORS = {
    "runtime": 1,
    "model": 1,
    "data": 2,
    "search": 3,
    "configs": 4,
    "backends": 4,
    "training": 5,
    "inference": 6,
    "aot": 6,
}
# The one door of a floor that a package above it may use, where only one is allowed.
DOORS = {("inference", "training"): {"attention_jax.training.workdir"}}
LIBRARY = "attention_jax"  # model/ is its root, every other floor its subpackage


def floor_package(module: str) -> str | None:
    """The folder an imported module lives in: 'attention_jax.data.plans' -> 'data',
    'attention_jax.transformer' -> 'model'; None for a module not of the library."""
    parts = module.split(".")
    if parts[0] != LIBRARY:
        return None
    return parts[1] if len(parts) > 1 and parts[1] in FLOORS else "model"


def imports(path: str) -> list[tuple[int, str]]:
    """(line, dotted module) of every absolute import in a file, in functions too."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def wrong_imports(package: str, root: str = ROOT) -> list[str]:
    found = []
    for base, _, files in os.walk(os.path.join(root, package)):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(base, name)
            for line, module in imports(path):
                other = floor_package(module)
                if other is None or other == package:
                    continue
                door = DOORS.get((package, other))
                if FLOORS[other] >= FLOORS[package] or (door and module not in door):
                    found.append(f"{os.path.relpath(path, root)}:{line} imports {module}")
    return found


def test_the_check_finds_an_import_up_or_past_the_door(tmp_path):
    (tmp_path / "search").mkdir()
    (tmp_path / "search" / "a.py").write_text(
        "def f():\n    from attention_jax.training import loop\n"
    )
    (tmp_path / "inference").mkdir()
    (tmp_path / "inference" / "b.py").write_text(
        "import attention_jax.search.stages\n"
        "from attention_jax.training.workdir import load_workdir\n"
        "from attention_jax.training.steps import TrainState\nfrom . import c\n"
    )
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "c.py").write_text("from attention_jax.data import plans\n")
    assert wrong_imports("search", str(tmp_path)) == [
        "search/a.py:2 imports attention_jax.training"
    ]
    assert wrong_imports("inference", str(tmp_path)) == [
        "inference/b.py:3 imports attention_jax.training.steps"
    ]
    assert wrong_imports("model", str(tmp_path)) == ["model/c.py:1 imports attention_jax.data"]


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_a_package_imports_only_lower_floors(package):
    assert os.path.isdir(os.path.join(ROOT, package))
    assert not wrong_imports(package), wrong_imports(package)
