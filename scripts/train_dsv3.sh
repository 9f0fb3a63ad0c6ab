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
#   CKPT_DIR    torch_dist checkpoints, on storage every node sees (default /checkpoints/dsv3-671b-grpo)
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
# Rollout: colocated on the same 128 GPUs, vLLM engines of tensor_parallel_size 16 (two nodes per
# engine, 8 engines), asleep while the actor trains. Weights alone are 1.34 TB in bf16, more than
# 16 × 80 GB: the engines need FP8 weights (0.67 TB), which mrl's rollout config cannot ask vLLM for
# yet (docs/dsv3.md, "Open gaps"). The actor loads bf16 only: mrl's HF import refuses FP8 block-scaled
# files (their weight_scale_inv tensors); convert DeepSeek's FP8 release to bf16 first.
# FP8 training: only with Transformer Engine installed (pip install -e '.[gpu]'), which
# model.transformer_impl=auto then uses for its fused layers; mrl has no switch for FP8 GEMMs yet, so
# this run trains in bf16 with or without Transformer Engine.
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
CKPT_DIR=${CKPT_DIR:-/checkpoints/dsv3-671b-grpo}
RECIPE="$(cd "$(dirname "$0")/.." && pwd)/configs/dsv3_671b_grpo.yaml"

exec mrl train "$RECIPE" \
  launch.address="$address" \
  model.path="$MODEL_PATH" \
  data.path="$DATA_PATH" \
  checkpoint.dir="$CKPT_DIR" \
  ${args[@]+"${args[@]}"}
