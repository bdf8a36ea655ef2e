"""SIGKILL trials: kill `train.py` at random moments (and right inside asynchronous
checkpoint saves), re-run it, and check that nothing is lost.

    .venv/bin/python tests/fault_trials.py --trials=10          # ~7-15 min on 2 CPU cores

Each trial trains a small model into a fresh workdir with the real CLI. Up to
`--kills` times per trial the run is SIGKILLed, either after a random delay
(20-100% of the reference run's wall time) or inside the 1st-3rd asynchronous
save of that run (an Orbax temporary directory in flight); after every
kill each complete checkpoint on disk must restore, and the next run must say it
resumed from the newest one. When a run finally finishes, its final train state
(params, Adam moments, step, RNG streams) and its metrics must equal those of an
uninterrupted reference run. Prints one JSON line per trial and a summary table;
exit status 1 if any trial failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.conftest import train_losses, write_reversal_tsv  # noqa: E402

CONFIG = """
from tests.conftest import small_train_config

def get_config():
    return small_train_config(dataset="tsv:{corpus}", num_train_steps={steps},
                              checkpoint_every_steps=5, log_every_steps=5,
                              final_eval_max_examples=2)
"""


def write_inputs(directory: str, steps: int) -> str:
    corpus = write_reversal_tsv(
        os.path.join(directory, "pairs.tsv"), num_pairs=800, max_words=5, seed=3
    )
    path = os.path.join(directory, "trial_config.py")
    with open(path, "w") as f:
        f.write(CONFIG.format(corpus=corpus, steps=steps))
    return path


def start(config: str, workdir: str, log: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "train.py", f"--config={config}", f"--workdir={workdir}"]
    with open(log, "w") as err:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)


def tmp_dirs(workdir: str) -> set[str]:
    """Orbax's temporary step directories: saves in flight (or cut short)."""
    d = os.path.join(workdir, "checkpoints")
    return {n for n in os.listdir(d) if "tmp" in n} if os.path.isdir(d) else set()


def full_state(workdir: str, step: int):
    """The whole TrainState of checkpoint `step`, as numpy leaves (raises if unusable)."""
    import jax

    from attention_jax.training import checkpoints, load_config, steps
    from attention_jax.training.mesh import make_mesh

    config = load_config(workdir)
    config.mesh_data = 1
    setup = steps.train_setup(config, make_mesh(config, jax.devices()[:1]))
    manager = checkpoints.Checkpoints(workdir, create=False)
    try:
        state, data = manager.restore(step, setup.abstract)
    finally:
        manager.close()
    leaves = jax.tree.leaves(jax.tree.map(lambda x: x, state))
    out = []
    for x in leaves:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out.append(np.asarray(x))
    return out, data


