"""docs/results.md, its pages per machine and the README's results table are generated
from bench/results/ (tools/results_page.py) and kept current."""

import json
import os
import re
import subprocess

from tools import results_page


def _pages() -> dict[str, str]:
    """The results pages as written: docs/results.md and docs/results/*.md, by path under
    docs/."""
    pages = {"results.md": results_page.PAGE}
    folder = os.path.join(results_page.DOCS, "results")
    pages |= {f"results/{n}": os.path.join(folder, n) for n in os.listdir(folder)}
    out = {}
    for name, path in pages.items():
        with open(path, encoding="utf-8") as f:
            out[name] = f.read()
    return out


def test_the_results_pages_and_the_readme_table_are_up_to_date():
    assert _pages() == results_page.render(), "run: python tools/results_page.py"
    with open(results_page.README, encoding="utf-8") as f:
        readme = f.read()
    assert readme == results_page.with_table(readme, results_page.headline_table()), (
        "run: python tools/results_page.py"
    )


def test_every_results_file_is_named_machine_date_commit_and_shown(tmp_path):
    for name in os.listdir(results_page.RESULTS):
        assert results_page.NAME.match(name.split(".")[0]), name
    rows = [
        {"benchmark": "decode", "command": "x", "results": [{"tokens_per_s": 12345.6}]},
        {"benchmark": "make train", "command": "make train", "wall_s": 222},
    ]
    (tmp_path / "cpu-zen5-20261127-abcdef0-pace.jsonl").write_text(
        "\n".join(json.dumps(r) for r in rows) + "\n"
    )
    pages = results_page.render(str(tmp_path))
    assert (
        "- [cpu-zen5](results/cpu-zen5.md): 1 file, 2026-11-27 to 2026-11-27" in pages["results.md"]
    )
    page = pages["results/cpu-zen5.md"]
    assert page.startswith("# Results on cpu-zen5") and "- 2026-11-27, abcdef0, pace:" in page
    assert "](../../bench/results/cpu-zen5-20261127-abcdef0-pace.jsonl)" in page
    assert "**decode** `x`: tokens_per_s 12,346" in page
    assert "**make train** `make train`: wall_s 222" in page


def test_every_headline_is_a_value_of_its_file():
    table = results_page.headline_table()
    assert len(table.splitlines()) == 2 + len(results_page.HEADLINES)
    for what, stem, _, _, _ in results_page.HEADLINES:
        assert what in table and f"bench/results/{stem}.jsonl" in table


def _repo_paths(text: str) -> set[str]:
    """The paths `text` names inside this repository: link targets, and words whose
    first folder is one of the repository's top-level folders (workdir/ and the like,
    which a command creates, are not)."""
    tops = {e.name for e in os.scandir(results_page.ROOT) if e.is_dir() and e.name[0] != "."}
    tops -= {"workdir"}
    links = re.findall(r"\]\(([^)#\s]+)\)", text)
    words = re.findall(r"(?<![\w./$-])([\w-]+/[\w./-]*[\w/])", text)
    paths = {p for p in links if "://" not in p}
    return paths | {w for w in words if w.split("/")[0] in tops}


def test_every_path_the_readme_names_exists():
    with open(results_page.README, encoding="utf-8") as f:
        named = _repo_paths(f.read())
    assert "bench/decode_file.py" in named and "docs/decoding.md" in named  # the reading works
    missing = sorted(p for p in named if not os.path.exists(os.path.join(results_page.ROOT, p)))
    assert not missing, f"README.md names paths that do not exist: {missing}"


def test_a_run_whose_script_is_gone_says_where_it_can_be_had(tmp_path):
    row = {"benchmark": "b", "command": "python bench/no_such_script.py --x && bench/train.py"}
    (tmp_path / "cpu-zen5-20261127-abcdef0-pace.jsonl").write_text(json.dumps(row) + "\n")
    (gone,) = re.findall(
        r"\(no longer in the repository: ([^)]*)\)",
        results_page.render(str(tmp_path))["results/cpu-zen5.md"],
    )
    assert gone == "bench/no_such_script.py"  # bench/train.py is here
    # On the real page every gone script names a commit that holds it.
    named = set(results_page.SCRIPT.findall("".join(_pages().values())))
    gone = {p for p in named if not os.path.exists(os.path.join(results_page.ROOT, p))}
    assert gone <= set(results_page.GONE), (
        f"add to results_page.GONE: {gone - set(results_page.GONE)}"
    )
    git = lambda *a: subprocess.run(["git", *a], cwd=results_page.ROOT, capture_output=True)
    history = git("rev-parse", "--is-shallow-repository").stdout.strip() == b"false"
    for script, commit in results_page.GONE.items():
        assert script in gone, f"{script} is back, or no result names it: drop it from GONE"
        if history:  # a whole clone (not an unpacked archive or a shallow clone)
            assert git("cat-file", "-e", f"{commit}:{script}").returncode == 0, (commit, script)
