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
    allowed |= {"typing", "collections", "math", "logging", "argparse", "matplotlib"}
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
