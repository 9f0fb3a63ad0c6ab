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
