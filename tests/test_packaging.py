"""What `pip install` gives other projects: the model library alone, on jax, flax, numpy."""

import ast
import os
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_only_the_model_library_is_installed_and_it_needs_only_jax_flax_numpy():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    # data/, training/ and configs/ would collide with other projects' modules of those names.
    assert project["tool"]["setuptools"]["packages"] == ["model"]
    names = sorted(d.split(">")[0].split("=")[0] for d in project["project"]["dependencies"])
    assert names == ["flax", "jax", "numpy"]


def test_model_imports_nothing_of_the_application():
    allowed = {"jax", "flax", "numpy", "model", "__future__", "dataclasses", "functools"}
    allowed |= {"typing", "collections", "math", "logging", "argparse", "matplotlib", "importlib"}
    for name in sorted(os.listdir(os.path.join(ROOT, "model"))):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(ROOT, "model", name)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = [node.module.split(".")[0]]
            else:
                continue
            for root in roots:
                assert root in allowed, f"model/{name} imports {root}"


def test_data_and_the_special_ids_import_without_jax():
    """The tokenized cache's worker processes import data/ (and through it the special
    ids of model/tokens.py) without JAX: it would cost each of them ~2 s and ~200 MB. The
    config files too (model/config.py's fields): train.py's flag errors come before JAX."""
    import subprocess
    import sys

    code = (
        "import sys, data, data.cache, model, configs.default; assert model.EOS_ID == 1; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'grain')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
