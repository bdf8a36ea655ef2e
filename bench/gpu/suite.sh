#!/usr/bin/env bash
# The GPU suite in one command: environment, GPU tests, training and decoding benchmarks.
#
#   bench/gpu/suite.sh OUTDIR [--wheels DIR] [--commit SHA] [--tar-logs] [--dry-run]
#                      [--only STEP,STEP...]
#   make gpu-suite OUT=OUTDIR
#
# For a GPU machine with jax, even one without network access (one H100/H200, jax 0.11.2
# on CUDA 13; see docs/PERFORMANCE.md, "GPU suite"), in under 10 minutes:
#   1. setup   install, from DIR (default: .whl/, filled by bench/gpu/fetch_wheels.sh where
#              PyPI is reachable), the wheels of packages this Python lacks, into a
#              private folder put on PYTHONPATH; record versions, nvidia-smi and
#              jax.devices() (env.json)
#   2. pytest  `pytest -m gpu tests/test_gpu.py` on the GPU (pytest.jsonl, one line a test)
#   3. train_base, decode_base, train_big
#              bench/train.py, Transformer-base then -big, bf16, the paper's ~25k-token
#              batches bucketed by length up to 256 (the configs' layout, on cuDNN
#              attention; one compiled program per bucket met); bench/decode.py,
#              Transformer-base, beam 4, batch 128
#   4. train_base_packed, train_big_packed: the same in packed rows (XLA attention,
#              one compiled shape), each only if the time left allows
# OUTDIR gets summary.json (every step's status, rc and seconds; test counts),
# env.json, pytest.jsonl, <device>-<yyyymmdd>-<commit>.jsonl (each benchmark's JSON
# object, the form bench/results/ keeps) and logs/<step>.log (with --tar-logs,
# logs.tar.gz instead: fewer files to copy back).
# A step that fails or overruns its time budget is recorded and the suite goes
# on; it exits 1 if any step failed. --only runs setup and the steps named (e.g.
# --only pytest,train_base to rerun what failed). --dry-run runs the same steps on the CPU
# with tiny settings (configs/tiny.py, a few steps), to test the plumbing here.
#
# Environment: PYTHON (default python3; .venv/bin/python in a dry run if present),
# SUITE_BUDGET_S (570, x4 in a dry run: the whole suite), GPU_SUITE_SITE (/tmp/gpu-suite-site: where
# wheels are installed), TRAIN_STEPS (12), MAX_SHAPES (4), DECODE_BATCHES (128), PYTEST_K
# (a pytest -k expression: which GPU tests the pytest step runs; default all).
set -euo pipefail

usage() { sed -n '2,4p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

OUT="" WHEELS="" COMMIT="${GIT_COMMIT:-}" DRY_RUN=0 TAR_LOGS=0 ONLY=""
while (($#)); do
  case "$1" in
    --wheels) WHEELS="${2:?--wheels needs a folder}"; shift 2 ;;
    --commit) COMMIT="${2:?--commit needs a SHA}"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --tar-logs) TAR_LOGS=1; shift ;;
    --only) ONLY=",${2:?--only needs step names, e.g. pytest,train_base},"; shift 2 ;;
    -h | --help) usage ;;
    -*) echo "unknown option $1" >&2; usage ;;
    *) [[ -z "$OUT" ]] || usage; OUT="$1"; shift ;;
  esac
