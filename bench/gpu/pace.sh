#!/usr/bin/env bash
# decode.py and train.py's evaluation at the accelerator's pace, on one GPU in one command:
#   bash bench/gpu/pace.sh <output dir> [seconds of train.py, default 180]
# Needs .data/de-en (the Ding file: mkdir -p .data && cp /usr/share/trans/de-en .data/
# where Debian's trans-de-en is installed) and, without network access, .whl/
# (bench/gpu/fetch_wheels.sh, run where PyPI is reachable), copied with the checkout.
#   1. the compile time of one search program, A/B: bench/decode.py (base, random
#      weights, beam 4, batch 128, no persistent cache) with XLA's default flags, whose
#      log carries XLA's own phase timers (TF_CPP_VMODULE), and with
#      --xla_gpu_autotune_level=0 (no autotuning)
#   2. train.py on Ding, base, packed 8192-token batches, for the seconds given
#      (stopped by SIGTERM, which checkpoints), with an evaluation of 500 dev sentences
#      every EVAL_EVERY steps (metrics.jsonl eval_seconds: the first compiles the
#      search's programs, the later ones must not)
#   3. decode.py end to end on 100,000 lines (Ding's training sources, cycled) with
#      that model, beam 4: an empty compilation cache, then the one it filled
#      (bench/decode_file.py: start-up, programs, host phases, device busy/idle);
#      DECODE_FLAGS go to decode.py (e.g. --batch_tokens=8192)
#   4. with CONSTRAINTS_S > 0 (seconds, default 0): bench/constraints.py on that model
#      and the Ding test set (what --constraints and --prefix cost)
# The train step's MFU is bench/gpu/mfu.sh's. Everything goes to the output dir, in 8
# files: steps.log (the environment, each step's exit
# status and time), compile_*.log, train.log, train_metrics.jsonl, decode_file.log and
# .jsonl, constraints.log. The same plumbing on a CPU: NO_WHEELS=1 PY=.venv/bin/python \
#   CONFIG=tiny LINES=1000 BATCHES=8 EVAL_EVERY=20 bash bench/gpu/pace.sh DIR 75
set -u
PY=${PY:-python3} CONFIG=${CONFIG:-base} LINES=${LINES:-100000} BATCHES=${BATCHES:-128}
EVAL_EVERY=${EVAL_EVERY:-300} CONSTRAINTS_S=${CONSTRAINTS_S:-0} DECODE_FLAGS=${DECODE_FLAGS:-}
[[ $# -ge 1 ]] || { sed -n 2,3p "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
out=$1; secs=${2:-180}; mkdir -p "$out"
rm -rf /tmp/w-pace /tmp/df /tmp/cons  # a rerun on a warm machine starts afresh too
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0)) s] $*" | tee -a "$out/steps.log"; }
if [[ -z "${NO_WHEELS:-}" ]]; then  # the CPU venv has them
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
if ! $PY -c "import attention_jax" 2>/dev/null; then  # this checkout, not installed
  $PY tools/package_links.py /tmp/site >/dev/null && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export ATTENTION_JAX_DING=$PWD/.data/de-en PYTHONUNBUFFERED=1
{ nvidia-smi -L; $PY -c 'import jax; print("jax", jax.__version__, jax.devices())'; } \
  >>"$out/steps.log" 2>&1
stamp "setup done"

ab="--configs=$CONFIG --beam_sizes=4 --batch_sizes=$BATCHES --src_len=32 --iters=1"
vmodule=gpu_compiler=1,nvptx_compiler=1,hlo_pass_pipeline=1  # XLA's phase and pass timers
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=$vmodule \
  timeout 90 $PY bench/decode.py $ab >/tmp/compile_default.log 2>&1
stamp "compile A (XLA's defaults) exit $?"
# Without the flag list each compile prints (MBs of it).
grep -v 'gpu_compiler.cc:678\]' /tmp/compile_default.log >"$out/compile_default.log"
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
  timeout 90 $PY bench/decode.py $ab >"$out/compile_autotune0.log" 2>&1
stamp "compile B (--xla_gpu_autotune_level=0) exit $?"

timeout -s TERM "$secs" $PY train.py --config=configs/$CONFIG.py --workdir=/tmp/w-pace \
  --config.dataset=ding --config.packing=True --config.batch_tokens=8192 \
  --config.eval_every_steps=$EVAL_EVERY --config.eval_max_examples=500 \
  --config.checkpoint_every_steps=100000 \
  --config.checkpoint_every_minutes=0 >"$out/train.log" 2>&1
stamp "train.py exit $?"
cp /tmp/w-pace/metrics.jsonl "$out/train_metrics.jsonl"

timeout 240 $PY bench/decode_file.py --workdir=/tmp/w-pace --split=train --lines=$LINES \
  --scratch=/tmp/df --jsonl="$out/decode_file.jsonl" -- $DECODE_FLAGS >"$out/decode_file.log" 2>&1
stamp "decode_file exit $?"
tail -n 4 /tmp/df/cold.out >>"$out/decode_file.log" 2>/dev/null

if [[ $CONSTRAINTS_S -gt 0 ]]; then
  timeout "$CONSTRAINTS_S" $PY bench/constraints.py --workdir=/tmp/w-pace \
    --scratch=/tmp/cons -- --constraint_tokens=16 >"$out/constraints.log" 2>&1
  stamp "constraints exit $?"
fi
