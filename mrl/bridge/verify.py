"""Prove that a HuggingFace checkpoint means the same thing in a Megatron layout (`mrl verify`,
whose command line is mrl/cli/verify.py; `--rollout vllm` proves the weight sync instead).

1. Load the checkpoint into Megatron in the requested layout (local processes, gloo on CPU): the
   HF weights, or with `checkpoint` a Megatron checkpoint (mrl's or Megatron-LM's torch_dist, loaded
   as RL loads the policy it starts from), whose HF form is then `hf_dir`.
2. Run probe token ids through the pipeline and compare logits with transformers in fp32.
3. Export the Megatron shards back to HF tensors and compare each with the file, bitwise.
An FP8 checkpoint (DeepSeek's block-scaled format) is compared as its dequantised weights.
Returns a JSON-ready summary with an "ok" per check.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from mrl.bridge.dequantize import write_dequantized
from mrl.bridge.hf_checkpoint import HFCheckpoint
from mrl.config.schema import DEFAULT_BUCKET_MB
from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local
from mrl.models.registry import model_spec_from_hf

PROBE_SEED = 1234
PROBE_SHAPE = (2, 16)  # sequences × tokens


def probe_tokens(vocab_size: int) -> torch.Tensor:
    """Token ids drawn with a fixed seed: any checkpoint works, with or without a tokenizer."""
    generator = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, vocab_size, PROBE_SHAPE, generator=generator)


def _worker(rank: int, world_size: int, hf_dir: str, layout: ParallelLayout, impl: str, bucket_bytes: int,
            checkpoint: str | None) -> dict:
    from mrl.bridge.export import export_hf_weights
    from mrl.bridge.hf_import import ignorable, load_hf_weights
    from mrl.megatron.checkpoint import load_policy_weights
    from mrl.megatron.forward import forward_logits
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import initialize_layout

    coords = initialize_layout(layout)
    spec = model_spec_from_hf(hf_dir)
    built = build_model(spec, layout, transformer_impl=impl)
    if checkpoint is None:
        load_hf_weights(built, coords, hf_dir)
    else:
        load_policy_weights(checkpoint, built)
    logits = forward_logits(built, probe_tokens(spec.vocab_size))
    result: dict[str, Any] = {"logits": logits if logits is not None and coords.tp == 0 and coords.dp == 0 else None}

    ckpt = HFCheckpoint(hf_dir) if rank == 0 else None
    compared, mismatches, seen = 0, [], set()
    start = time.perf_counter()
    for bucket in export_hf_weights(built, coords, bucket_bytes=bucket_bytes):
        for name, tensor in bucket:
            seen.add(name)
            if name not in ckpt.files:
                mismatches.append(f"{name}: exported but not in the checkpoint")
                continue
            original = ckpt.read(name)
            compared += 1
            if tensor.shape != original.shape or not torch.equal(tensor.to("cpu", original.dtype), original):
                mismatches.append(name)
    if rank == 0:
        missing = sorted(n for n in ckpt.names() if n not in seen and not ignorable(n, spec))
        result["export"] = {
            "tensors_compared": compared,
            "mismatches": mismatches,
            "missing": missing,
            "export_and_compare_seconds": round(time.perf_counter() - start, 3),
        }
    return result


def reference_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logits in float32. An FP8 checkpoint runs as its dequantised float32 twin:
    transformers 5.19 dequantises FP8 only with accelerate installed and only whole blocks (it
    refuses partial edge blocks such as DeepSeek-V3's 576-row kv_a_proj_with_mqa)."""
    from transformers import AutoModelForCausalLM

    if HFCheckpoint(hf_dir).fp8 is None:
        return _logits(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), tokens)
    with tempfile.TemporaryDirectory() as tmp:
        twin = write_dequantized(hf_dir, Path(tmp) / "dequantized", torch.float32)["out"]
        return _logits(AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32), tokens)


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def verify(hf_dir: str, layout: ParallelLayout, *, tol: float = 1e-4, transformer_impl: str = "auto",
           bucket_bytes: int = DEFAULT_BUCKET_MB << 20, checkpoint: str | None = None) -> dict[str, Any]:
    """Run both checks and return the summary (raises LayoutError/UnsupportedModelError on bad input).
    With `checkpoint`, Megatron loads that checkpoint and `hf_dir` must be its HF form (a merge of it)."""
    spec = model_spec_from_hf(hf_dir)
    world_size = layout.min_world_size()
    layout.validate(spec.dims, world_size)
    start = time.perf_counter()
    results = run_local(_worker, world_size, hf_dir, layout, transformer_impl, bucket_bytes, checkpoint)
    megatron_logits = next(r["logits"] for r in results if r["logits"] is not None)
    diff = (megatron_logits - reference_logits(hf_dir, probe_tokens(spec.vocab_size))).abs().max().item()
    export = results[0]["export"]
    export["ok"] = not export["mismatches"] and not export["missing"]
    summary = {
        "model": checkpoint or hf_dir,
        "arch": spec.arch,
        "layout": layout.describe(),
        "world_size": world_size,
        "logits": {"max_abs_diff": diff, "tol": tol, "ok": diff <= tol},
        "export": export,
        "seconds": round(time.perf_counter() - start, 1),
    }
    summary["ok"] = summary["logits"]["ok"] and export["ok"]
    return summary
