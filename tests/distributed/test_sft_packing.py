"""SFT on packed rows (several sequences per row, attention kept within each) computes the same
loss and gradient as one sequence per row: tiny qwen3 (dense, GQA) and tiny DeepSeek-V3 (MLA, MoE)
under TP2 with sequence parallelism and under CP2 (each row split over two ranks, the segment mask
in the positions CP attention gathers), on 2 gloo processes.
"""

from __future__ import annotations

import pytest
import torch

from mrl.experience import packed_sft_batch, sft_batch
from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local

TIMEOUT_S = 240
LAYOUTS = {"TP2": ParallelLayout(tp=2), "CP2": ParallelLayout(cp=2)}


def _samples(vocab: int) -> tuple[list, list]:
    """8 prompt/target pairs of 3..10 and 1..6 tokens."""
    generator = torch.Generator().manual_seed(0)
    sizes = [(3, 2), (10, 6), (5, 1), (7, 4), (4, 3), (9, 5), (6, 2), (8, 6)]
    draw = lambda n: torch.randint(3, vocab, (n,), generator=generator).tolist()  # noqa: E731
    pairs = [(draw(p), draw(t)) for p, t in sizes]
    return [p for p, _ in pairs], [t for _, t in pairs]


def _sft_losses(rank: int, world_size: int, dirs: dict) -> dict:
    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import destroy_layout, initialize_layout
    from mrl.megatron.policy import update_sft
    from mrl.megatron.training import OptimConfig, make_trainable
    from mrl.models.registry import model_spec_from_hf

    results = {}
    for arch, hf_dir in dirs.items():
        spec = model_spec_from_hf(hf_dir)
        prompts, targets = _samples(spec.vocab_size)
        batches = {"padded": sft_batch(prompts, targets), "packed": packed_sft_batch(prompts, targets, row_tokens=24)}
        for layout_name, layout in LAYOUTS.items():
            for name, batch in batches.items():
                coords = initialize_layout(layout)
                built = build_model(spec, layout)
                load_hf_weights(built, coords, hf_dir)
                results[f"{arch} {layout_name} {name}"] = {
                    "rows": batch["tokens"].shape[0], **update_sft(make_trainable(built, OptimConfig(lr=1e-3)), batch, 2)}
                destroy_layout()
    return results


def test_packed_rows_give_the_same_loss_and_gradient(tiny_model_dir):
    dirs = {arch: str(tiny_model_dir(arch)) for arch in ("qwen3", "deepseek_v3")}
    results = run_local(_sft_losses, 2, dirs, timeout_s=TIMEOUT_S)[0]
    for arch in dirs:
        for layout in LAYOUTS:
            where = f"{arch} {layout}"
            padded, packed = results[f"{where} padded"], results[f"{where} packed"]
            assert packed["rows"] < padded["rows"] == 8, (where, packed["rows"])
            assert padded["sft/loss"] > 0 and padded["sft/grad_norm"] > 0, (where, padded)
            for key in ("sft/loss", "sft/grad_norm"):
                assert packed[key] == pytest.approx(padded[key], rel=1e-5), (where, key, packed[key], padded[key])
                # and CP2 computes what TP2 does
                assert packed[key] == pytest.approx(results[f"{arch} TP2 packed"][key], rel=1e-5), (where, key)
