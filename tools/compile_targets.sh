#!/usr/bin/env bash
# train.py --compile_for over the README's targets, one compile at a time: the JSON
# reports, one a line, into OUT (default docs/aot/compile-<date>-<commit>.jsonl).
# Needs the side venv with both compilers: make aot-venv. About an hour on 2 cores.
#   tools/compile_targets.sh [OUT] [CONFIG...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv-aot/bin/python}
OUT=${1:-docs/aot/compile-$(date +%Y%m%d)-$(git rev-parse --short HEAD).jsonl}
shift || true
CONFIGS=${*:-base big}
mkdir -p "$(dirname "$OUT")"
run() {  # config target [overrides...]
  local config=$1 target=$2; shift 2
  echo "== $config on $target $*" >&2
  "$PY" train.py --config="configs/$config.py" --compile_for="$target" "$@" >>"$OUT" \
    || echo "   (exit $?: see the error above)" >&2
}
for c in $CONFIGS; do
  for t in tpu:v5e-8 tpu:v5p-8 tpu:v6e-8 gpu:h100 gpu:h100x8; do run "$c" "$t"; done
  # Pod size, FSDP over every chip (one 256-token row per chip), and the same mesh on
  # v5e-8 for the 1/N comparison of parameter + optimizer bytes per chip.
  for t in tpu:v5e-8 tpu:v5e-256; do
    run "$c" "$t" --config.mesh_data=1 --config.mesh_fsdp=-1 --config.batch_tokens=65536
  done
done
echo "wrote $OUT" >&2
