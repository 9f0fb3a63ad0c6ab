"""HF → Megatron → HF for every architecture and layout: logits parity and bitwise export.

One 4-process gloo world per architecture runs all its layouts in turn (Megatron's process groups
are rebuilt for each), so the suite pays the process start-up once per architecture. Layouts that
need fewer than 4 ranks run with data parallelism filling the rest, which also checks that only
one data-parallel replica exports.
"""

from __future__ import annotations

import pytest
import torch

from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local
from mrl.bridge.verify import probe_tokens, reference_logits

WORLD = 4
DENSE_LAYOUTS = {
    "TP1": ParallelLayout(),
    "TP2": ParallelLayout(tp=2),
    "PP2": ParallelLayout(pp=2),
    "TP2xPP2": ParallelLayout(tp=2, pp=2),
}
MOE_LAYOUTS = DENSE_LAYOUTS | {
    "EP2": ParallelLayout(ep=2),
    "EP2xTP2": ParallelLayout(ep=2, tp=2),
    "ETP2": ParallelLayout(etp=2),
}
# Tiny-zoo variants (mrl/models/tiny.py TINY_VARIANTS) test one semantic each, not the layouts:
# TP2xPP2 (every rank a quarter of the weights) and EP2xTP2 (experts split, sequence parallel).
VARIANT_LAYOUTS = {"TP2xPP2": ParallelLayout(tp=2, pp=2), "EP2xTP2": ParallelLayout(ep=2, tp=2)}
CASES = {
    "llama": DENSE_LAYOUTS | {"PP2xVPP2": ParallelLayout(pp=2, vpp=2)},
    "qwen2": DENSE_LAYOUTS,  # 1 KV head: TP2 splits fewer KV heads than ranks
    "qwen3": DENSE_LAYOUTS,
    "qwen3_moe": MOE_LAYOUTS,
    "deepseek_v3": MOE_LAYOUTS,
    "deepseek_v3_groups": VARIANT_LAYOUTS,  # group-limited routing with topk/topk_group = 3/2
    "qwen3_moe_unnormed": VARIANT_LAYOUTS,  # norm_topk_prob=false
    "qwen3_moe_dense": VARIANT_LAYOUTS,  # mlp_only_layers=[0]: a dense MLP beside MoE layers
}

# `make test` keeps, per architecture, the layouts that split every weight at once (TP2xPP2: each
# rank a quarter), experts (EP2xTP2, ETP2) and virtual stages (PP2xVPP2); `make test-matrix` adds
# each split alone (TP1, TP2, PP2, EP2).
KEPT = {"TP2xPP2", "EP2xTP2", "ETP2", "PP2xVPP2"}
PARAMS = [pytest.param(arch, kept, marks=() if kept else pytest.mark.matrix, id=f"{arch}-{'kept' if kept else 'swept'}")
          for arch, layouts in CASES.items() for kept in (True, False)
          if any((name in KEPT) == kept for name in layouts)]


def _run_layouts(rank: int, world_size: int, hf_dir: str, layouts: dict[str, ParallelLayout]) -> dict:
    from mrl.bridge.export import iter_hf_weights
    from mrl.bridge.hf_checkpoint import HFCheckpoint
    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.forward import forward_logits
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import destroy_layout, initialize_layout
    from mrl.models.registry import model_spec_from_hf

    spec = model_spec_from_hf(hf_dir)
    results = {}
    for name, layout in layouts.items():
        coords = initialize_layout(layout)
        built = build_model(spec, layout)
        bytes_read = load_hf_weights(built, coords, hf_dir)
        logits = forward_logits(built, probe_tokens(spec.vocab_size))
        # many buckets, and a source's share of a bucket in many messages
        exported = dict(iter_hf_weights(built, coords, bucket_bytes=256 * 1024, message_bytes=16 * 1024))
        result = {"bytes_read": bytes_read}
        if logits is not None and coords.tp == 0 and coords.dp == 0:
            result["logits"] = logits
        if rank == 0:
            ckpt = HFCheckpoint(hf_dir)
            result["exported"] = sorted(exported)
            result["mismatches"] = [n for n, t in exported.items() if not torch.equal(t, ckpt.read(n))]
            result["checkpoint"] = sorted(ckpt.names())
            result["checkpoint_bytes"] = sum(ckpt.read(n).nbytes for n in ckpt.names())
        results[name] = result
        destroy_layout()
    return results


@pytest.mark.parametrize("arch,kept", PARAMS)
def test_parity_and_bitwise_round_trip(arch, kept, tiny_model_dir):
    hf_dir = str(tiny_model_dir(arch))
    layouts = {name: layout for name, layout in CASES[arch].items() if (name in KEPT) == kept}
    per_rank = run_local(_run_layouts, WORLD, hf_dir, layouts)
    expected = reference_logits(hf_dir, probe_tokens(_vocab(hf_dir)))
    failures = []
    for name in layouts:
        logits = [r[name]["logits"] for r in per_rank if "logits" in r[name]]
        assert logits, f"{arch} {name}: no rank returned logits"
        diff = (logits[0] - expected).abs().max().item()
        root = per_rank[0][name]
        if diff > 1e-4:
            failures.append(f"{name}: max |logit diff| {diff:.3g} > 1e-4")
        if root["exported"] != root["checkpoint"]:
            failures.append(f"{name}: exported names differ from the checkpoint's")
        if root["mismatches"]:
            failures.append(f"{name}: {len(root['mismatches'])} tensors differ, first {root['mismatches'][0]}")
    assert not failures, f"{arch}: " + "; ".join(failures)
    if "TP2xPP2" not in layouts:
        return
    # Each rank reads only its slices: in TP2×PP2 a rank owns about a quarter of the weights.
    total = per_rank[0]["TP2xPP2"]["checkpoint_bytes"]
    shares = [r["TP2xPP2"]["bytes_read"] / total for r in per_rank]
    assert max(shares) < 0.4, f"{arch}: a TP2xPP2 rank read {max(shares):.0%} of the checkpoint"
    assert sum(shares) >= 1.0  # together they read everything (replicated norms more than once)


def _vocab(hf_dir: str) -> int:
    from mrl.models.registry import model_spec_from_hf

    return model_spec_from_hf(hf_dir).vocab_size
