#!/usr/bin/env bash
# decode.py and train.py at the accelerator's pace, measured on one GPU in one call:
#   bash bench/gpu/pace.sh <output dir> [seconds of train.py, default 100]
# Run on the device machine with .whl/ (bench/gpu/fetch_wheels.sh) and .data/de-en (the
# Ding file) carried along; here, first: bash bench/gpu/fetch_wheels.sh; mkdir -p .data;
# cp /usr/share/trans/de-en .data/
#   1. the search's steps per stopping test, A/B: bench/decode.py, base (random
#      weights), beam 4, batch 128, --steps_per_check=1,8
#   2. the train step alone at train.py's shape: bench/train.py, base, packed rows,
#      8192-token batches (the device-only step rate)
#   3. train.py on Ding, base, packed 8192-token batches, for the seconds given
#      (stopped by SIGTERM, which checkpoints): steps/s and the host's ms per step by
#      part (metrics.jsonl host_*_ms), and an evaluation of 500 dev sentences every
#      EVAL_EVERY steps (metrics.jsonl eval_seconds: the first compiles the search's
#      programs, the later ones must not)
#   4. decode.py end to end on 100,000 lines (Ding's training sources, cycled) with
#      that model, beam 4: an empty compilation cache, then the one it filled
#      (bench/decode_file.py: start-up, programs, host phases, device busy/idle)
# Everything goes to the output dir: logs, *.jsonl, the train metrics. A rehearsal on
# a CPU: NO_WHEELS=1 PY=.venv/bin/python CONFIG=tiny LINES=2000 BATCHES=8 EVAL_EVERY=100 \
#   bash bench/gpu/pace.sh DIR 60
set -u
PY=${PY:-python3} CONFIG=${CONFIG:-base} LINES=${LINES:-100000} BATCHES=${BATCHES:-128}
EVAL_EVERY=${EVAL_EVERY:-1500}
[[ $# -ge 1 ]] || { sed -n 2,2p "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
out=$1; secs=${2:-100}; mkdir -p "$out"
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0)) s] $*" | tee -a "$out/steps.log"; }
if [[ -z "${NO_WHEELS:-}" ]]; then  # the rehearsal's venv has them
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export ATTENTION_JAX_DING=$PWD/.data/de-en PYTHONUNBUFFERED=1
{ nvidia-smi -L; $PY -c 'import jax; print("jax", jax.__version__, jax.devices())'; } \
  >"$out/env.txt" 2>&1
stamp "setup done"

timeout 150 $PY bench/decode.py --configs=$CONFIG --beam_sizes=4 --batch_sizes=$BATCHES \
  --src_len=32 --iters=3 --steps_per_check=1,8 >"$out/decode_ab.log" 2>&1
stamp "decode A/B exit $?"

timeout 120 $PY bench/train.py --configs=$CONFIG --packing=packed --batch_tokens=8192 \
  --max_length=256 --steps=30 >"$out/train_step.log" 2>&1
stamp "train step alone exit $?"

timeout -s TERM "$secs" $PY train.py --config=configs/$CONFIG.py --workdir=/tmp/w-pace \
  --config.dataset=ding --config.packing=True --config.batch_tokens=8192 \
  --config.eval_every_steps=$EVAL_EVERY --config.eval_max_examples=500 \
  --config.checkpoint_every_steps=100000 \
  --config.checkpoint_every_minutes=0 >"$out/train.log" 2>&1
stamp "train.py exit $?"
cp /tmp/w-pace/metrics.jsonl "$out/train_metrics.jsonl"

timeout 260 $PY bench/decode_file.py --workdir=/tmp/w-pace --split=train --lines=$LINES \
  --scratch=/tmp/df --jsonl="$out/decode_file.jsonl" >"$out/decode_file.log" 2>&1
stamp "decode_file exit $?"
tail -n 4 /tmp/df/cold.out >"$out/decode_tail.txt" 2>/dev/null
