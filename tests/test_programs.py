"""Search programs kept on disk (search/programs.py): a loaded executable must search
exactly as `jax.jit` does, every program a batch may run must be prepared ahead,
a bad file must be compiled again, a program XLA cannot
serialize (or that XLA's cache handed back) must go through `jax.jit` later, JAX's
own cache must stay on, and a directory that cannot be used must cost nothing but
the speed-up."""

import functools
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from attention_jax.search import programs
from attention_jax.search.settings import SearchSettings
from attention_jax.search.translate import translate_ids
from tests.models import make, sources_of
from tests.program_search import SOURCES, search

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model():
    return make(seed=3, vocab_size=40, max_len=96)


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """programs.enable(tmp_path) for one test, with nothing loaded yet, and an empty XLA
    cache of the test's own (the tests' shared one may hold these programs already)."""
    monkeypatch.setattr(programs, "_loaded", {})
    monkeypatch.setattr(programs, "_directory", None)
    before = jax.config.jax_compilation_cache_dir
    least = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # as decode.py's
    compilation_cache.reset_cache()
    jax.clear_caches()  # nor in memory: an earlier test may have compiled the same programs
    yield programs.enable(str(tmp_path / "programs"))
    programs.enable(None)
    jax.config.update("jax_compilation_cache_dir", before)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", least)
    compilation_cache.reset_cache()


def kept_files(directory):
    return sorted(f for f in os.listdir(directory) if f.endswith(programs.SUFFIX))


def test_kept_programs_search_as_jit_does(model, kept, monkeypatch):
    got = search(model)  # compiled here (XLA's cache is empty) and written
    files = kept_files(kept)
    assert files and len(files) == len(os.listdir(kept))
    programs.enable(None)
    assert search(model) == got  # plain jax.jit
    programs.enable(kept)

    # As a new process would: nothing in memory, every program read from disk.
    monkeypatch.setattr(programs, "_loaded", {})
    compiled = []
    real_compile = programs._compile
    monkeypatch.setattr(programs, "_compile", lambda *a: compiled.append(a[0]) or real_compile(*a))
    assert search(model) == got
    assert compiled == []
    assert kept_files(kept) == files


def _settle():
    """Wait for the programs `prepare` is still compiling."""
    for future in list(programs._pending.values()):
        future.result()


@pytest.mark.usefixtures("segmented")
def test_every_program_a_shrinking_batch_may_run_is_prepared(model, kept, monkeypatch):
    settings = SearchSettings(beam_size=2, batch_tokens=128)  # 16 rows at width 8: they shrink
    compiled = []
    real_compile = programs._compile
    monkeypatch.setattr(
        programs, "_compile", lambda fn, *a: compiled.append(fn.__name__) or real_compile(fn, *a)
    )
    lengths = np.random.default_rng(7).integers(2, 9, (2, 16))
    translate_ids(model, sources_of(lengths[0], seed=7), settings)
    _settle()
    # rooms 24, 48, 58: the start at 24, the growth to 58, a step loop at each of 16 and
    # 4 rows and the selection of 4 rows of 16, whether run or not
    want = ["_start", "_grow", "_advance", "_advance", "_select"]
    assert sorted(compiled) == sorted(want)
    assert len(kept_files(kept)) == len(want)

    # As a new process would, on other sources (whose segments may end elsewhere):
    # every program is loaded, none compiled; the steps at 16 rows after the growth (a
    # batch runs them only if its first room fills first) are loaded at their first
    # call, on the search's thread, not ahead on the compiling ones.
    monkeypatch.setattr(programs, "_loaded", {})
    monkeypatch.setattr(programs, "_pending", {})
    compiled.clear()
    loaded, ran = [], []
    real_obtain = programs._obtain

    def obtain(key, fn, graphdef, args, static):
        rows = args[1].live_seqs.shape[0] if fn.__name__ == "_advance" else None
        loaded.append((fn.__name__, rows, threading.current_thread().name))
        program = real_obtain(key, fn, graphdef, args, static)
        return lambda *a: ran.append((fn.__name__, rows)) or program(*a)

    monkeypatch.setattr(programs, "_obtain", obtain)
    translate_ids(model, sources_of(lengths[1], seed=8), settings)
    _settle()
    assert compiled == []
    rarely = [thread for name, rows, thread in loaded if (name, rows) == ("_advance", 16)]
    assert ("_advance", 16) in ran  # this batch's first room filled: the steps ran
    assert len(rarely) == 1 and not rarely[0].startswith("compile")
    assert len(loaded) == len(want)


