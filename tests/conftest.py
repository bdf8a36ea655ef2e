"""Shared test setup: CPU only, no network; small corpora and configs for training tests;
the fixtures several test modules share (the trained digit workdir, the fault tests'
finished run)."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests compile hundreds of small programs and run most of them a few times, so
# LLVM's optimization passes cost more than they save: without them test_model.py and
# test_decoding.py take 57 s instead of 73 with nothing cached. Set in the environment,
# so that the xdist workers and the train.py / decode.py children compile the same way
# (and share the cache); a level already in $XLA_FLAGS wins, and a child keeps the
# flags its test gave it (a device count). Parity tests against another implementation
# do not depend on the level: where lines differ, the model's own scores must show a
# near-tie (tests/parity.py).
_FLAGS = os.environ.get("XLA_FLAGS", "")  # a child's: its parent's, and e.g. a device count
if "xla_backend_optimization_level" not in _FLAGS:
    _FLAGS = os.environ["XLA_FLAGS"] = f"{_FLAGS} --xla_backend_optimization_level=0".strip()
# Two flags of XLA:CPU's that only make a compile cheaper:
# - the older code generator (one LLVM function per fusion, not the fusion emitters)
#   compiles a small program in about half the time; the programs compute the same
#   functions, rounded otherwise in the last bit where they fuse otherwise;
# - LLVM's code generated in one piece, not split over threads: the xdist workers
#   already keep every core busy, so the split only adds its own work (docs/testing.md).
# A jaxlib whose XLA no longer knows a flag would abort on it, so one child tries them
# first (once: the workers and the children inherit $XLA_FLAGS with the answer in it).
_CHEAPER_COMPILES = {
    "xla_cpu_use_fusion_emitters": "--xla_cpu_use_fusion_emitters=false",
    "xla_cpu_parallel_codegen_split_count": "--xla_cpu_parallel_codegen_split_count=1",
}


def _known(flags: list[str]) -> bool:
    """Whether this jaxlib's XLA runs with `flags` added to $XLA_FLAGS."""
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; jax.jit(abs)(1.0)"],
        env={**os.environ, "XLA_FLAGS": " ".join([_FLAGS, *flags])},
        capture_output=True,
        timeout=120,
    )
    return probe.returncode == 0


_missing = [flag for name, flag in _CHEAPER_COMPILES.items() if name not in _FLAGS]
if _missing:
    _kept = _missing if _known(_missing) else [f for f in _missing if _known([f])]
    _FLAGS = os.environ["XLA_FLAGS"] = " ".join([_FLAGS, *_kept]).strip()


# One compilation cache for the tests, kept between runs (most of a run is compiling:
# a second run of test_model.py takes 15 s instead of 45), shared by the xdist workers
# and the train.py / decode.py subprocesses. Capped, least recently used first out;
# the cap also makes JAX lock the directory (filelock), so that no process reads a
# file another one is writing. ATTENTION_JAX_TEST_CACHE=DIR moves it, =off turns it
# off (then each run compiles everything, as CI on a fresh clone does).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_CACHE = os.environ.get("ATTENTION_JAX_TEST_CACHE", os.path.join(ROOT, ".cache", "test-xla"))
TEST_CACHE_BYTES = 2 << 30
if TEST_CACHE != "off":
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(TEST_CACHE_BYTES)  # subprocesses too
    from attention_jax.runtime import xla

    xla.enable_compilation_cache(TEST_CACHE)
    import jax

    jax.config.update("jax_compilation_cache_max_size", TEST_CACHE_BYTES)
    # Programs that compile in less are not worth a locked write and a file each.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def session_dir(tmp_path_factory, name: str) -> str:
    """A directory of this test session, shared by its xdist workers (the parent of a
    worker's base directory is the session's; without xdist it holds earlier sessions
    too, so the base directory itself is used)."""
    base = tmp_path_factory.getbasetemp()
    return str((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name)


@pytest.fixture(autouse=True, scope="session")
def _compilation_cache(tmp_path_factory):
    """train.py and decode.py in subprocesses use the tests' compilation cache, never the
    user's (~/.cache/attention-jax/xla); with the tests' cache off, one of this session
    per xdist worker (a file written in place must not be read half written)."""
    cache = TEST_CACHE if TEST_CACHE != "off" else str(tmp_path_factory.mktemp("xla_cache"))
    os.environ["ATTENTION_JAX_COMPILATION_CACHE"] = cache


@pytest.fixture(autouse=True, scope="session")
def _log_to_stderr():
    """The project's log lines on stderr, as train.py and decode.py print them."""
    from attention_jax.runtime import log

    log.setup()


@pytest.fixture(autouse=True)
def _log_to_caplog():
    """The project's loggers also propagate to the root logger, where pytest's caplog
    listens on every pytest version (pytest < 9 does not attach it to loggers that do
    not propagate). Set before each test: an in-process train.main() or decode.main()
    calls log.setup() again, which turns propagation off."""
    import logging

    from attention_jax.runtime import log

    logging.getLogger(log.ROOT_LOGGER).propagate = True


_COUNTS = {"compiles": 0, "subprocesses": 0, "compile_s": 0.0, "trace_s": 0.0, "lower_s": 0.0}
# Seconds of this process (not its children) in XLA's compiles (or cache loads), in
# tracing Python functions to jaxprs and in lowering those to XLA's input.
_SECONDS = {
    "/jax/core/compile/backend_compile_duration": "compile_s",
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
}


# The same seconds by program (the jitted function's name): [compiles, compile s, trace s,
# lower s] each.
_BY_PROGRAM: dict[str, list[float]] = {}


def _count_compiles(event: str, seconds: float, fun_name: str = "?", **kwargs) -> None:
    if event not in _SECONDS:
        return
    name = fun_name[4:-1] if fun_name.startswith("jit(") else fun_name  # jit(f) -> f
    counts = _BY_PROGRAM.setdefault(name, [0, 0.0, 0.0, 0.0])
    if event == "/jax/core/compile/backend_compile_duration":  # a compile or a cache load
        _COUNTS["compiles"] += 1
        counts[0] += 1
    _COUNTS[_SECONDS[event]] += seconds
    counts[1 + list(_SECONDS).index(event)] += seconds


@pytest.fixture(autouse=True, scope="session")
def _compile_listener():
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_count_compiles)


