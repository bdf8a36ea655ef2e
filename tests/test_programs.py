"""Search programs kept on disk (search/programs.py): a loaded executable must search
exactly as `jax.jit` does, a bad file must be compiled again, a program XLA cannot
serialize must go through `jax.jit` later, and a directory that cannot be used must
cost nothing but the speed-up."""

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from search import programs
from search.settings import SearchSettings
from search.translate import translate_ids
from tests.test_decoding import make
from tests.test_stages import sources_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model():
    return make(seed=3, vocab_size=40, max_len=96)


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """programs.enable(tmp_path) for one test, with nothing loaded yet."""
    monkeypatch.setattr(programs, "_loaded", {})
    monkeypatch.setattr(programs, "_directory", None)
    yield programs.enable(str(tmp_path / "programs"))
    programs.enable(None)


SOURCES = sources_of([3, 5, 9, 14, 2, 7, 11, 6], seed=4)  # widths 8 and 16


def search(model):
    hyps = translate_ids(model, SOURCES, SearchSettings(beam_size=3, n_best=2, batch_tokens=64))
    return [[(h.tokens, h.score) for h in hs] for hs in hyps]


def test_kept_programs_search_as_jit_does(model, kept, monkeypatch):
    programs.enable(None)
    # Plain jax.jit, compiled afresh: a program the tests' compilation cache handed back
    # would leave XLA:CPU unable to serialize the same program compiled again in this
    # process (decode.py never runs one program both ways: a single device's searches
    # all go through the kept programs, a mesh's all through jax.jit).
    with programs._jax_cache_off():
        want = search(model)
    programs.enable(kept)
    assert search(model) == want  # compiled here and written
    files = os.listdir(kept)
    assert files and all(f.endswith(programs.SUFFIX) for f in files)

    # As a new process would: nothing in memory, every program read from disk.
    monkeypatch.setattr(programs, "_loaded", {})
    compiled = []
    real_compile = programs._compile
    monkeypatch.setattr(programs, "_compile", lambda *a: compiled.append(a[0]) or real_compile(*a))
    assert search(model) == want
    assert compiled == []
    assert sorted(os.listdir(kept)) == sorted(files)


@pytest.mark.slow  # 50-80 s each; test_kept_programs_search_as_jit_does is in make test
@pytest.mark.parametrize("xla_cache", [False, True])
def test_a_new_process_loads_the_programs_and_gets_the_same_results(tmp_path, xla_cache):
    # With XLA's cache on (JAX decides once per process that it is used, at the first
    # compile) and holding the programs (kept before under another key, e.g. before an
    # edit of model/ that left them as they were), a program must still be compiled
    # afresh to be kept: one XLA's cache hands back, serialized again, fails in the
    # next process ("Function ... not found"; the code before this test did that).
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {ROOT!r})
        from search import programs
        from tests.test_programs import search
        from tests.test_decoding import make
        model = make(seed=3, vocab_size=40, max_len=96)
        if sys.argv[2] == "xla":
            import jax
            from common import xla
            xla.enable_compilation_cache(sys.argv[1] + "-xla")
            jax.jit(lambda x: x * 2 + 1)(1.0)  # as decode.py compiles before its searches
        programs.enable(sys.argv[1])
        compiled, hits = [], []  # programs compiled to be kept; XLA cache hits meanwhile
        import jax.monitoring
        jax.monitoring.register_event_listener(
            lambda name, **kw: hits.append(1) if name.endswith("/cache_hits") else None
        )
        real = programs._compile
        def count(*a):
            before = len(hits)
            out = real(*a)
            compiled.append(len(hits) - before)
            return out
        programs._compile = count
        out = search(model)
        print(json.dumps({{"compiled": len(compiled), "xla_hits": sum(compiled), "out": out}}))
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    how = "xla" if xla_cache else "-"
    run = lambda: subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "programs"), how],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout.splitlines()[-1]
    import json

    first = json.loads(run())
    assert first["compiled"] > 0
    if xla_cache:  # XLA's cache may hold the programs now: kept again, compiled afresh
        shutil.rmtree(tmp_path / "programs")
        again = json.loads(run())
        assert again["compiled"] == first["compiled"] and again["xla_hits"] == 0
        assert again["out"] == first["out"]
    second = json.loads(run())
    assert second["compiled"] == 0  # every program loaded from the files of the run before
    assert second["out"] == first["out"]


def test_a_bad_file_is_compiled_again_and_replaced(model, kept, monkeypatch):
    want = search(model)
    for name in os.listdir(kept):
        with open(os.path.join(kept, name), "wb") as f:
            f.write(b"not a program")  # e.g. torn by a full disk, or from another jaxlib
    monkeypatch.setattr(programs, "_loaded", {})
    assert search(model) == want
    monkeypatch.setattr(programs, "_loaded", {})
    for name in os.listdir(kept):  # replaced by loadable programs
        assert programs._load(os.path.join(kept, name)) is not None


def test_a_program_xla_cannot_serialize_goes_through_jit_later(model, kept, monkeypatch):
    from jax.experimental import serialize_executable

    programs.enable(None)
    want = search(model)
    programs.enable(kept)

    def refuse(compiled):  # what XLA:CPU says of some small sorts
        raise RuntimeError("UNIMPLEMENTED: `LessThan` is not serializable.")

    monkeypatch.setattr(serialize_executable, "serialize", refuse)
    assert search(model) == want
    files = os.listdir(kept)
    assert files and all(f.endswith(programs.UNKEPT) for f in files)
    # As a new process would: nothing compiled to be kept; jax.jit (and XLA's cache).
    monkeypatch.setattr(programs, "_loaded", {})
    monkeypatch.setattr(programs, "_compile", lambda *a: pytest.fail("compiled to be kept"))
    assert search(model) == want
    assert sorted(os.listdir(kept)) == sorted(files)


def test_programs_differ_by_shape_and_settings(model, kept):
    search(model)
    n = len(os.listdir(kept))
    translate_ids(model, SOURCES[:2], SearchSettings(beam_size=2, n_best=1, batch_tokens=64))
    assert len(os.listdir(kept)) > n  # another beam size: other programs, other files


def test_an_unusable_directory_only_loses_the_speed_up(model, tmp_path, monkeypatch):
    monkeypatch.setattr(programs, "_loaded", {})
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert programs.enable(str(blocker / "programs")) is None  # cannot be created
    want = search(model)
    programs.enable(str(tmp_path / "programs"))
    monkeypatch.setattr(programs, "_directory", str(blocker))  # writes fail (not a directory)
    try:
        assert search(model) == want  # compiled, not written
    finally:
        programs.enable(None)


def test_traced_calls_and_host_arrays_go_through_jit():
    import jax
    import jax.numpy as jnp

    seen = []
    jax.jit(lambda x: seen.append(programs._single_device([x])) or x)(jnp.zeros(3))
    assert seen == [False]  # traced (e.g. decode.py --export): jax.jit's own path
    assert programs._single_device([jnp.zeros(3)])
    assert not programs._single_device([np.zeros(3)])  # not placed on a device
