"""mrl plan's activation estimate against the activation memory of real CPU training steps.

Two gloo processes run Megatron's pipeline schedule over a DAPO loss (mrl.megatron.policy) for a
tiny DeepSeek-V3 in TP2·EP2·ETP1 (MLA, sequence parallelism, routed and shared experts) and a tiny
llama in PP2 with four micro-batches (1F1B: two in flight on the first stage). The peak of what
autograd holds for backward (mrl.megatron.footprint.activation_peak) must be within 5 % of the plan
for every rank; EP routing is unbalanced, so MoE ranks compare their mean (the plan assumes
balance). The same two with recomputation (selective core attention; full, one layer per block)
must be within 5 % too, and so must context parallelism (CP2: each rank holds half of every
sequence, attention gathers K and V over CP and keeps an [s/2, s] mask per layer) for the llama
(GQA, the fused kernel) and the DeepSeek-V3 (MLA, the math kernel). benchmarks/plan_activations.py
runs more layouts; docs/plan.md has its table.
"""

from __future__ import annotations

import torch

from mrl.config.schema import Recompute
from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local

SEQ, SIZE = 128, 2
NONE, FULL, CORE = Recompute(), Recompute("full"), Recompute("selective")
CASES = [("deepseek_v3", ParallelLayout(tp=2, ep=2, etp=1), 1, NONE), ("llama", ParallelLayout(pp=2), 4, NONE),
         ("deepseek_v3", ParallelLayout(tp=2, ep=2, etp=1), 1, CORE), ("llama", ParallelLayout(pp=2), 4, FULL),
         ("llama", ParallelLayout(cp=2), 1, NONE), ("deepseek_v3", ParallelLayout(cp=2), 1, NONE)]


def _peaks(rank: int, world: int, dirs: dict) -> list[dict]:
    from mrl.megatron.footprint import activation_peak
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import data_parallel_size, destroy_layout, initialize_layout
    from mrl.megatron.policy import data_parallel_rows, micro_batches, policy_loss_fn
    from mrl.models.registry import model_spec_from_hf

    results = []
    for arch, layout, count, recompute in CASES:
        coords = initialize_layout(layout)
        spec = model_spec_from_hf(dirs[arch])
        built = build_model(spec, layout, params_dtype=torch.bfloat16, transformer_impl="local",
                            recompute=recompute)
        built.chunks[0].config.batch_p2p_comm = False  # as make_trainable does on CPU
        rows = SIZE * count * data_parallel_size()
        g = torch.Generator().manual_seed(0)
        batch = {"tokens": torch.randint(3, spec.vocab_size, (rows, SEQ + 1), generator=g),
                 "response_mask": torch.ones(rows, SEQ), "advantages": torch.randn(rows, SEQ, generator=g),
                 "old_logprobs": torch.full((rows, SEQ), -5.0)}
        mine = data_parallel_rows(batch, coords.dp, data_parallel_size())
        micro = micro_batches(mine, layout.sequence_multiple, SIZE)
        loss = policy_loss_fn(dict(policy_loss="dapo"), spec.vocab_size)
        results.append(dict(stage=coords.pp, peak=activation_peak(built, micro, loss)))
        destroy_layout()
    return results


def test_activation_estimate_matches_measured_peak(tiny_model_dir):
    from mrl.models.registry import model_spec_from_hf
    from mrl.plan.activations import MicroBatch, cpu_attention, stage_activations
    from mrl.plan.shapes import ModelShape, stage_chunks

    dirs = {arch: str(tiny_model_dir(arch)) for arch, _, _, _ in CASES}
    per_rank = run_local(_peaks, 2, dirs, timeout_s=300)
    for index, (arch, layout, count, recompute) in enumerate(CASES):
        shape = ModelShape.of(model_spec_from_hf(dirs[arch]))
        for stage in range(layout.pp):
            measured = [r[index]["peak"] for r in per_rank if r[index]["stage"] == stage]
            chunks = stage_chunks(shape.layers, layout, stage)
            plan = stage_activations(shape, layout, chunks, MicroBatch(SEQ, SIZE), 2, count, cpu_attention(shape),
                                    recompute=recompute).saved
            mean = sum(measured) / len(measured)
            assert abs(plan / mean - 1) < 0.05, f"{arch} {layout.describe()} {recompute} stage {stage}: plan {plan}, measured {measured}"
