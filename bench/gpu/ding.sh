#!/usr/bin/env bash
# A config trained on Ding for a fixed time on one GPU, then dev and test BLEU/chrF
# (beam 4). Needs .data/de-en (the Ding file) and, on a machine without network
# access, .whl/ (bench/gpu/fetch_wheels.sh):
#   [CONFIG=configs/ding.py] bash bench/gpu/ding.sh <seconds of training> <output dir> \
#     [--config.X=Y ...]
# (CONFIG: the config file, default configs/base.py; the flags after the output dir go
# to train.py after the ones below, so they win)
# Before: bash bench/gpu/fetch_wheels.sh where PyPI is reachable, and mkdir -p .data &&
# cp /usr/share/trans/de-en .data/ where Debian's trans-de-en is installed; copy both
# folders with the checkout. E.g. `bash bench/gpu/ding.sh 390 out` takes about 8 min on
# one H100 (its results go to bench/results/). Draw the curve:
#   python tools/learning_curve.py --metrics=out/metrics.jsonl --output=curve.png
set -u
[[ $# -ge 2 ]] || { sed -n 5,7p "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
secs=$1; out=$2; shift 2; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
python3 tools/package_links.py /tmp/site  # attention_jax: this checkout, not installed
export PYTHONPATH=/tmp/site ATTENTION_JAX_DING=$PWD/.data/de-en PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'; } >"$out/env.txt" 2>&1
# Packed rows: one compiled step (bucketed rows would compile one per length bucket).
timeout -s TERM "$secs" python3 train.py --config="${CONFIG:-configs/base.py}" --workdir=/tmp/w \
  --config.dataset=ding --config.packing=True --config.batch_tokens=8192 \
  --config.eval_every_steps=1000 --config.eval_max_examples=500 \
  --config.checkpoint_every_steps=5000 --config.checkpoint_every_minutes=0 "$@" \
  >"$out/train.log" 2>&1
echo "train exit $?" >>"$out/env.txt"
cp /tmp/w/metrics.jsonl "$out/"
for s in test dev; do
  timeout 75 python3 decode.py --workdir=/tmp/w --split="$s" --output="$out/$s.hyp" \
    >"$out/decode_$s.log" 2>&1
  echo "decode $s exit $?" >>"$out/env.txt"
done