done
[[ -n "$OUT" ]] || usage
STEPS=",pytest,train_base,decode_base,train_big,train_base_packed,train_big_packed,"
for step in ${ONLY//,/ }; do
  [[ "$STEPS" == *",$step,"* ]] || { echo "--only: no step $step (steps: ${STEPS//,/ })" >&2; exit 2; }
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
mkdir -p "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"
: >"$OUT/steps.jsonl"

if [[ -z "${PYTHON:-}" && "$DRY_RUN" == 1 && -x .venv/bin/python ]]; then
  PYTHON=.venv/bin/python
fi
PY="${PYTHON:-python3}"
WHEELS="${WHEELS:-$ROOT/.whl}"
SITE="${GPU_SUITE_SITE:-/tmp/gpu-suite-site}"
# Budgets are for the GPU; the CPU of a dry run is slower, and may be shared.
SCALE=$((DRY_RUN ? 4 : 1))
START=$(date +%s)
DEADLINE=$((START + ${SUITE_BUDGET_S:-$((570 * SCALE))}))
FAILED=0
export PYTHONUNBUFFERED=1

if [[ "$DRY_RUN" == 1 ]]; then
  export JAX_PLATFORMS=cpu GPU_SUITE_ON_CPU=1
  SHAPE=(--steps=3 --corpus_pairs=400)
  BASE=(--configs=tiny "${SHAPE[@]}")
  BIG=(--configs=tiny --batch_tokens=512 "${SHAPE[@]}")
  DECODE_ARGS=(--configs=tiny --beam_sizes=4 --batch_sizes=4 --src_len=12 --iters=1)
else
  export JAX_PLATFORMS=cuda
  # The default buckets (25 up to 256 tokens) would compile a program for each of the
  # ~10 that 12 steps meet: time only the 4 most frequent shapes (4 compiles a config).
  SHAPE=(--batch_tokens=25000 --max_length=256 --steps="${TRAIN_STEPS:-12}" --corpus_pairs=20000
    --max_shapes="${MAX_SHAPES:-4}")
  BASE=(--configs=base "${SHAPE[@]}")
  BIG=(--configs=big "${SHAPE[@]}")
  DECODE_ARGS=(--configs=base --beam_sizes=4 --batch_sizes="${DECODE_BATCHES:-128}"
    --src_len=32 --iters=3)
fi

say() { echo "[gpu-suite $(date +%H:%M:%S)] $*"; }

# run_step NAME BUDGET_S [--optional] CMD...: run CMD with its output in logs/NAME.log,
# within BUDGET_S seconds and the suite's deadline; one line in steps.jsonl.
# An --optional step that would not fit in the time left is skipped, not failed.
run_step() {
  local name=$1 budget=$(($2 * SCALE)) optional=0
  shift 2
  if [[ "$1" == --optional ]]; then optional=1; shift; fi
  local left=$((DEADLINE - $(date +%s)))
  local status rc=0 t0 seconds
  if [[ -n "$ONLY" && "$name" != setup && "$ONLY" != *",$name,"* ]]; then
    status=skipped rc=0 seconds=0
    say "$name: skipped (not in --only)"
  elif ((optional && left < budget)); then
    status=skipped rc=0 seconds=0
    say "$name: skipped (needs ${budget}s, ${left}s left)"
  elif ((left < 10)); then
    status=skipped rc=0 seconds=0 FAILED=1
    say "$name: skipped, the suite's time is up"
  else
    ((budget <= left)) || budget=$left
    say "$name: running (budget ${budget}s): $*"
    t0=$(date +%s)
    timeout --kill-after=20 "$budget" "$@" >"$OUT/logs/$name.log" 2>&1 || rc=$?
    seconds=$(($(date +%s) - t0))
    case $rc in
      0) status=ok ;;
      124 | 137) status=timeout FAILED=1 ;;
      *) status=failed FAILED=1 ;;
    esac
    say "$name: $status (rc $rc, ${seconds}s)"
    if [[ $status != ok ]]; then tail -n 25 "$OUT/logs/$name.log" | sed 's/^/    /'; fi
  fi
  printf '{"step": "%s", "status": "%s", "rc": %d, "seconds": %d, "budget_s": %d}\n' \
    "$name" "$status" "$rc" "$seconds" "$budget" >>"$OUT/steps.jsonl"
}

# --- 1. setup: missing wheels, versions, devices ------------------------------------------

