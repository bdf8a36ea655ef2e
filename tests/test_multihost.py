"""Multi-process training on one machine: 2 CPU processes x 2 devices (gloo collectives
over 127.0.0.1) against 1 process x 4 devices.

With the same data shards (`config.data_shards=2`), the two set-ups see the same
global batches, so their losses must agree; a checkpoint written cooperatively by
the 2 processes must restore in (and resume exactly on) a single process.
"""

import json
import os
import shutil
import sys
import textwrap

import numpy as np
import pytest

from tests.conftest import train_losses, write_reversal_tsv
from tests.cpu_jobs import start_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = textwrap.dedent(
    """
    import json, sys
    from attention_jax.runtime import distributed
    pid, nproc, port, workdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    overrides = json.loads(sys.argv[5])
    if nproc > 1:
        distributed.initialize(f"127.0.0.1:{port}", nproc, pid)
    import jax
    from tests.conftest import small_train_config
    from attention_jax.training import train_and_evaluate

    assert jax.process_count() == nproc and jax.device_count() == 4, jax.devices()
    summary = train_and_evaluate(small_train_config(**overrides), workdir)
    keys = ("step", "preempted", "eval_loss", "eval_bleu", "eval_examples")
    print("SUMMARY " + json.dumps({k: summary.get(k) for k in keys}), flush=True)
    """
)


def run_processes(
    nproc: int, workdir, overrides: dict, timeout: float = 300, worker: str = WORKER
) -> list[dict]:
    """Run `worker` in `nproc` processes with 4 // nproc CPU devices each; their summaries."""
    tail = [str(workdir), json.dumps(overrides)]
    procs = start_job(
        nproc, lambda i, port: [sys.executable, "-c", worker, str(i), str(nproc), port, *tail]
    )
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:  # a hang (or one process failing) must not block the suite
            if p.poll() is None:
                p.kill()
                p.communicate()
    summaries = []
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-4000:]
        line = next(x for x in out.splitlines() if x.startswith("SUMMARY "))
        summaries.append(json.loads(line[len("SUMMARY ") :]))
    return summaries


@pytest.fixture(scope="module")
def overrides(tmp_path_factory):
    """Short pairs, bucketed with widths fitted to them: processes (and the 2 shards of the
    1-process run) agree on the widths and on the batches per bucket."""
    path = write_reversal_tsv(
        tmp_path_factory.mktemp("data") / "pairs.tsv", num_pairs=400, max_words=3, seed=1
    )
    return {
        "dataset": f"tsv:{path}",
        "packing": False,
        "long_pairs": "truncate",
        "data_shards": 2,
        "num_train_steps": 6,
        "log_every_steps": 1,
        "checkpoint_every_steps": 3,
        "final_eval_max_examples": 6,
    }