@pytest.fixture(autouse=True)
def _costs(record_property, monkeypatch):
    """Each test's XLA compiles in this process (with their seconds, and tracing's and
    lowering's; also by program) and the subprocesses it starts, as test properties
    (`pytest -p tests.suite_profile --suite-profile=F` writes them, and sums them per module
    and per program)."""
    start = dict(_COUNTS)
    programs = {name: list(counts) for name, counts in _BY_PROGRAM.items()}
    init = subprocess.Popen.__init__

    def counting_init(self, *args, **kwargs):
        _COUNTS["subprocesses"] += 1
        init(self, *args, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", counting_init)
    yield
    for name, value in _COUNTS.items():
        record_property(name, round(value - start[name], 3))
    spent = {}
    for name, counts in _BY_PROGRAM.items():
        before = programs.get(name, [0, 0.0, 0.0, 0.0])
        if counts != before:
            spent[name] = [round(a - b, 3) for a, b in zip(counts, before, strict=True)]
    record_property("programs", spent)


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    """Tests never reach the network: outbound connections fail loudly."""

    def guard(*args, **kwargs):
        raise RuntimeError("tests must not use the network")

    monkeypatch.setattr(socket.socket, "connect", guard)
    monkeypatch.setattr(socket, "create_connection", guard)


# A model small enough for a unit test, without dropout; each test file overrides a few sizes.
TEST_MODEL = dict(
    vocab_size=40,
    d_model=32,
    num_heads=2,
    num_encoder_layers=1,
    num_decoder_layers=1,
    d_ff=64,
    dropout_rate=0.0,
    max_len=32,
)


def model_fields(**overrides) -> dict:
    """TransformerConfig fields: TEST_MODEL with `overrides`."""
    return {**TEST_MODEL, **overrides}


def perturbed_model(seed: int = 0, **overrides):
    """A TEST_MODEL Transformer (with `overrides`) whose every parameter (zero biases and
    LayerNorm scales included) is moved off its initial value, so that a weight used in
    the wrong place shows."""
    import jax
    from flax import nnx

    from attention_jax import Transformer, TransformerConfig

    model = Transformer(TransformerConfig(**model_fields(**overrides)), rngs=nnx.Rngs(seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    noise = [jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]
    leaves = [x + 0.2 * n for x, n in zip(leaves, noise, strict=True)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves), rest)


def small_train_config(**overrides):
    """configs/tiny.py shrunk for tests (d_model 32, one layer each side, no periodic eval)."""
    from attention_jax.configs import tiny

    c = tiny.get_config()
    c.vocab_size = 300
    c.max_length = 16
    c.batch_tokens = 256
    c.model.d_model = 32
    c.model.num_heads = 2
    c.model.num_encoder_layers = 1
    c.model.num_decoder_layers = 1
    c.model.d_ff = 64
    c.model.max_len = 64
    # Dropout on, whatever tiny uses, so that resume tests also cover the RNG streams.
    c.model.dropout_rate = 0.1
    c.warmup_steps = 10
    c.num_train_steps = 30
    c.log_every_steps = 5
    c.eval_every_steps = 0
    c.checkpoint_every_steps = 10
    c.final_eval_max_examples = 8
    c.search.beam_size = 2
    c.num_examples_to_print = 1
    for k, v in overrides.items():
        node = c
        *path, last = k.split(".")
        for p in path:
            node = node[p]
        node[last] = v
    return c


def write_reversal_tsv(path, num_pairs: int, max_words: int, seed: int) -> str:
    """Write 'a b c<TAB>c b a' pairs of 2..max_words pseudo-words (300 of them) to path."""
    rng = np.random.default_rng(seed)
    letters = list("abcdefghijklmnopqrstuvwxyz")
    words = ["".join(rng.choice(letters, size=rng.integers(3, 7))) for _ in range(300)]
    with open(path, "w") as f:
        for _ in range(num_pairs):
            w = list(rng.choice(words, size=rng.integers(2, max_words + 1)))
            f.write(" ".join(w) + "\t" + " ".join(w[::-1]) + "\n")
    return str(path)


def train_rows(workdir) -> dict[int, dict]:
    """{step: row} of the train rows of WORKDIR/metrics.jsonl (the last row wins for a step)."""
    rows = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if "train_loss" in row:
                rows[row["step"]] = row
    return rows


def train_losses(workdir) -> dict[int, float]:
    """{step: train_loss} from WORKDIR/metrics.jsonl."""
    return {step: row["train_loss"] for step, row in train_rows(workdir).items()}


def search_rule(beam_size: int, n_best: int | None = None, **settings):
    """A compiled search's Rule for these settings; n_best defaults to all K beams."""
    from attention_jax.search.settings import SearchSettings

    n_best = beam_size if n_best is None else n_best
    return SearchSettings(beam_size=beam_size, n_best=n_best, **settings).rule()


# --- Fixtures shared by several test modules --------------------------------------------
# (Their helpers: tests/digits.py, tests/fault_runs.py.)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The trained digit workdir (tests/digits.py), a copy of its own for each test module:
    trained once per test session (~1 min on 2 cores), by the first xdist worker that
    needs it, and used by the tests of decode.py (test_decode_cli, test_decode_stream,
    test_decode_pace, test_targets), test_ct2_decode, test_library and test_bench_*."""
    import shutil

    from attention_jax.training import config as config_lib
    from tests.digits import build_digit_workdir

    shared = session_dir(tmp_path_factory, "digit-workdir")
    build_digit_workdir(shared)  # or wait for the worker that builds it
    wd = str(tmp_path_factory.mktemp("workdir") / "w")
    shutil.copytree(shared, wd)
    config = config_lib.load_config(wd)
    config.dataset = f"tsv:{os.path.join(wd, 'digits.tsv')}"  # this copy's (--split=test)
    config_lib.save_config(config, wd)
    return wd


@pytest.fixture(scope="module")
def digit_export(workdir, tmp_path_factory):
    """The digit workdir exported (decode.py --export --n_best=2), made once per test
    session by the first xdist worker that needs it (a lock: the others wait), for
    test_decode_cli and test_library, which only read it."""
    from tests.decode_runs import run_decode
    from tests.digits import build_once

    def export(building: str) -> None:
        r = run_decode(f"--workdir={workdir}", f"--export={building}", "--n_best=2")
        assert r.returncode == 0, r.stderr.decode()

    shared = session_dir(tmp_path_factory, "digit-export")
    build_once(shared, export)
    return shared


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Reversal pairs for the fault tests' runs (test_faults, test_restore_faults), as a
    config.dataset: one file per test session (the finished run's config names it)."""
    from tests.digits import build_once

    def write(building: str) -> None:
        os.makedirs(building)
        write_reversal_tsv(os.path.join(building, "pairs.tsv"), 600, max_words=4, seed=7)

    shared = session_dir(tmp_path_factory, "fault-corpus")
    build_once(shared, write)
    return "tsv:" + os.path.join(shared, "pairs.tsv")


@pytest.fixture(scope="module")
def base(corpus, tmp_path_factory):
    """A finished 20-step run with checkpoints at steps 10 and 20 (tests/fault_runs.py
    `cfg`), trained once per test session by the first xdist worker that needs it (the
    others wait): test_faults and test_restore_faults damage and resume copies of it."""
    import pathlib

    from attention_jax.training import train_and_evaluate
    from tests.digits import build_once
    from tests.fault_runs import cfg

    shared = session_dir(tmp_path_factory, "fault-base")
    build_once(shared, lambda building: train_and_evaluate(cfg(corpus), building))
    return pathlib.Path(shared)


@pytest.fixture
def segmented(monkeypatch):
    """Live searches on this CPU batched as on a GPU (whole, or shrinking in segments:
    search/rows.py), not pooled (search/pool.py `POOL_PLATFORMS`): test_stages,
    test_programs and test_bench_decode_segments check the segments with it."""
    from attention_jax.search import pool

    monkeypatch.setattr(pool, "POOL_PLATFORMS", ())
