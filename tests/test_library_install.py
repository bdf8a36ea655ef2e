"""The library as a user installs it: the wheel with its [translate] extra in a fresh
virtual environment, and every python block of docs/library.md run from a project
whose own model.py, search.py, data.py and training.py raise when imported (make
test-slow; pip's cache makes the installs quick, and PyPI is reached by name only)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A project of the user's own, beside which the library must work.
THEIR_MODULES = ("model", "search", "data", "training")

pytestmark = pytest.mark.slow


def doc_blocks() -> list[str]:
    with open(os.path.join(ROOT, "docs", "library.md"), encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def _run(args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=900, **kwargs)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> str:
    """A fresh venv holding the wheel of this checkout with [translate]; its python."""
    base = tmp_path_factory.mktemp("install")
    # Built from a copy: setuptools leaves build/ and *.egg-info beside the sources.
    source = base / "source"
    skip = (".*", "build", "*.egg-info", "workdir", "__pycache__", "bench", "tests")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*skip))
    wheels = base / "wheels"
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), source])
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = wheels.glob("attention_jax-*.whl")
    venv = base / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)]).returncode == 0
    python = str(venv / "bin" / "python")
    constraints = os.path.join(ROOT, "constraints.txt")
    r = _run([python, "-m", "pip", "install", "-q", "-c", constraints, f"{wheel}[translate]"])
    assert r.returncode == 0, r.stderr[-3000:]
    return python


@pytest.fixture(scope="module")
def their_project(tmp_path_factory):
    """A directory with the user's own modules of generic names, each raising."""
    project = tmp_path_factory.mktemp("their_project")
    for name in THEIR_MODULES:
        (project / f"{name}.py").write_text(f"raise ImportError('their own {name}.py')\n")
    return project


def test_the_wheel_holds_one_package_and_its_metadata(installed, their_project):
    code = (
        "import importlib.metadata as m, json; d = m.distribution('attention-jax'); "
        "files = {str(f).split('/')[0] for f in d.files}; meta = d.metadata; "
        "print(json.dumps([sorted(files), meta['Summary'], meta.get_all('Provides-Extra'), "
        "meta.get_all('Project-URL'), meta.get('License-Expression')]))"
    )
    r = _run([installed, "-c", code], cwd=their_project)  # not the checkout's egg-info
    assert r.returncode == 0, r.stderr
    files, summary, extras, urls, license_ = json.loads(r.stdout)
    assert [f for f in files if not f.endswith(".dist-info")] == ["attention_jax"]
    assert "Transformer" in summary and {"translate", "train"} <= set(extras)
    assert urls and license_ == "Apache-2.0"


@pytest.mark.parametrize("index", range(len(doc_blocks())))
def test_every_block_of_the_library_guide_runs_beside_a_project_of_generic_names(
    installed, their_project, index
):
    block = doc_blocks()[index]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    # The checkout is nowhere on the path: only the installed package can be imported.
    check = "import attention_jax, sys; assert 'site-packages' in attention_jax.__file__\n"
    r = _run([installed, "-c", check + block], cwd=their_project, env=env)
    assert r.returncode == 0, f"block {index}:\n{block}\n{r.stderr[-4000:]}"
    assert r.stdout.strip(), f"block {index} printed nothing"
    for name in THEIR_MODULES:
        assert f"their own {name}.py" not in r.stderr