def test_a_pooled_batch_runs_one_program_prepared_ahead_and_loaded_by_the_next_job(
    model, kept, monkeypatch
):
    settings = SearchSettings(beam_size=2, batch_tokens=128)  # 16 sources of width 8, 8 slots
    compiled, ran = [], []
    real_compile, real_obtain = programs._compile, programs._obtain
    monkeypatch.setattr(
        programs, "_compile", lambda fn, *a: compiled.append(fn.__name__) or real_compile(fn, *a)
    )

    def obtain(key, fn, *a):
        program = real_obtain(key, fn, *a)
        return lambda *args: ran.append(fn.__name__) or program(*args)

    monkeypatch.setattr(programs, "_obtain", obtain)
    lengths = np.random.default_rng(9).integers(2, 9, (2, 16))
    translate_ids(model, sources_of(lengths[0], seed=9), settings)
    _settle()
    assert compiled == ["_pool"] and ran == ["_pool"] and len(kept_files(kept)) == 1
    monkeypatch.setattr(programs, "_loaded", {})  # a new process, other sources
    monkeypatch.setattr(programs, "_pending", {})
    compiled.clear()
    translate_ids(model, sources_of(lengths[1], seed=10), settings)
    _settle()
    assert compiled == [] and ran == ["_pool", "_pool"]


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _twice(graphdef, x):
    return 2 * x


def test_a_program_prepared_not_to_load_is_kept_but_loaded_at_its_first_call(kept, monkeypatch):
    shape, x = jax.ShapeDtypeStruct((3,), jnp.float32), jnp.arange(3.0)
    loaded = []
    real_obtain = programs._obtain
    monkeypatch.setattr(
        programs, "_obtain", lambda key, *a: loaded.append(key) or real_obtain(key, *a)
    )
    programs.prepare(_twice, None, (shape,), {}, load=False)  # not kept yet: compiled now
    _settle()
    assert len(loaded) == 1 and len(kept_files(kept)) == 1

    monkeypatch.setattr(programs, "_loaded", {})  # a new process: kept, so left on disk
    monkeypatch.setattr(programs, "_pending", {})
    programs.prepare(_twice, None, (shape,), {}, load=False)
    _settle()
    assert len(loaded) == 1 and programs._pending == {}
    np.testing.assert_array_equal(programs.call(_twice, None, (x,), {}), 2 * np.arange(3.0))
    assert len(loaded) == 2 and loaded[1] == loaded[0]  # loaded by the call
    programs.prepare(_twice, None, (shape,), {}, load=False)  # loaded: nothing to do
    programs.prepare(_twice, None, (shape,), {})
    assert len(loaded) == 2 and programs._pending == {}


def test_the_code_digest_ignores_comments_and_docstrings(tmp_path):
    source = tmp_path / "a.py"
    source.write_text('"""Doc."""\nimport os\n\n\ndef f(x):\n    """Say."""\n    return x + 1\n')
    before = programs.code_digest([str(tmp_path)])
    source.write_text(
        '"""Other words,\non two lines."""\nimport os\n\n\ndef f(x):\n    # why\n'
        "    return x + 1  # and how\n"
    )
    assert programs.code_digest([str(tmp_path)]) == before
    source.write_text('"""Doc."""\nimport os\n\n\ndef f(x):\n    """Say."""\n    return x + 2\n')
    assert programs.code_digest([str(tmp_path)]) != before


