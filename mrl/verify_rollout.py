"""`mrl verify --rollout vllm`: prove that a weight sync hands vLLM exactly the policy Megatron holds.

1. Start the vLLM engine (a Ray actor) from the HF checkpoint; record its greedy continuations of
   the probe prompts and their logprobs.
2. Load the checkpoint into Megatron in the requested layout (local gloo processes) and take one
   real optimizer step on a probe batch, so the weights differ from what the engine started with.
3. Sync the new weights to the engine over the chosen transport.
4. Check that (a) the engine's log-probs of Megatron's greedy continuation (teacher-forced) agree
   with Megatron's within the tolerance (see `tolerance`), and with an fp32 engine its greedy tokens
   equal Megatron's, (b) they differ from before the update, and (c) every tensor arrived intact
   and every engine parameter was updated.
The command line (JSON summary; exit 0 pass, 1 fail, 2 bad input) is mrl/cli/verify.py; what the
check guarantees: docs/sync.md.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from mrl.config.schema import DEFAULT_BUCKET_MB
from mrl.launch.cluster import local_ray
from mrl.launch.proxies import EngineHandle
from mrl.launch.rollout_actor import start_rollout_actor
from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local
from mrl.models.registry import model_spec_from_hf
from mrl.rollout.engine import SamplingSettings
from mrl.sync.channel import channel_count
from mrl.sync.parity import logprob_gap, probe_sequences

NEW_TOKENS = 8
CHANGED = 1e-3  # the step must move the engine's logprobs by more than this


def _trainer(rank: int, world: int, hf_dir: str, layout: ParallelLayout, endpoint: Any, transport: str,
             bucket_bytes: int, prompts: list[list[int]], before: list[list[int]], lr: float) -> dict:
    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.forward import greedy_decode, sequence_logprobs
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import initialize_layout
    from mrl.megatron.policy import sft_loss_fn
    from mrl.megatron.training import OptimConfig, lm_micro_batches, make_trainable, train_step
    from mrl.sync.sender import WeightSender

    coords = initialize_layout(layout)
    built = build_model(model_spec_from_hf(hf_dir), layout)
    load_hf_weights(built, coords, hf_dir)
    # The engine's continuations before the update, scored here on the same (HF) weights: the gap
    # is this model's numerical noise in the engine's dtype, measured before anything is synced.
    scored = sequence_logprobs(built, before)
    baseline = None if scored is None else _continuation(scored)
    # One real optimizer step (Megatron DDP + Adam) on next-token loss over the probe prompts,
    # weighed as SFT's (equal micro-batches; under CP each rank by its share of the tokens).
    trainable = make_trainable(built, OptimConfig(lr=lr, weight_decay=0.0, clip_grad=0.0))
    micro = [{**m, "response_mask": m["loss_mask"], "loss_scale_tokens": 1.0}
             for m in lm_micro_batches(torch.tensor(prompts), built.sequence_multiple)]
    step = train_step(trainable, micro, sft_loss_fn())
    if step.skipped:
        raise RuntimeError("the probe optimizer step was skipped (non-finite gradients)")
    sender = WeightSender(endpoint, built, coords, transport=transport, bucket_bytes=bucket_bytes)
    sent = sender.push("verify")
    greedy = greedy_decode(built, prompts, NEW_TOKENS)
    return {"greedy": greedy, "baseline": baseline, "loss": step.loss, "sent": None if sent is None else {"tensors": len(sent.checksums),
            "bytes": sent.bytes, "seconds": round(sent.seconds, 3)}}


def _continuation(scored: list[list[float]]) -> list[list[float]]:
    """The log-probs of each sequence's last NEW_TOKENS tokens (the continuation after the prompt)."""
    return [row[-NEW_TOKENS:] for row in scored]


