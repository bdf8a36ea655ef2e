#!/usr/bin/env bash
# Download, where PyPI is reachable, the wheels bench/gpu/suite.sh installs on a GPU
# machine without network access (Python 3.12, manylinux x86_64).
#
#   bench/gpu/fetch_wheels.sh [DIR] [--tfds]      # DIR defaults to .whl/ (git-ignored)
#
# A GPU machine set up with jax 0.11.2 on CUDA 13 that holds jax, flax, optax,
# orbax-checkpoint, numpy, absl-py, etils, cloudpickle, protobuf, psutil, PyYAML,
# packaging, sentencepiece, sacrebleu, matplotlib, tqdm and pytest lacks, of what our
# code imports at run time:
#   grain          data/pipeline.py (imported by training/ and bench/train.py)
#     array-record   imported by grain; portpicker, imported by grain
#   ml-collections configs/*.py, train.py
#   tensorboardX   training/metrics.py (optional there; small)
# Each wheel's other Requires-Dist entries are on such a machine (unzip -p X.whl
# '*/METADATA' | grep ^Requires-Dist). Versions are the ones our CPU venv runs.
# --tfds adds tensorflow-datasets and what it needs beyond those packages (only
# `tfds:` datasets import it, lazily; the suite does not).
set -euo pipefail

DIR=.whl TFDS=0
for arg in "$@"; do
  case "$arg" in
    --tfds) TFDS=1 ;;
    -h | --help) sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "unknown option $arg" >&2; exit 2 ;;
    *) DIR="$arg" ;;
  esac
done

WHEELS=(grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 ml-collections==1.1.0
  tensorboardX==2.6.5)
if [[ "$TFDS" == 1 ]]; then
  WHEELS+=(tensorflow-datasets==4.9.10 tensorflow-metadata==1.21.0 dm-tree==0.1.10
    immutabledict==4.3.1 simple-parsing==0.1.9 docstring-parser==0.18.0
    googleapis-common-protos==1.76.0 termcolor==3.3.0 toml==0.10.2)
fi

PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
  manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done

mkdir -p "$DIR"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${PLATFORMS[@]}" -d "$DIR" "${WHEELS[@]}"
if [[ "$TFDS" == 1 ]]; then
  # promise publishes only a source archive; its wheel is pure Python, so build it here.
  python3 -m pip wheel -q --no-deps -w "$DIR" promise==2.3
fi

echo "wheels in $DIR:"
ls -l "$DIR"/*.whl
du -ch "$DIR"/*.whl | tail -n 1