@pytest.mark.slow  # ~2 min on 2 cores; test_fitted_buckets_agree_across_processes stays fast
def test_two_processes_match_one_and_their_checkpoint_resumes_on_one(overrides, tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    s2 = run_processes(2, two, overrides)
    run_processes(1, one, {**overrides, "num_train_steps": 8})

    # Same global batches => same losses, step by step (float reduction order aside).
    l2, l1 = train_losses(two), train_losses(one)
    assert sorted(l2) == [1, 2, 3, 4, 5, 6]
    assert [l2[s] for s in range(1, 7)] == pytest.approx([l1[s] for s in range(1, 7)], rel=1e-5)
    # Both processes report the same final eval, over the whole dev subset (not a shard).
    assert s2[0] == s2[1]
    assert s2[0]["eval_examples"] == 6 and s2[0]["step"] == 6
    # Only process 0 writes logs: one row per step, no duplicates.
    with open(two / "metrics.jsonl") as f:
        steps = [json.loads(x)["step"] for x in f if "train_loss" in x]
    assert steps == [1, 2, 3, 4, 5, 6]

    # The 2-process checkpoint (one data position per process) resumes on 1 process
    # exactly where the 1-process run was at step 6.
    with open(two / "checkpoints" / "6" / "data" / "metadata") as f:
        data_item = json.load(f)
    assert len(data_item["iterators"]) == 2
    # Token counts (tokens/s, MFU, tokens_seen) cover every process's rows: the same
    # global batches give the same count on 2 processes as on 1.
    with open(one / "checkpoints" / "6" / "data" / "metadata") as f:
        assert data_item["tokens_seen"] == json.load(f)["tokens_seen"] > 0
    resumed = tmp_path / "resumed"
    shutil.copytree(two, resumed)
    run_processes(1, resumed, {**overrides, "num_train_steps": 8})
    lr = train_losses(resumed)
    assert [lr[7], lr[8]] == pytest.approx([l1[7], l1[8]], rel=1e-5)

    # restore_model (inference) reads the 2-process checkpoint in this process: the
    # parameters of the 1-process run at the same step.
    import jax
    from flax import nnx

    from attention_jax.training.workdir import restore_model

    model2, config, step = restore_model(str(two))
    model1, _, _ = restore_model(str(one), step=6)
    assert step == 6 and config.data_shards == 2
    p2, p1 = (
        jax.tree.leaves(nnx.state(model2, nnx.Param)),
        jax.tree.leaves(nnx.state(model1, nnx.Param)),
    )
    assert len(p2) == len(p1) > 0
    for a, b in zip(p2, p1, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


WIDTHS_WORKER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from attention_jax.runtime import distributed
    pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    distributed.initialize(f"127.0.0.1:{port}", nproc, pid)
    from attention_jax.configs import default
    from attention_jax.data.pipeline import TrainIterator
    from attention_jax.data.tokenized import TokenizedCorpus
    from attention_jax.training.input import agreed_widths, max_over_processes

    # Process 0's shard holds short pairs, process 1's long ones.
    rng = np.random.default_rng(pid)
    n = 2000
    lens = rng.integers(2, 12, n) if pid == 0 else rng.integers(20, 60, n)
    lens = lens.astype(np.int16)
    flat = rng.integers(4, 100, int(lens.sum())).astype(np.uint16)
    start = np.concatenate([[0], np.cumsum(lens[:-1], dtype=np.int64)])
    shard = TokenizedCorpus(flat, start, lens, flat, start, lens, np.arange(n, dtype=np.int64))
    c = default.get_config()
    c.max_length, c.batch_tokens, c.num_length_buckets = 64, 1024, 6
    # As training/input.py does: widths and batch counts agreed on across the processes.
    widths = agreed_widths(c, [shard], num_shards=2, multiple=1)
    shared = TrainIterator(
        c, None, None, tokenized=shard, shard=pid, num_shards=2, widths=widths,
        agree=max_over_processes,
    )
    alone = TrainIterator(c, None, None, tokenized=shard)
    out = {"shared": [s[1] for s in shared.shapes], "alone": [s[1] for s in alone.shapes]}
    out["batches"] = shared.batches_per_epoch
    print("SUMMARY " + json.dumps(out), flush=True)
    """
)


def test_fitted_buckets_agree_across_processes(tmp_path):
    """Widths are fitted to the sum of every process's length histogram: processes whose
    shards alone would get different widths plan the same shapes and batch counts."""
    s0, s1 = run_processes(2, tmp_path, {}, worker=WIDTHS_WORKER)
    assert s0["shared"] == s1["shared"] and s0["batches"] == s1["batches"]
    assert s0["alone"] != s1["alone"]
    assert max(s0["alone"]) <= 12 and min(s1["alone"]) >= 21  # each shard's own lengths
    # The shared widths serve both: the short shard's longest pair and the long one's.
    assert s0["shared"][-1] == max(s1["alone"]) and min(s0["shared"]) <= max(s0["alone"])