def complete_steps(workdir: str) -> list[int]:
    d = os.path.join(workdir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def trial(i: int, config: str, root: str, ref_seconds: float, max_kills: int, rng, ref) -> dict:
    workdir = os.path.join(root, f"trial{i}")
    record = {"trial": i, "kills": [], "runs": 0, "problems": []}
    expected_resume = None
    while True:
        log = os.path.join(root, f"trial{i}.run{record['runs']}.log")
        proc = start(config, workdir, log)
        record["runs"] += 1
        kill = len(record["kills"]) < max_kills
        mode = ("during_save", "random")[(i + len(record["kills"])) % 2]
        t0, killed, in_save = time.time(), False, False
        stale = tmp_dirs(workdir)  # left by an earlier kill: not a save of this run
        # Random kills fall anywhere from start-up to the end of the run; save kills
        # land inside this run's n-th save, so that earlier saves are complete and
        # the re-run must resume from them.
        if mode == "random":
            deadline = t0 + rng.uniform(0.2, 1.0) * ref_seconds
        else:
            deadline = t0 + 3 * ref_seconds
        target_save = int(rng.integers(1, 4))
        seen: set[str] = set()
        while proc.poll() is None:
            in_flight = tmp_dirs(workdir) - stale
            seen |= in_flight
            save_due = mode == "during_save" and in_flight and len(seen) >= target_save
            if kill and (time.time() >= deadline or save_due):
                in_save = bool(tmp_dirs(workdir) - stale)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                killed = True
                break
            time.sleep(0.005)
        with open(log) as f:
            err = f.read()
        m = re.search(r"resumed from step (\d+)", err)
        resumed = int(m.group(1)) if m else None
        started = not killed or re.search(r"^step \d+/", err, re.M)  # got past restoring
        if started and resumed != expected_resume:
            record["problems"].append(
                f"run {record['runs']}: resumed {resumed}, expected {expected_resume}"
            )
        if not killed:
            if proc.returncode != 0:
                record["problems"].append(f"run exited {proc.returncode}: {err[-500:]}")
            break
        on_disk = complete_steps(workdir)
        record["kills"].append(
            {
                "mode": mode,
                "at_s": round(time.time() - t0, 2),
                "save_in_flight": in_save,
                "complete_steps": on_disk,
            }
        )
        record["problems"] += unusable_checkpoints(workdir, on_disk)
        expected_resume = on_disk[-1] if on_disk else None
    if not record["problems"]:
        compare_with_reference(record, workdir, root, ref)
    record["ok"] = not record["problems"]
    return record


def unusable_checkpoints(workdir: str, steps: list[int]) -> list[str]:
    """A problem line for each of `steps` whose checkpoint does not restore (with the
    chain of causes): after a kill, every complete checkpoint must."""
    problems = []
    for step in steps:
        try:
            full_state(workdir, step)
        except Exception as e:
            causes = [e]
            while causes[-1].__cause__ is not None:
                causes.append(causes[-1].__cause__)
            why = " <- ".join(f"{type(c).__name__}: {str(c)[:300]}" for c in causes)
            problems.append(f"step {step} unusable after kill: {why}")
    return problems


def compare_with_reference(record: dict, workdir: str, root: str, ref) -> None:
    """Adds to `record` how the killed trial's final state, data position and train losses
    compare with the uninterrupted reference run's (all must be equal)."""
    final = complete_steps(workdir)[-1]
    leaves, data = full_state(workdir, final)
    ref_leaves, ref_data = ref
    diff = max(
        float(np.max(np.abs(a.astype(np.float64) - b))) if a.size else 0.0
        for a, b in zip(leaves, ref_leaves, strict=True)
    )
    record["final_step"], record["max_abs_diff"] = final, diff
    record["data_position_equal"] = data["iterators"] == ref_data["iterators"]
    if diff != 0.0 or not record["data_position_equal"]:
        record["problems"].append(f"final state differs from the reference (max {diff})")
    record["losses_equal"] = train_losses(workdir) == train_losses(os.path.join(root, "ref"))
    if not record["losses_equal"]:
        record["problems"].append("metrics.jsonl train losses differ from the reference")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--kills", type=int, default=2, help="SIGKILLs per trial (at most)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default="", help="work directory (default: a temp dir)")
    args = parser.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="fault_trials_")
    os.makedirs(root, exist_ok=True)
    config = write_inputs(root, args.steps)
    t0 = time.time()
    ref_dir = os.path.join(root, "ref")
    proc = start(config, ref_dir, os.path.join(root, "ref.log"))
    if proc.wait(timeout=900) != 0:
        with open(os.path.join(root, "ref.log")) as f:
            print(f.read()[-3000:], file=sys.stderr)
        return 1
    ref_seconds = time.time() - t0
    ref = full_state(ref_dir, complete_steps(ref_dir)[-1])
    rng = np.random.default_rng(args.seed)
    records = []
    for i in range(args.trials):
        r = trial(i, config, root, ref_seconds, args.kills, rng, ref)
        print(json.dumps(r), flush=True)
        records.append(r)
    print(f"\nreference run: {ref_seconds:.0f}s; work dir {root}")
    print("| trial | kills (mode @ s, save in flight, complete steps) | runs | final == ref |")
    print("|---|---|---|---|")
    for r in records:
        kills = "; ".join(
            f"{k['mode']} @ {k['at_s']}s, {'in save' if k['save_in_flight'] else 'no save'}, "
            f"{k['complete_steps']}"
            for k in r["kills"]
        )
        print(f"| {r['trial']} | {kills} | {r['runs']} | {'yes' if r['ok'] else r['problems']} |")
    ok = sum(r["ok"] for r in records)
    in_save = sum(k["save_in_flight"] for r in records for k in r["kills"])
    kills = sum(len(r["kills"]) for r in records)
    print(f"\n{ok}/{len(records)} trials OK; {kills} SIGKILLs, {in_save} during a save")
    return 0 if ok == len(records) else 1


if __name__ == "__main__":
    sys.exit(main())
