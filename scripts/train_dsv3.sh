#!/usr/bin/env bash
# GRPO on DeepSeek-V3 671B (configs/dsv3_671b_grpo.yaml) on an existing Ray cluster of
# 16 nodes × 8 GPUs (H100/H800 80 GB). This script only checks its inputs and runs `mrl train`;
# everything else is in the recipe. See docs/dsv3.md for the memory arithmetic.
#
#   RAY_ADDRESS=head-node:6379 scripts/train_dsv3.sh [dotted.key=value ...]
#   scripts/train_dsv3.sh --address head-node:6379 [dotted.key=value ...]
#
#   MODEL_PATH  HF checkpoint directory, bf16 weights (default /models/DeepSeek-V3)
#   DATA_PATH   prompts, .jsonl or .parquet (default /data/dapo-math-17k.jsonl)
#   RUN_DIR     the run's output dir (checkpoints, metrics, HF export), on storage every node sees
#               (default /checkpoints/dsv3-671b-grpo); a rerun with the same RUN_DIR resumes it
#   RECIPE      the recipe (default configs/dsv3_671b_grpo.yaml; configs/dsv3_replica_cpu.yaml is its
#               miniature for a simulated 2-node cluster on one CPU machine)
#
# Layout of the actor: 128 GPUs = TP8 × PP4 × DP4 for attention and dense parts, and
# EP32 × ETP1 × PP4 for the routed experts (world rank r = 8·node + local GPU):
#   - pipeline stage = r // 32, i.e. nodes 0-3 | 4-7 | 8-11 | 12-15; layers 16 + 16 + 16 + 13
#     (stage 0 adds the embedding, stage 3 the output layer: hence 13 layers there).
#   - tensor parallel group = the 8 GPUs of one node (r % 8 = TP rank): attention, the three dense
#     MLPs, the shared expert and the vocabulary are split 8 ways over NVLink.
#   - data parallel: the 4 nodes of a stage hold 4 replicas of the attention/dense weights.
#   - expert parallel: the 32 GPUs of a stage each hold 8 of the 256 routed experts of each of the
#     stage's MoE layers (EP rank = r % 32); experts are not replicated (expert-DP 1).
# Rollout: colocated on the same 128 GPUs, 4 vLLM engines of tensor_parallel_size 32 (four nodes per
# engine, vLLM's multi-node mode; each worker takes its weights over sync.transport routed) with bf16
# weights (44 GB per GPU; at TP16 they would be 85.9 GB, over the 56 GB budget, and FP8 rollout
# weights, which would allow TP16, are not built: docs/dsv3.md). The engines sleep while the actor
# trains; while they generate, the actor's weights, gradient buffers and KL reference wait in host
# memory (trainer.offload_actor_during_rollout), and the optimizer lives there throughout
# (optim.offload_fraction 1.0): about 1 TB of host memory per node. Full recomputation keeps the
# update at 39-47 GB per GPU. `mrl plan configs/dsv3_671b_grpo.yaml model.path=...` says this fits 80
# GB GPUs (docs/dsv3.md has its table); none of it has run on GPUs yet.
# The actor loads bf16 weights (DeepSeek's FP8 release: `mrl convert fp8-to-hf` writes its bf16 twin).
# FP8 training GEMMs: model.fp8=blockwise (or delayed, tensorwise, mxfp8) with Transformer Engine
# installed (pip install -e '.[gpu]'); off here: the recipe trains in bf16, and mrl plan does not model
# FP8 training.
set -euo pipefail

address=${RAY_ADDRESS:-}
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --address) [ $# -ge 2 ] || { echo "train_dsv3.sh: --address needs a value (head-node:6379)" >&2; exit 2; }
               address=$2; shift 2 ;;
    --address=*) address=${1#--address=}; shift ;;
    *) args+=("$1"); shift ;;
  esac
done

if [ -z "$address" ]; then
  echo "train_dsv3.sh: no Ray cluster address. This recipe runs on an existing 16-node cluster and never" \
       "starts one: set RAY_ADDRESS=<head-node>:6379 or pass --address <head-node>:6379." >&2
  exit 2
fi
if ! command -v mrl >/dev/null 2>&1; then
  echo "train_dsv3.sh: the mrl command is not on PATH: activate the environment with mrl installed (pip install -e .)." >&2
  exit 2
fi

MODEL_PATH=${MODEL_PATH:-/models/DeepSeek-V3}
DATA_PATH=${DATA_PATH:-/data/dapo-math-17k.jsonl}
RUN_DIR=${RUN_DIR:-/checkpoints/dsv3-671b-grpo}
RECIPE=${RECIPE:-"$(cd "$(dirname "$0")/.." && pwd)/configs/dsv3_671b_grpo.yaml"}

exec mrl train "$RECIPE" \
  launch.address="$address" \
  model.path="$MODEL_PATH" \
  data.path="$DATA_PATH" \
  trainer.output_dir="$RUN_DIR" \
  ${args[@]+"${args[@]}"}
