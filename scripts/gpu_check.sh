#!/usr/bin/env bash
# The CUDA checks for a lent GPU machine, planned to fit its 15 minutes in two calls to one warm machine. That machine
# reaches no package index, and one call carries at most 64 MiB of ignored files, so what it needs is made here:
#   bash scripts/gpu_check.sh wheels    # here: this venv's transformers and what it needs, the gguf reader, the
#                                       # embedded model's GGUF split in two parts, and the real run's prompt ids
#   bash scripts/gpu_check.sh run       # there: STEPS picks what runs (see docs/gpu/README.md for the two calls)
#   bash scripts/gpu_check.sh dry-run   # here: every step of `run` on the CPU, tiny, in about a minute
# Steps (STEPS, default "tests kernels offload"; the second call: "real serving"):
#   tests    the CUDA tests (lossless against stock generate, pinned and staged)
#   kernels  the verify pass's attention, kernel by kernel (benchmarks/gpu_verify_kernels.py)
#   offload  VeriCache against the full KV in HBM at 1B and 8B, 32k and 128k, batch 1 and 8, with acceptance replayed
#            from the embedded model's recorded rounds (benchmarks/gpu_offload.py --replay)
#   real     the embedded model itself, joined from its two parts: real acceptance (benchmarks/gpu_real_acceptance.py)
#   serving  the engine against transformers' continuous batching at equal device memory (benchmarks/gpu_serving.py)
# The machine's image has its own torch (CUDA) and an older transformers; the carried wheels go into /tmp/site, in
# front of it. Logs and results go to $OUT (the device tool's folder), else to .gpu/out.
set -uo pipefail
cd "$(dirname "$0")/.."
TRACE=docs/benchmarks/acceptance-traces/code-8k-b4-k16.json
case "${1:-}" in
wheels)
  mkdir -p .gpu/wheels .gpu/model-a .gpu/model-b
  pip=".venv/bin/pip"
  version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
  # transformers 5.25 needs huggingface_hub 2.x, which needs httpx2 and the rest, newer than the image's
  for name in transformers huggingface_hub httpx2 httpcore2 click truststore idna anyio gguf; do
    "$pip" download -q --no-deps -d .gpu/wheels "$name==$(version "$name")"
  done
  for name in hf_xet kernels; do  # binary wheels, for the machine's Python 3.12
    "$pip" download -q --no-deps --python-version 3.12 --only-binary=:all: -d .gpu/wheels "$name==$(version "$name")"
  done
  # the GGUF (98 MB) in two halves, one per call: the warm machine keeps the first while the second travels
  gguf=$(.venv/bin/python -c "from vericache_tools.embedded import embedded_gguf_path as p; print(p())")
  half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
  head -c "$half" "$gguf" >.gpu/model-a/part-0
  tail -c +"$((half + 1))" "$gguf" >.gpu/model-b/part-1
  basename "$gguf" >.gpu/model-b/name
  .venv/bin/python benchmarks/gpu_real_acceptance.py --save-prompts .gpu/model-b/prompts.pt --context 8192 --batch 4
  du -sh .gpu/*
  ;;
run)
  export PYTHONUNBUFFERED=1
  out="${OUT:-.gpu/out}"
  mkdir -p "$out"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -m pip install -q --no-deps --no-index --target /tmp/site .gpu/wheels/*.whl
  export PYTHONPATH="/tmp/site:$PWD/src:$PWD"
  python3 -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"
  py=python3
  steps=" ${STEPS:-tests kernels offload} "
  ;;
dry-run)
  out="${OUT:-.gpu/dry-run}"
  mkdir -p "$out"
  py=.venv/bin/python
  steps=" ${STEPS:-tests kernels offload real serving} "
  ;;
*)
  echo "usage: bash scripts/gpu_check.sh wheels|run|dry-run" >&2
  exit 2
  ;;
esac
[[ $1 == wheels ]] && exit 0
dry=$([[ $1 == dry-run ]] && echo --dry-run)
status=0
step() {  # name, seconds, command...: run one step under its time limit, its log in $out
  local name=$1 seconds=$2
  shift 2
  echo "== $name"
  timeout "$seconds" "$@" 2>&1 | tee "$out/$name.log" | tail -15
  local code=${PIPESTATUS[0]}
  [[ $code == 0 ]] || { echo "== $name ended with $code"; status=1; }
}
if [[ $steps == *" tests "* ]]; then
  if [[ -n $dry ]]; then  # no CUDA here: the tests skip; collecting them checks they import
    step tests 120 $py -m pytest tests/test_cuda.py -n 0 -q -p no:cacheprovider
  else
    step tests "${TEST_TIMEOUT:-90}" $py -m pytest tests/test_cuda.py -n 0 -q -p no:cacheprovider -rA
  fi
fi
if [[ $steps == *" kernels "* ]]; then
  step kernels "${KERNELS_TIMEOUT:-120}" $py benchmarks/gpu_verify_kernels.py $dry --budget-s 70 \
    --out "$out/verify_kernels.json"
fi
if [[ $steps == *" offload "* ]]; then
  # 8B at 32k and batch 8 first: the cell the targets name, before the time budget runs out
  grid=$([[ -z $dry ]] && echo "--sizes 8b,1b --contexts 32768,131072 --batches 8,1")
  step offload "${OFFLOAD_TIMEOUT:-210}" $py benchmarks/gpu_offload.py $dry --replay "$TRACE" --no-offloaded \
    --budget-s 170 ${OFFLOAD_ARGS:-$grid} --json "$out/offload.json"
fi
if [[ $steps == *" real "* ]]; then
  if [[ -n $dry ]]; then
    step real 120 $py benchmarks/gpu_real_acceptance.py --dry-run --out "$out/real.json"
  else
    mkdir -p /tmp/model
    cat .gpu/model-a/part-0 .gpu/model-b/part-1 >"/tmp/model/$(cat .gpu/model-b/name)"
    step real "${REAL_TIMEOUT:-120}" $py benchmarks/gpu_real_acceptance.py \
      --gguf "/tmp/model/$(cat .gpu/model-b/name)" --prompts .gpu/model-b/prompts.pt --out "$out/real.json"
  fi
fi
if [[ $steps == *" serving "* ]]; then
  step serving "${SERVING_TIMEOUT:-240}" $py benchmarks/gpu_serving.py $dry ${SERVING_ARGS:---size 8b --context 32768 \
    --new-tokens 128 --budget 16GiB} --out "$out/serving"
fi
exit $status
