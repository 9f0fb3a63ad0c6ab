"""Shared fixtures: tiny HF models of every supported architecture, written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(arch) → Path of a tiny random HF model directory (cached per session)."""
    from mrl.models.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("tiny-zoo")
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = write_tiny_model(arch, root / arch)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def tiny_reward_model(tmp_path_factory) -> Path:
    """A tiny random reward model (LlamaForSequenceClassification, num_labels=1) with the tiny zoo's
    tokenizer, so it reads the responses of the zoo's policies; written once per session."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast

    from mrl.models.tiny import build_tokenizer

    out = tmp_path_factory.mktemp("tiny-rm")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), pad_token="<pad>", eos_token="</s>")
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    model.score.weight.data.normal_(0, 1.0)  # a visible spread of scores
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def reward_model_scores(tiny_reward_model):
    """scores(samples) → the tiny reward model's score of each prompt + response, computed by
    transformers one sample at a time (no batching, no padding): what a scorer must reproduce."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_reward_model)

    def scores(samples) -> list[float]:
        with torch.no_grad():
            return [model(**tokenizer(s.prompt + s.response, return_tensors="pt")).logits[0, 0].item()
                    for s in samples]

    return scores


@pytest.fixture
def synthetic_run(tmp_path) -> Path:
    """A run directory as `mrl train` leaves it, without training: metrics.jsonl (steps 0-6, a step
    logged twice as after a resume, a NaN, a metric of no known section), config.yaml and rollout
    traces of steps 2, 4 and 6 (6 of 8 samples each, written by the trainer's own trace code), one
    response holding '</script>' to try the page's escaping."""
    import json

    import torch

    from mrl.config import load_config, save_config
    from mrl.experience import rollout_batch
    from mrl.rewards import RewardResult
    from mrl.rollout.engine import Generation
    from mrl.rollout_trace import trace_path, trace_records, write_trace

    run = tmp_path / "synthetic-run"
    recipe = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu_grpo.yaml"
    save_config(load_config(recipe, [f"trainer.output_dir={run}", "logging.trace_every=2"]))
    rows = [{"step": 0, "sync/bytes": 1e6, "timing_s/sync_weights": 0.2, "eval/accuracy": 0.25}]
    for step in range(1, 7):
        rows.append({
            "step": step, "critic/score/mean": 0.1 * step, "critic/score/max": 1.0, "critic/score/min": 0.0,
            "response_length/mean": 3.0 + step, "response_length/max": 8.0, "response_length/clip_ratio": 0.0,
            "actor/entropy": 0.7 - 0.05 * step, "actor/ppo_kl": float("nan") if step == 5 else 1e-4 * step,
            "rollout/train_logprob_abs_diff_mean": 1e-6, "rollout/train_logprob_abs_diff_max": 4e-6,
            "timing_s/gen": 0.3, "timing_s/reward": 0.01, "timing_s/update_actor": 0.5, "timing_s/sync_weights": 0.1,
            "timing_s/step": 1.0, "perf/throughput": 200.0 + step, "custom/thing": step % 2,
        })
    rows.append({**rows[4], "critic/score/mean": 0.99})  # step 4 again: the later row counts
    rows[-2]["eval/accuracy"] = 0.5
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    for step in (2, 4, 6):
        groups = [[Generation([1, 2], [3, 4, 5], f"{a + b + s}", [-0.5, -0.25, -0.1], "stop", step) for s in range(2)]
                  for a, b in ((17, 25), (3, 4), (8, 9), (10, 11))]
        groups[2][1] = Generation([1, 2], [6], "</script><b id=injected>x</b>", [-1.0], "length", step)
        prompts = [{"prompt": f"What is {a}+{b}?", "ground_truth": str(a + b)} for a, b in ((17, 25), (3, 4), (8, 9), (10, 11))]
        rewards = [RewardResult(float(g.text == p["ground_truth"]), {"extracted": g.text})
                   for p, group in zip(prompts, groups) for g in group]
        batch = rollout_batch(groups, [r.score for r in rewards])
        batch["old_logprobs"] = batch["rollout_logprobs"] + 1e-6 * batch["response_mask"]
        batch["advantages"] = torch.linspace(-1, 1, 8)[:, None] * batch["response_mask"]
        records = trace_records(step, prompts, groups, rewards, batch, start_step=0, max_samples=6, max_chars=2000)
        write_trace(trace_path(run, step), records)
    return run


def pytest_sessionstart(session):
    from start_counter import StartCounter, enabled

    session.config._mrl_starts = StartCounter() if enabled() else None


def pytest_terminal_summary(terminalreporter, config):
    counter = getattr(config, "_mrl_starts", None)
    if counter is not None:
        counts = counter.stop()
        terminalreporter.write_line("process starts: " + (", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
                                                          or "none"))
