"""Check `mrl plan`'s activation estimate against the activation memory of real CPU training steps.

Tiny zoo models (bf16, Megatron's local spec as mrl builds it) run one policy-gradient step
(mrl.megatron.policy's DAPO loss through Megatron's pipeline schedule, DDP and Adam) in several
layouts (CASES) on local gloo processes. Activation memory is what autograd saves for backward,
counted by mrl.megatron.footprint's SavedTensorMeter (`measure`); the plan's estimate
(mrl.plan.activations) for the same rank, micro-batch and attention kernel is printed beside it.
With EP the table compares the mean over a stage's expert-parallel ranks (the plan assumes
balanced routing) and shows the per-rank spread. Method and results: docs/benchmarks.md,
"Activation memory"; with --recompute and --cp: docs/plan.md.

    .venv/bin/python benchmarks/plan_activations.py [--seq 256] [--micro-batch 2] [--recompute | --cp]
        [--only llama] [--layout "CP2"]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from mrl.config.schema import Recompute
from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local

# (tiny-zoo model, layout name, layout, micro-batches per step): two processes each.
CASES = [
    ("llama", "TP1·DP2", ParallelLayout(), 1),
    ("llama", "TP2", ParallelLayout(tp=2), 1),
    ("llama", "PP2 (4 micro-batches)", ParallelLayout(pp=2), 4),
    ("llama", "PP2·VPP2 (4 micro-batches)", ParallelLayout(pp=2, vpp=2), 4),
    ("qwen3", "TP2", ParallelLayout(tp=2), 1),
    ("qwen3_moe", "TP1·DP2", ParallelLayout(), 1),
    ("qwen3_moe", "EP2", ParallelLayout(ep=2), 1),
    ("qwen3_moe", "TP2 (ETP2)", ParallelLayout(tp=2), 1),
    ("deepseek_v3", "TP1·DP2", ParallelLayout(), 1),
    ("deepseek_v3", "TP2·ETP1·EP2", ParallelLayout(tp=2, ep=2, etp=1), 1),
    ("deepseek_v3", "PP2 (4 micro-batches)", ParallelLayout(pp=2), 4),
]

# --cp: context parallelism (each rank holds s/CP of every sequence; attention all-gathers K and V).
# Two processes each, four for TP2·CP2, whose grid needs them.
CP_CASES = [
    ("llama", "CP2", ParallelLayout(cp=2), 1),
    ("llama", "TP2·CP2", ParallelLayout(tp=2, cp=2), 1),
    ("qwen3_moe", "CP2", ParallelLayout(cp=2), 1),
    ("deepseek_v3", "CP2", ParallelLayout(cp=2), 1),
    ("deepseek_v3", "TP2·CP2", ParallelLayout(tp=2, cp=2), 1),
    ("deepseek_v3", "CP2·EP2·ETP1", ParallelLayout(cp=2, ep=2, etp=1), 1),
]

FULL, CORE = Recompute("full", num_layers=1), Recompute("selective")
# --recompute (model.recompute full and selective): the same measurement, the plan with the same setting.
# (tiny-zoo model, layout name, layout, micro-batches per step, recompute)
RECOMPUTE_CASES = [
    ("llama", "TP1·DP2, full", ParallelLayout(), 1, FULL),
    ("llama", "TP1·DP2, full, blocks of 2", ParallelLayout(), 1, Recompute("full", num_layers=2)),
    ("llama", "TP1·DP2, selective core_attn", ParallelLayout(), 1, CORE),
    ("llama", "TP2, selective core_attn + mlp", ParallelLayout(tp=2), 1, Recompute("selective", ("core_attn", "mlp"))),
    ("llama", "PP2 (4 micro-batches), full", ParallelLayout(pp=2), 4, FULL),
    ("qwen3_moe", "EP2, selective moe", ParallelLayout(ep=2), 1, Recompute("selective", ("moe",))),
    ("deepseek_v3", "TP1·DP2, full", ParallelLayout(), 1, FULL),
    ("deepseek_v3", "TP1·DP2, selective core_attn", ParallelLayout(), 1, CORE),
    ("deepseek_v3", "TP2·ETP1·EP2, selective core_attn + shared_experts", ParallelLayout(tp=2, ep=2, etp=1), 1,
     Recompute("selective", ("core_attn", "shared_experts"))),
    ("llama", "CP2, selective core_attn", ParallelLayout(cp=2), 1, CORE),
]


def measure(rank: int, world: int, hf_dir: str, layout: ParallelLayout, seq: int, size: int, micro: int,
            recompute: Recompute = Recompute()) -> dict:
    """Peak saved-for-backward bytes of one forward-backward pass over the step's micro-batches on
    this rank (mrl.megatron.footprint.activation_peak), and the rank's pipeline stage. The
    SavedTensorMeter counts every saved storage once, excluding parameters, and records the peak held
    at once, so a pipeline's in-flight micro-batches add up as they do on a GPU."""
    from mrl.megatron.footprint import activation_peak
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import data_parallel_size, destroy_layout, initialize_layout
    from mrl.megatron.policy import data_parallel_rows, micro_batches, policy_loss_fn
    from mrl.models.registry import model_spec_from_hf

    torch.manual_seed(0)
    coords = initialize_layout(layout)
    spec = model_spec_from_hf(hf_dir)
    built = build_model(spec, layout, params_dtype=torch.bfloat16, transformer_impl="local",
                        recompute=recompute)
    # As mrl.megatron.training.make_trainable on CPU (gloo mismatches batched p2p under VPP).
    built.chunks[0].config.batch_p2p_comm = False
    rows = size * micro * data_parallel_size()
    generator = torch.Generator().manual_seed(1)
    batch = {"tokens": torch.randint(3, spec.vocab_size, (rows, seq + 1), generator=generator),
             "response_mask": torch.ones(rows, seq), "advantages": torch.randn(rows, seq, generator=generator),
             "old_logprobs": torch.full((rows, seq), -5.0)}
    micro_list = micro_batches(data_parallel_rows(batch, coords.dp, data_parallel_size()), layout.sequence_multiple,
                               size)
    assert len(micro_list) == micro, (len(micro_list), micro)
    loss = policy_loss_fn(dict(policy_loss="dapo", clip_high=0.28), spec.vocab_size)
    peak = activation_peak(built, micro_list, loss)
    destroy_layout()
    return {"peak": peak, "stage": coords.pp}


