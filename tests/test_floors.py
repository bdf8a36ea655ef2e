"""The floors of docs/architecture.md, as the code's imports have them: each package
imports only its own modules and the packages on lower floors, inference/ reaches
into training/ through training/workdir.py alone, and every package above data/ reaches
it through its face (data/__init__.py), never one of its modules."""

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
LIBRARY = "attention_jax"  # model/ is its root, every other floor its subpackage
# The one door of a floor that a package above it may use, where only one is allowed.
DOORS = {("inference", "training"): {f"{LIBRARY}.training.workdir"}} | {
    (package, "data"): {f"{LIBRARY}.data"} for package, floor in FLOORS.items() if floor > 2
}


def floor_package(module: str) -> str | None:
    """The folder an imported module lives in: 'attention_jax.data.plans' -> 'data',
    'attention_jax.transformer' -> 'model'; None for a module not of the library."""
    parts = module.split(".")
    if parts[0] != LIBRARY:
        return None
    return parts[1] if len(parts) > 1 and parts[1] in FLOORS else "model"


def _named_modules(module: str, names: list[str], root: str) -> list[str]:
    """The modules among `names` of `from module import names`: 'attention_jax' +
    ['data'] -> ['attention_jax.data'], 'attention_jax.data' + ['plans', 'Tokenizer'] ->
    ['attention_jax.data.plans'] (where data/plans.py exists)."""
    parts = module.split(".")
    if parts[0] != LIBRARY:
        return []
    if len(parts) == 1:  # the root is model/; the other floors are its subpackages
        return [f"{LIBRARY}.{n}" for n in names if n in FLOORS and n != "model"]
    folder = os.path.join(root, *parts[1:])
    return [
        f"{module}.{n}"
        for n in names
        if os.path.isfile(os.path.join(folder, f"{n}.py"))
        or os.path.isfile(os.path.join(folder, n, "__init__.py"))
    ]


def imports(path: str, root: str = ROOT) -> list[tuple[int, str]]:
    """(line, dotted module) of every absolute import in a file, in functions too; a
    module imported by `from PACKAGE import MODULE` counts as PACKAGE.MODULE."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [a.name for a in node.names]
            modules = _named_modules(node.module, names, root)
            if len(modules) < len(names):  # names defined by the module itself
                modules.append(node.module)
            out += [(node.lineno, m) for m in modules]
    return sorted(out)


def wrong_imports(package: str, root: str = ROOT) -> list[str]:
    found = []
    for base, _, files in os.walk(os.path.join(root, package)):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(base, name)
            for line, module in imports(path, root):
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
        "from attention_jax import data, training\n"
    )
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "__init__.py").write_text("")
    (tmp_path / "data" / "plans.py").write_text("")
    (tmp_path / "inference").mkdir()
    (tmp_path / "inference" / "b.py").write_text(
        "import attention_jax.search.stages\n"
        "from attention_jax.training.workdir import load_workdir\n"
        "from attention_jax.training.steps import TrainState\nfrom . import c\n"
        "from attention_jax.data import Tokenizer, load_split\n"
        "from attention_jax.data import plans, Tokenizer\n"
        "from attention_jax.data.files import atomic_write\n"
    )
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "c.py").write_text("from attention_jax.data import plans\n")
    assert wrong_imports("search", str(tmp_path)) == [
        "search/a.py:2 imports attention_jax.training",
        "search/a.py:3 imports attention_jax.training",
    ]
    assert wrong_imports("inference", str(tmp_path)) == [
        "inference/b.py:3 imports attention_jax.training.steps",
        "inference/b.py:6 imports attention_jax.data.plans",
        "inference/b.py:7 imports attention_jax.data.files",
    ]
    assert wrong_imports("model", str(tmp_path)) == [
        "model/c.py:1 imports attention_jax.data.plans"
    ]


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_a_package_imports_only_lower_floors(package):
    assert os.path.isdir(os.path.join(ROOT, package))
    assert not wrong_imports(package), wrong_imports(package)


def test_the_data_face_hands_on_every_name_it_lists():
    import attention_jax.data as data

    for name in data.__all__:
        getattr(data, name)  # an AttributeError names what the face lists wrongly
    with open(os.path.join(ROOT, "data", "__init__.pyi"), encoding="utf-8") as f:
        stub = [line.split() for line in f if line.startswith("from ")]
    # the stub tells type checkers what the face hands on, from the same modules
    assert {s[-1]: s[1] for s in stub} == data._LAZY
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        data.no_such_name