def verify_rollout(hf_dir: str, layout: ParallelLayout, *, transport: str = "broadcast", tol: float | None = None,
                   engine_dtype: str = "auto", bucket_bytes: int = DEFAULT_BUCKET_MB << 20, lr: float = 1e-3) -> dict:
    """Run the check and return the JSON-ready summary (raises LayoutError etc. on bad input)."""
    spec = model_spec_from_hf(hf_dir)
    if spec.hf_config.get("quantization_config"):
        raise ValueError(f"--rollout needs an unquantised checkpoint: vLLM would load {hf_dir} as FP8 while the sync "
                         "sends unquantised weights (FP8 rollout is not built); verify the twin `mrl convert fp8-to-hf` writes.")
    world = layout.min_world_size()
    layout.validate(spec.dims, world)
    start = time.perf_counter()
    with local_ray(num_cpus=max(2, world)):
        engine = EngineHandle(start_rollout_actor(hf_dir, dict(dtype=engine_dtype, max_model_len=256,
                                                               kv_cache_memory_bytes=64 << 20)), timeout_s=600)
        try:
            prompts = probe_sequences(spec.vocab_size, count=2, length=16)
            greedy = SamplingSettings(max_tokens=NEW_TOKENS, ignore_eos=True)
            before = [g[0] for g in engine.generate(prompts, greedy)]
            continued = [p + g.token_ids for p, g in zip(prompts, before)]
            before_scored = _continuation(engine.score(continued))
            endpoint = engine.endpoint()
            receipt = engine.receive_weights("verify", channel_count(transport, layout.pp))
            results = run_local(_trainer, world, hf_dir, layout, endpoint, transport, bucket_bytes, prompts,
                                continued, lr)
            report = receipt.result()
            after = [g[0] for g in engine.generate(prompts, greedy)]
            tokens, logprobs = next(r["greedy"] for r in results if r["greedy"] is not None)
            # Both sides score the same sequences (Megatron's continuation, teacher-forced in the
            # engine): after a near-tie flips a greedy token, free-running continuations differ and
            # their log-probs are no longer comparable.
            after_scored = _continuation(engine.score([p + t for p, t in zip(prompts, tokens)]))
        finally:
            engine.close()
    gap = logprob_gap(after_scored, logprobs)
    noise = logprob_gap(before_scored, next(r["baseline"] for r in results if r["baseline"] is not None))
    tol, tol_source = tolerance(tol, endpoint.dtype, noise["rollout/logprob_abs_diff_max"])
    moved = logprob_gap([g.logprobs for g in after], [g.logprobs for g in before])["rollout/logprob_abs_diff_max"]
    summary = {
        "model": hf_dir, "arch": spec.arch, "layout": layout.describe(), "transport": transport,
        "engine_dtype": endpoint.dtype,  # what "auto" resolved to (vLLM casts fp32 checkpoints to bf16)
        "train_step_loss": next(r["loss"] for r in results if r["loss"] is not None),
        "sync": {"tensors": report.tensors, "bytes": report.bytes, "mismatched": report.mismatched,
                 "not_updated": report.not_updated, "engine_load_s": round(report.load_seconds, 3),
                 "engine_finish_s": round(report.finish_seconds, 3),
                 "ok": not report.mismatched and not report.not_updated},
        "match": {"tokens_equal": [g.token_ids for g in after] == tokens, **gap, "tol": tol, "tol_source": tol_source,
                  "noise_before_update": noise["rollout/logprob_abs_diff_max"]},
        "changed": {"tokens_changed": [g.token_ids for g in after] != [g.token_ids for g in before],
                    "logprob_max_change": moved, "min_change": CHANGED},
        "seconds": round(time.perf_counter() - start, 1),
    }
    # An fp32 engine must also decode Megatron's greedy tokens; a bf16 one may flip a near-tie
    # (reported in tokens_equal), which the teacher-forced log-prob bound already covers.
    strict = endpoint.dtype == "torch.float32"
    summary["match"]["ok"] = (summary["match"]["tokens_equal"] or not strict) and gap["rollout/logprob_abs_diff_max"] <= tol
    summary["changed"]["ok"] = moved > CHANGED
    summary["ok"] = summary["sync"]["ok"] and summary["match"]["ok"] and summary["changed"]["ok"]
    return summary


# fp32 engine: Megatron and vLLM agree to ~1e-6 on every zoo model (docs/benchmarks.md), so the check is strict.
FP32_TOL = 1e-4
# A lower-precision engine: its own measured noise on this model (engine vs Megatron on the same
# weights, before the update) times this margin, and never below BF16_FLOOR.
# A noise above NOISE_CEILING is no rounding: the check refuses rather than derive a bound from it.
NOISE_MARGIN, BF16_FLOOR, NOISE_CEILING = 3.0, 2e-2, 0.2


def tolerance(given: float | None, engine_dtype: str, noise: float) -> tuple[float, str]:
    """The max |Δ logprob| allowed after the sync, and where it came from. A bf16 engine differs
    from fp32 Megatron by rounding that grows with the model (MoE routing near-ties flip): a fixed
    bf16 bound failed on correct models, so the bound is this model's noise measured in the same
    run, on the same weights, before the sync; a sync that delivers wrong weights moves it far more."""
    if given is not None:
        return given, "--tol"
    if engine_dtype == "torch.float32":
        return FP32_TOL, "fp32 engine: strict"
    if noise > NOISE_CEILING:  # the engine disagreed before any sync: its own load is wrong
        raise ValueError(f"the {engine_dtype} engine and Megatron already differ by {noise:.3g} in log-prob on the "
                         "HF weights, before any sync: the engine does not load this model as Megatron does; "
                         "check with an fp32 engine (--engine-dtype float32) and `mrl verify` without --rollout")
    return max(BF16_FLOOR, NOISE_MARGIN * noise), f"{NOISE_MARGIN:g} × the engine's noise before the update (floor {BF16_FLOOR:g})"