def test_a_program_from_xlas_cache_is_compiled_again_and_kept(model, kept, monkeypatch, tmp_path):
    want = search(model)
    # As in a new process whose XLA cache holds the programs but whose store does not
    # (deleted, or keys of another model/): XLA's cache serves the first compile of each
    # (in this process its in-memory caches would; test_a_new_process_... has the real
    # thing), and a program it served is compiled again under another cache key.
    real_compile = jax.stages.Lowered.compile
    options = []

    def from_cache(self, *args, **kwargs):
        options.append(kwargs.get("compiler_options"))
        if not kwargs.get("compiler_options"):
            jax.monitoring.record_event("/jax/compilation_cache/cache_hits")
        return real_compile(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", from_cache)
    other = str(tmp_path / "other")
    monkeypatch.setattr(programs, "_loaded", {})
    jax.clear_caches()
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla-2"))
    compilation_cache.reset_cache()
    programs.enable(other)
    assert search(model) == want
    assert kept_files(other) == kept_files(kept)  # every program kept, none lost
    again = [o for o in options if o]  # (programs compile side by side: in any order)
    assert len(again) == len(options) - len(again) == len(kept_files(kept))
    keys = [next(iter(o.values())) for o in again]
    assert len(set(keys)) == len(keys)  # a key XLA's cache has never seen, each time
    # An XLA that does not know the option: the program is used as it came, not kept.
    monkeypatch.setattr(programs, "_new_cache_key", lambda: {"xla_no_such_option": 1})
    monkeypatch.setattr(programs, "_loaded", {})
    third = str(tmp_path / "third")
    programs.enable(third)
    jax.clear_caches()
    assert search(model) == want
    assert kept_files(third) == []


def test_jaxs_cache_stays_on_while_programs_compile(model, kept, monkeypatch):
    updates = []
    real_update = jax.config.update
    monkeypatch.setattr(
        jax.config, "update", lambda name, value: updates.append(name) or real_update(name, value)
    )
    search(model)  # programs prepared in the background, then run
    assert "jax_enable_compilation_cache" not in updates
    assert jax.config.jax_enable_compilation_cache


@pytest.mark.slow  # ~60 s
def test_a_new_process_loads_the_programs_and_gets_the_same_results(tmp_path):
    # Processes with XLA's cache on (as decode.py runs): a program compiled afresh is
    # kept and loads in the next process; one XLA's cache hands back is compiled again
    # under another cache key (kept as it came, it would fail in the next process:
    # "Function ... not found"), kept, and loads in the next process too.
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {ROOT!r})
        import jax
        from attention_jax.runtime import xla
        xla.enable_compilation_cache(sys.argv[2])
        jax.jit(lambda x: x * 2 + 1)(1.0)  # as decode.py compiles before its searches
        from attention_jax.search import programs
        from tests.program_search import search
        from tests.models import make
        model = make(seed=3, vocab_size=40, max_len=96)
        programs.enable(sys.argv[1])
        compiled = []  # programs compiled to be kept: fresh or not
        real = programs._compile
        def count(*a):
            out = real(*a)
            compiled.append(out[1])
            return out
        programs._compile = count
        out = search(model)
        print(json.dumps({{"compiled": len(compiled), "fresh": sum(compiled), "out": out}}))
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    store, xla_cache = tmp_path / "programs", tmp_path / "xla"

    def run():
        out = subprocess.run(
            [sys.executable, "-c", script, str(store), str(xla_cache)],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        return json.loads(out.stdout.splitlines()[-1])

    first = run()
    assert first["compiled"] > 0 and first["fresh"] == first["compiled"]
    files = kept_files(store)
    second = run()
    assert second["compiled"] == 0 and second["out"] == first["out"]  # every one loaded
    shutil.rmtree(store)  # XLA's cache holds them: handed back, compiled again, kept
    third = run()
    assert third["compiled"] == first["compiled"] and third["fresh"] == first["compiled"]
    assert third["out"] == first["out"] and kept_files(store) == files
    fourth = run()  # and loaded whole by the next process
    assert fourth["compiled"] == 0 and fourth["out"] == first["out"]
    shutil.rmtree(xla_cache)  # without XLA's cache: still loaded whole
    assert run()["out"] == first["out"] and kept_files(store) == files


def test_a_bad_file_is_compiled_again_and_replaced(model, kept, monkeypatch):
    want = search(model)
    for name in os.listdir(kept):
        with open(os.path.join(kept, name), "wb") as f:
            f.write(b"not a program")  # e.g. torn by a full disk, or from another jaxlib
    names = os.listdir(kept)
    monkeypatch.setattr(programs, "_loaded", {})
    assert search(model) == want  # compiled again (JAX's memory has it: under a new key)
    assert sorted(os.listdir(kept)) == sorted(names)
    for name in names:  # each bad file replaced by a loadable program
        assert programs._load(os.path.join(kept, name)) is not None


def test_a_program_xla_cannot_serialize_goes_through_jit_later(model, kept, monkeypatch):
    from jax.experimental import serialize_executable

    programs.enable(None)
    want = search(model)
    programs.enable(kept)
    # Nothing in memory or in XLA's cache, so that the programs are compiled afresh.
    jax.clear_caches()
    jax.config.update("jax_compilation_cache_dir", kept + "-xla-2")
    compilation_cache.reset_cache()

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


@pytest.mark.slow  # ~10 s; the keys' parts are in every other test here
def test_programs_differ_by_shape_and_settings(model, kept):
    search(model)
    n = len(os.listdir(kept))
    translate_ids(model, SOURCES[:2], SearchSettings(beam_size=2, n_best=1, batch_tokens=64))
    assert len(os.listdir(kept)) > n  # another beam size: other programs, other files


def test_a_key_names_the_model_by_its_structure_however_often_asked(model, monkeypatch):
    """A key is digested once per (program, shapes) and graphdef object, then looked up:
    the lookup must give what a fresh digest gives, the same for an equal model, another
    for another, whichever asked last."""
    from flax import nnx

    from attention_jax.search import segments

    monkeypatch.setattr(programs, "_keys", type(programs._keys)())
    digests = []
    text = programs._model_text
    monkeypatch.setattr(programs, "_model_text", lambda g: digests.append(g) or text(g))
    leaves, treedef = jax.tree.flatten((np.zeros((2, 3), np.int32),))
    key = lambda g: programs._key(segments._advance, g, leaves, treedef, {})
    mine = nnx.split(model)[0]
    first = key(mine)
    assert [key(mine) for _ in range(3)] == [first] * 3 and len(digests) == 1  # looked up
    assert key(nnx.split(make(seed=4, vocab_size=40, max_len=96))[0]) == first  # equal
    other = nnx.split(make(seed=3, vocab_size=41, max_len=96))[0]
    assert key(other) != first and key(other) == key(other)
    assert key(mine) == first  # after another graphdef took the entry
    assert len(digests) == 4


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