# shellcheck disable=SC2329  # setup and this run in a child bash (export -f, below)
install_missing_wheels() {
  [[ -d "$WHEELS" ]] || { echo "no wheel folder $WHEELS: installing nothing"; return 0; }
  local missing
  # A wheel whose distribution this Python already has is skipped: never shadow the
  # machine's own jax, numpy or CUDA libraries.
  missing=$("$PY" - "$WHEELS" <<'EOF'
import importlib.metadata as md
import pathlib
import sys

for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name = wheel.name.split("-")[0]
    try:
        print(f"present: {name} {md.version(name)}", file=sys.stderr)
    except md.PackageNotFoundError:
        print(wheel)
EOF
  )
  if [[ -z "$missing" ]]; then
    echo "every wheel in $WHEELS is installed already"
    return 0
  fi
  echo "installing into $SITE:"
  echo "$missing"
  mkdir -p "$SITE"
  # shellcheck disable=SC2086  # one wheel path a line, no spaces (pip's own file names)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" $missing
}

# shellcheck disable=SC2329
setup() {
  install_missing_wheels
  echo "== nvidia-smi"
  nvidia-smi || echo "(no nvidia-smi here)"
  echo "== python packages and devices"
  "$PY" - "$OUT/env.json" "$DRY_RUN" <<'EOF'
import importlib.metadata as md
import json
import platform
import subprocess
import sys

out_path, dry_run = sys.argv[1], sys.argv[2] == "1"
names = ["jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "flax", "optax",
         "orbax-checkpoint", "grain", "array-record", "ml-collections", "tensorboardX",
         "numpy", "sentencepiece", "sacrebleu", "pytest", "nvidia-cudnn-cu13"]
versions = {}
for name in names:
    try:
        versions[name] = md.version(name)
    except md.PackageNotFoundError:
        versions[name] = None
import jax  # noqa: E402

env = {"python": platform.python_version(), "executable": sys.executable,
       "versions": versions, "backend": jax.default_backend(),
       "devices": [str(d) for d in jax.devices()],
       "device_kind": jax.devices()[0].device_kind}
try:
    from jax._src.lib import cuda_versions  # private; the cuDNN JAX actually loaded
    env["cudnn"] = cuda_versions.cudnn_get_version() if cuda_versions else None
except Exception as e:  # informative only
    env["cudnn"] = f"unknown ({type(e).__name__})"
try:
    q = "--query-gpu=name,driver_version,memory.total,clocks.max.sm"
    env["nvidia_smi"] = subprocess.run(["nvidia-smi", q, "--format=csv,noheader"],
                                       capture_output=True, text=True).stdout.strip()
except OSError:
    env["nvidia_smi"] = None
for module in ["grain", "ml_collections", "orbax.checkpoint", "sentencepiece", "sacrebleu"]:
    __import__(module)  # what the tests and benchmarks import; fail here, not later
json.dump(env, open(out_path, "w"), indent=1)
print(json.dumps(env, indent=1))
if not dry_run and env["backend"] != "gpu":
    sys.exit(f"JAX sees no GPU (backend {env['backend']!r}): nothing here would test one")
EOF
}

export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# The library itself (attention_jax): this checkout, linked, where it is not installed.
"$PY" -c "import attention_jax" 2>/dev/null || { mkdir -p "$SITE" && "$PY" tools/package_links.py "$SITE" >/dev/null; }
say "output in $OUT; python: $PY; dry run: $DRY_RUN"
# `timeout` runs programs, not functions: the step is a child bash that inherits them.
export -f setup install_missing_wheels
export PY WHEELS SITE OUT DRY_RUN
run_step setup 90 bash -c setup
cat "$OUT/logs/setup.log" || true

if [[ -z "$COMMIT" ]]; then
  COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
fi
DIRTY=false
if [[ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]]; then DIRTY=true; fi
DEVICE=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["device_kind"])' \
  "$OUT/env.json" 2>/dev/null || echo unknown)
DEVICE=$(echo "$DEVICE" | tr '[:upper:]' '[:lower:]' | sed 's/[^a-z0-9]\{1,\}/-/g; s/^-//; s/-$//')
RESULTS="$OUT/$DEVICE-$(date -u +%Y%m%d)-$COMMIT.jsonl"
: >"$RESULTS"

# --- 2. GPU tests -----------------------------------------------------------------------------

