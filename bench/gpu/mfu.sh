#!/usr/bin/env bash
# The train step's MFU on one GPU, with A/Bs of cheaper passes, in one command:
#   bash bench/gpu/mfu.sh <output dir>
# On a machine without network access it installs .whl/ (bench/gpu/fetch_wheels.sh). Every
# run is bench/train.py on synthetic packed rows of 256 (the train step alone, batches
# on the device ahead), 20 steps timed in 3 passes, in processes of their own:
#   1. base, TOKENS-token batches (default 32768), as configured: threefry dropout
#      bits, float32 logits in the loss's chunks
#   2. the same with --prng_impl=unsafe_rbg (dropout bits from XLA's RngBitGenerator)
#   3. the same with --loss_logits_dtype=bfloat16 (the loss's chunks read half the bytes)
#   4. big, TOKENS-token batches, as configured
# One JSON object and a table per run in <output dir>/mfu_*.log, written as each run ends:
# a run stopped by a time limit (e.g. timeout 600 bash bench/gpu/mfu.sh out) still leaves
# the runs before it. On an H100 each base run takes 85-105 s (most of it compiling), so
# the four need about 7 minutes. The same plumbing on a CPU:
#   NO_WHEELS=1 PY=.venv/bin/python BASE=tiny BIG=tiny TOKENS=1024 bash bench/gpu/mfu.sh DIR
set -u
PY=${PY:-python3} BASE=${BASE:-base} BIG=${BIG:-big} TOKENS=${TOKENS:-32768}
[[ $# -ge 1 ]] || { sed -n 2,3p "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
out=$1; mkdir -p "$out"
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0)) s] $*" | tee -a "$out/steps.log"; }
if [[ -z "${NO_WHEELS:-}" ]]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
if ! $PY -c "import attention_jax" 2>/dev/null; then  # this checkout, not installed
  $PY tools/package_links.py /tmp/site >/dev/null && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
common="--packing=packed --max_length=256 --batch_tokens=$TOKENS --steps=20"
run() {  # name, then bench/train.py's flags
  local name=$1; shift
  timeout 150 $PY bench/train.py $common "$@" >"$out/mfu_$name.log" 2>&1
  stamp "$name exit $?"
}
run base --configs=$BASE
run base_rbg --configs=$BASE --prng_impl=unsafe_rbg
run base_bf16_logits --configs=$BASE --loss_logits_dtype=bfloat16
run big --configs=$BIG