def planned(spec, layout: ParallelLayout, stage: int, seq: int, size: int, micro: int,
            recompute: Recompute = Recompute()) -> int:
    from mrl.plan.activations import MicroBatch, cpu_attention, stage_activations
    from mrl.plan.shapes import ModelShape, stage_chunks

    shape = ModelShape.of(spec)
    chunks = stage_chunks(shape.layers, layout, stage)
    return stage_activations(shape, layout, chunks, MicroBatch(seq, size), 2, micro, cpu_attention(shape),
                             recompute=recompute).saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence (a multiple of 2)")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--only", nargs="*", default=None, help="run only these tiny-zoo models")
    parser.add_argument("--recompute", action="store_true", help="run the recompute cases")
    parser.add_argument("--cp", action="store_true", help="run the context-parallel cases")
    parser.add_argument("--layout", nargs="*", default=None, help="run only the cases with these layout names")
    args = parser.parse_args()
    from mrl.models.registry import model_spec_from_hf
    from mrl.models.tiny import write_tiny_model
    from mrl.plan.activations import cpu_attention
    from mrl.plan.shapes import ModelShape

    print(f"seq {args.seq}, micro-batch {args.micro_batch}, bf16, 2 processes (4 where the layout needs them)\n")
    print("| model | layout | stage | attention | measured (mean over EP ranks) | per-rank range | plan | plan / measured |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        plain = CP_CASES if args.cp else CASES
        cases = RECOMPUTE_CASES if args.recompute else [(*case, Recompute()) for case in plain]
        for arch, name, layout, micro, recompute in cases:
            if (args.only and arch not in args.only) or (args.layout and name not in args.layout):
                continue
            hf_dir = Path(tmp) / arch
            if not hf_dir.exists():
                write_tiny_model(arch, hf_dir)
            spec = model_spec_from_hf(hf_dir)
            world = max(2, layout.min_world_size())  # TP2·CP2 needs four ranks
            results = run_local(measure, world, str(hf_dir), layout, args.seq, args.micro_batch, micro, recompute,
                                timeout_s=900)
            for stage in sorted({r["stage"] for r in results}):
                peaks = [r["peak"] for r in results if r["stage"] == stage]
                mean, plan = statistics.mean(peaks), planned(spec, layout, stage, args.seq, args.micro_batch, micro, recompute)
                spread = f"{min(peaks) / 1e6:.2f}–{max(peaks) / 1e6:.2f} MB" if len(set(peaks)) > 1 else "–"
                print(f"| {arch} | {name} | {stage} | {cpu_attention(ModelShape.of(spec))} | {mean / 1e6:.2f} MB | {spread} | "
                      f"{plan / 1e6:.2f} MB | {plan / mean:.3f} |", flush=True)


if __name__ == "__main__":
    main()
