#!/usr/bin/env bash
# The weight sync's transport on a many-core host without Ray or vLLM (e.g. the lent GPU machine,
# its GPU hidden): the 0.93 GB Qwen3-MoE from two CPU ranks to null engines in plain processes,
# beside memcpy and gloo p2p measured in the same processes (benchmarks/weight_sync.py).
# Rows go to stdout and to $OUT/host_sync.jsonl. Carried wheels (megatron-core, psutil for Python 3.12) install from .gpu-wheels/ when present.
set -euo pipefail
if [ -d .gpu-wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu-wheels/*.whl
  export PYTHONPATH=/tmp/site:.
fi
nproc
CUDA_VISIBLE_DEVICES= python3 benchmarks/weight_sync.py --engine null-process --size-gb 1.0 \
  --workdir /tmp/mrl-host-sync "$@" | tee "${OUT:-.}/host_sync.jsonl"
