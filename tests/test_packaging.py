"""What `pip install` gives other projects: one package, attention_jax, that imports
nothing of the checkout by a generic name; its network needs only jax, flax and numpy."""

import ast
import os
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "attention_jax"
# The checkout's folders that are not installed: they import the library, never the reverse.
BESIDE = {"tests", "bench", "tools"}


def _project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _folders() -> list[str]:
    """The checkout's Python packages (folders with an __init__.py)."""
    return sorted(
        d for d in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, d, "__init__.py"))
    )


def _imports(path: str) -> list[str]:
    """Every absolute import of a file (in functions too), as dotted names."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
    return out


def _python_files(folder: str) -> list[str]:
    out = []
    for base, dirs, files in os.walk(os.path.join(ROOT, folder)):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        out += [os.path.join(base, n) for n in sorted(files) if n.endswith(".py")]
    return out


def test_every_folder_of_the_library_is_installed_under_one_name():
    setuptools = _project()["tool"]["setuptools"]
    mapping = setuptools["package-dir"]
    assert mapping[NAME] == "model"
    library = [d for d in _folders() if d not in BESIDE]
    assert sorted(mapping.values()) == library
    for package, folder in mapping.items():
        assert package == NAME or package == f"{NAME}.{folder}"
    data = {"attention_jax.aot.gpu_targets"}  # files of a package's folder, no code
    assert sorted(setuptools["packages"]) == sorted([*mapping, *data])


def test_the_base_install_needs_only_jax_flax_numpy():
    names = sorted(d.split(">")[0].split("=")[0] for d in _project()["project"]["dependencies"])
    assert names == ["flax", "jax", "numpy"]


def test_no_code_imports_a_folder_of_the_checkout_by_its_bare_name():
    """A project with its own model.py, data.py or search.py must be able to use the
    library: the library, the CLIs, tests, bench and tools import it as attention_jax."""
    generic = set(_folders()) - BESIDE
    files = [p for folder in _folders() for p in _python_files(folder)]
    files += [os.path.join(ROOT, n) for n in ("train.py", "decode.py")]
    found = []
    for path in files:
        for module in _imports(path):
            if module.split(".")[0] in generic:
                found.append(f"{os.path.relpath(path, ROOT)} imports {module}")
    assert not found, found


def test_the_network_imports_nothing_of_the_application():
    """model/ (the package's root modules) needs jax, flax, numpy and itself alone."""
    allowed = {"jax", "flax", "numpy", "__future__", "dataclasses", "functools", "typing"}
    allowed |= {"collections", "math", "logging", "argparse", "matplotlib", "importlib"}
    subpackages = {p.split(".")[1] for p in _project()["tool"]["setuptools"]["packages"][1:]}
    for path in _python_files("model"):
        for module in _imports(path):
            parts = module.split(".")
            if parts[0] == NAME:
                ok = len(parts) == 1 or parts[1] not in subpackages
            else:
                ok = parts[0] in allowed
            assert ok, f"{os.path.relpath(path, ROOT)} imports {module}"


def test_data_and_the_special_ids_import_without_jax():
    """The tokenized cache's worker processes import data/ (and through it the special
    ids of model/tokens.py) without JAX: it would cost each of them ~2 s and ~200 MB. The
    config files too (model/config.py's fields): train.py's flag errors come before JAX."""
    code = (
        "import sys, attention_jax as aj, attention_jax.data, attention_jax.data.cache, "
        "attention_jax.configs.default; assert aj.EOS_ID == 1; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'grain')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
