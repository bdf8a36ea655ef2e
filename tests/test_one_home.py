"""Every search setting is declared once, in its home; everything else derives or imports it.

The homes: search/settings.py (`SearchSettings`: every search setting's name, type,
default and help, from which decode.py's flags, the options, the config's `search`
block and the compiled search's `Rule` are derived; the + 50 output tokens; a search's
batch tokens, decode.py's and CTranslate2's) and configs/default.py (training's
max_length and batch_tokens). No other class, flag, config entry or parameter declares
a search setting again (`test_no_search_setting_is_declared_twice`). The
library's code (not tests/, bench/ or tools/, which pick their own settings on purpose)
may not give any of these fields a number of its own: not as a keyword argument, a
parameter's or dataclass field's default, an assignment or a flag's default. Docstrings
and comments may quote the values; the check reads Python's tokens, not the text. The
other config files (configs/tiny.py, ...) are recipes: they may set these fields only to
another value than configs/default.py's.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import io
import os
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOMES = {"search/settings.py", "configs/default.py"}
NOT_LIBRARY = ("tests/", "bench/", "tools/", ".venv", ".cache", "workdir", ".data", "build/")
RECIPES = "configs/"  # overrides of configs/default.py: checked by what they change
# The fields whose value has a home.
FIELDS = {"beam_size", "alpha", "batch_tokens", "max_length", "max_decode_len", "extra"}
FIELDS |= {"eval_beam_size", "eval_alpha", "length_penalty", "stop", "min_length"}
# Numbers that are only ever one of those defaults (the paper's alpha, a GPU's batch).
VALUES = {"0.6", "32768", "32_768"}


def library_files() -> list[str]:
    out = []
    for base, dirs, files in os.walk(ROOT):
        rel = os.path.relpath(base, ROOT)
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        if rel != "." and rel.replace(os.sep, "/").startswith(NOT_LIBRARY):
            dirs[:] = []
            continue
        for name in files:
            path = os.path.normpath(os.path.join(rel, name)).replace(os.sep, "/")
            if name.endswith(".py") and path not in HOMES and not path.startswith(NOT_LIBRARY):
                if path.startswith(RECIPES) and name != "__init__.py":
                    continue
                out.append(path)
    return sorted(out)


def _code_tokens(source: str) -> list[tokenize.TokenInfo]:
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    return [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in skip]


def literals(source: str) -> list[tuple[int, str]]:
    """(line, what) for every default given a literal of its own in `source`'s code."""
    tokens = _code_tokens(source)
    found = []
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.NUMBER and tok.string in VALUES:
            found.append((tok.start[0], tok.string))
        named = tok.type == tokenize.NAME and tok.string in FIELDS
        flag = tok.type == tokenize.STRING and tok.string.strip("\"'") in FIELDS
        if not (named or flag):
            continue
        # `name = N`, `name: T = N`, `name=N` (a keyword), or a flag's `"name", N`.
        window = tokens[i + 1 : i + 8]
        for j, nxt in enumerate(window):
            if nxt.string in (")", "]", "}", ";") or (nxt.string == "," and not flag):
                break
            if nxt.string == "=" or (flag and nxt.string == "," and j == 0):
                rest = window[j + 1 :]
                if rest and rest[0].string == "-":
                    rest = rest[1:]
                if rest and rest[0].type == tokenize.NUMBER:
                    found.append((tok.start[0], f"{tok.string} {nxt.string} {rest[0].string}"))
                break
    return found


def test_the_check_finds_each_way_of_giving_a_default_a_number():
    code = """
def f(x, beam_size: int = 4, *, alpha=0.5): ...
f(1, batch_tokens=4096)
c.max_length = 256
flags.DEFINE_integer("beam_size", 3, "K")
y = 0.6
"""
    assert [line for line, _ in literals(code)] == [2, 2, 3, 4, 5, 6]
    clean = '''
"""beam_size=4, alpha=0.6 in a docstring"""
def f(beam_size: int = DEFAULT_BEAM_SIZE, n_best: int = 1): ...  # alpha = 0.6
f(beam_size=settings.beam_size, width=4096)
flags.DEFINE_integer("beam_size", DEFAULT_BEAM_SIZE, "K")
'''
    assert literals(clean) == []


