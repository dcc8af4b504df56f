#!/usr/bin/env bash
# The CUDA checks for a lent GPU machine, in one go. Two halves, because that machine reaches no package index:
#   bash scripts/gpu_check.sh wheels   # here: download this venv's transformers and what it needs into .gpu/
#   bash scripts/gpu_check.sh run      # there (carry .gpu): the CUDA tests, pass costs by width, the engine's serving
# STEPS (default "tests widths serving") picks which of the three run.
# The machine's image has its own torch (CUDA) and an older transformers; the carried wheels go into /tmp/site, in
# front of it. Logs and results go to $OUT (the device tool's folder), else to .gpu/out.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
wheels)
  mkdir -p .gpu
  pip=".venv/bin/pip"
  version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
  # transformers 5.25 needs huggingface_hub 2.x, which needs httpx2 and the rest, newer than the image's
  for name in transformers huggingface_hub httpx2 httpcore2 click truststore idna anyio; do
    "$pip" download -q --no-deps -d .gpu "$name==$(version "$name")"
  done
  for name in hf_xet kernels; do  # binary wheels, for the machine's Python 3.12
    "$pip" download -q --no-deps --python-version 3.12 --only-binary=:all: -d .gpu "$name==$(version "$name")"
  done
  ls -la .gpu
  ;;
run)
  export PYTHONUNBUFFERED=1
  out="${OUT:-.gpu/out}"
  mkdir -p "$out"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -m pip install -q --no-deps --no-index --target /tmp/site .gpu/*.whl
  export PYTHONPATH="/tmp/site:$PWD/src:$PWD"
  python3 -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"
  steps=" ${STEPS:-tests widths serving} "
  if [[ $steps == *" tests "* ]]; then
    timeout "${TEST_TIMEOUT:-150}" python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider -rA 2>&1 |
      tee "$out/test_cuda.log" | tail -25
  fi
  if [[ $steps == *" widths "* ]]; then
    timeout "${WIDTHS_TIMEOUT:-150}" python3 benchmarks/gpu_pass_width.py --out "$out/pass_width.json" 2>&1 |
      tee "$out/pass_width.log" | tail -12
  fi
  if [[ $steps == *" serving "* ]]; then  # shrunk to fit a short lease; the full run is in docs/gpu/README.md
    timeout "${SERVING_TIMEOUT:-200}" python3 benchmarks/gpu_serving.py ${SERVING_ARGS:---size 1b --context 32768 \
      --new-tokens 128 --budget 3GiB} --out "$out/serving" 2>&1 | tee "$out/serving.log" | tail -12
  fi
  ;;
*)
  echo "usage: bash scripts/gpu_check.sh wheels|run" >&2
  exit 2
  ;;
esac