: >"$OUT/pytest.jsonl"
run_step pytest 150 "$PY" -m pytest -q -p no:xdist -p no:cacheprovider -p tests.pytest_jsonl \
  --jsonl="$OUT/pytest.jsonl" -m gpu -rfEs ${PYTEST_K:+-k "$PYTEST_K"} tests/test_gpu.py

# --- 3-4. benchmarks: each one's JSON object goes to the results file ---------------------

# bench NAME BUDGET_S [--optional] SCRIPT ARGS...: run_step, then keep its JSON line.
bench() {
  local name=$1 budget=$2 optional=()
  shift 2
  if [[ "$1" == --optional ]]; then optional=(--optional); shift; fi
  run_step "$name" "$budget" "${optional[@]}" "$PY" "$@"
  [[ -f "$OUT/logs/$name.log" ]] || return 0
  "$PY" - "$OUT/logs/$name.log" "$RESULTS" "$name" "$COMMIT" "$DIRTY" "$*" <<'EOF' || FAILED=1
import datetime
import json
import sys

log, results, step, commit, dirty, command = sys.argv[1:]
rows = [line for line in open(log) if line.startswith('{"benchmark"')]
if not rows:
    sys.exit(0)  # the step failed before printing; run_step recorded it
row = json.loads(rows[-1])
row["suite"] = {"step": step, "commit": commit, "dirty": dirty == "true",
                "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "command": command}
with open(results, "a") as f:
    f.write(json.dumps(row) + "\n")
EOF
}

# Most wanted first: when earlier steps run long, the deadline squeezes the later ones.
# Bucketed rows are what configs/base.py and big.py train on, and the layout that uses
# cuDNN attention ('auto' needs sequence lengths); packed rows use XLA attention over
# a dense segment mask and compile one shape, so they come last, if time allows.
bench train_base 180 bench/train.py "${BASE[@]}" --packing=bucketed
bench decode_base 120 bench/decode.py "${DECODE_ARGS[@]}"
bench train_big 180 bench/train.py "${BIG[@]}" --packing=bucketed
bench train_base_packed 100 --optional bench/train.py "${BASE[@]}" --packing=packed
bench train_big_packed 110 --optional bench/train.py "${BIG[@]}" --packing=packed

# --- summary ----------------------------------------------------------------------------------

"$PY" - "$OUT" "$RESULTS" "$DRY_RUN" "$(($(date +%s) - START))" <<'EOF' || FAILED=1
import json
import os
import sys

out, results, dry_run, seconds = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
steps = [json.loads(line) for line in open(os.path.join(out, "steps.jsonl"))]
tests, counts = [], {}
for line in open(os.path.join(out, "pytest.jsonl")):
    row = json.loads(line)
    if "nodeid" in row:
        tests.append(row)
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
problems = [f"step {s['step']}: {s['status']}" for s in steps if s["status"] not in ("ok", "skipped")]
problems += [f"{t['nodeid']}: {t['outcome']}" for t in tests if t["outcome"] in ("failed", "error")]
if not dry_run:  # on the GPU every GPU test must have run
    problems += [f"{t['nodeid']}: skipped" for t in tests if t["outcome"] == "skipped"]
if not tests and any(s["step"] == "pytest" and s["status"] != "skipped" for s in steps):
    problems.append("no test results")
summary = {"ok": not problems, "problems": problems, "dry_run": dry_run, "seconds": seconds,
           "steps": steps, "tests": counts, "results_file": os.path.basename(results),
           "benchmarks": sum(1 for _ in open(results))}
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(f"steps: " + ", ".join(f"{s['step']} {s['status']} {s['seconds']}s" for s in steps))
print(f"tests: {counts}; benchmark lines: {summary['benchmarks']} in {summary['results_file']}")
print("problems: " + ("; ".join(problems) if problems else "none"))
sys.exit(1 if problems else 0)
EOF
rm -f "$OUT/steps.jsonl"  # now inside summary.json

if [[ "$TAR_LOGS" == 1 ]]; then
  tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
fi
say "done in $(($(date +%s) - START))s: $([[ $FAILED == 0 ]] && echo ok || echo FAILED); see $OUT/summary.json"
exit "$FAILED"