@pytest.mark.parametrize("path", library_files())
def test_no_default_is_declared_outside_its_home(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        found = literals(f.read())
    assert not found, f"{path}: a default typed again, import it from its home: {found}"


def setting_names() -> set[str]:
    from attention_jax.search.settings import SearchSettings

    return {f.name for f in SearchSettings.fields()}


def declarations(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each declaration of a search setting in `source`: a class
    attribute of its name (a dataclass or NamedTuple field), a flag defined by its name,
    a `c.search.NAME = ...` config entry, or a parameter of its name whose default is
    neither None nor `DEFAULTS.NAME` (search/settings.py's)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                target = item.target if isinstance(item, ast.AnnAssign) else None
                if isinstance(target, ast.Name) and target.id in names:
                    found.append((item.lineno, f"field {node.name}.{target.id}"))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "").startswith("DEFINE"):
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and first.value in names:
                found.append((node.lineno, f"flag --{first.value}"))
        elif isinstance(node, ast.Assign):
            target = node.targets[0]
            if (
                isinstance(target, ast.Attribute)
                and target.attr in names
                and isinstance(target.value, ast.Attribute)
                and target.value.attr == "search"
            ):
                found.append((node.lineno, f"config search.{target.attr}"))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            args = node.args
            positional = args.posonlyargs + args.args
            defaulted = positional[len(positional) - len(args.defaults) :]
            pairs = list(zip(defaulted, args.defaults, strict=True))
            keywords = zip(args.kwonlyargs, args.kw_defaults, strict=True)
            pairs += [(a, d) for a, d in keywords if d is not None]
            for arg, default in pairs:
                if arg.arg not in names:
                    continue
                none = isinstance(default, ast.Constant) and default.value is None
                home = (
                    isinstance(default, ast.Attribute)
                    and default.attr == arg.arg
                    and getattr(default.value, "id", "") == "DEFAULTS"
                )
                if not (none or home):
                    found.append((default.lineno, f"parameter {arg.arg}={ast.unparse(default)}"))
    return found


def test_the_declaration_check_finds_each_kind():
    code = """
@dataclasses.dataclass
class Options:
    beam_size: int | None = None
def f(x, alpha=0.5, *, stop=DEFAULTS.stop, n_best=None, min_length=DEFAULTS.alpha): ...
flags.DEFINE_integer("n_best", 1, "K")
c.search.stop = "bound"
"""
    names = {"beam_size", "alpha", "stop", "n_best", "min_length"}
    assert sorted(line for line, _ in declarations(code, names)) == [4, 5, 5, 6, 7]


# The floors below search/ (docs/architecture.md), which cannot see SearchSettings: the
# batch planner's own parameters (data/plans.py MIN_ROWS) are the home SearchSettings reads.
BELOW_SEARCH = ("runtime/", "model/", "data/")


@pytest.mark.parametrize(
    "path", [p for p in [*library_files(), "configs/default.py"] if not p.startswith(BELOW_SEARCH)]
)
def test_no_search_setting_is_declared_twice(path):
    """SearchSettings is the one declaration: decode.py's flags, DecodeOptions, the config's
    `search` block and the compiled search's Rule derive theirs from it."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        found = declarations(f.read(), setting_names())
    assert not found, (
        f"{path} declares a search setting again (derive it from SearchSettings): {found}"
    )


def test_the_derived_declarations_are_search_settings():
    from attention_jax.configs import default
    from attention_jax.search.settings import PROGRAM_FIELDS, Rule, SearchSettings

    config = default.get_config().search.to_dict()
    assert config == {f.name: f.default for f in SearchSettings.fields(config=True)}
    rule = {f.name: f.default for f in dataclasses.fields(Rule)}
    assert rule == {
        **{n: getattr(SearchSettings(), n) for n in PROGRAM_FIELDS},
        "vocab_limit": None,
    }


def recipe_assignments(source: str) -> list[tuple[int, str, object]]:
    """(line, dotted field, value) of each `c.FIELD = LITERAL` in a config file."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, parts = node.targets[0], []
            while isinstance(target, ast.Attribute):
                parts.insert(0, target.attr)
                target = target.value
            if isinstance(target, ast.Name) and target.id == "c" and parts:
                try:
                    value = ast.literal_eval(node.value)
                except ValueError:
                    continue  # a placeholder, a call
                out.append((node.lineno, ".".join(parts), value))
    return out


RECIPE_FILES = sorted(
    f"configs/{n}"
    for n in os.listdir(os.path.join(ROOT, "configs"))
    if n.endswith(".py") and f"configs/{n}" not in HOMES and n != "__init__.py"
)


@pytest.mark.parametrize("path", RECIPE_FILES)
def test_a_recipe_changes_every_field_it_sets(path):
    """A config file sets a search or batch field only to change it: the default restated
    is a second home (other fields, such as base.py's paper settings, may pin a value)."""
    reference = importlib.import_module("attention_jax.configs.default").get_config()
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        assignments = recipe_assignments(f.read())
    assert assignments  # the parse found the recipe's fields
    same = []
    for line, field, value in assignments:
        node = reference
        for part in field.split("."):
            node = node[part]
        if field.split(".")[-1] in FIELDS and node == value and type(node) is type(value):
            same.append(f"line {line}: c.{field} = {value!r}")
    assert not same, f"{path} restates configs/default.py: {same}"
