"""The run's inputs as the driver prepares them: the HF model directory (written from the tiny zoo
when the config names one and it is missing), its tokenizer, and prompts as token ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def prepare_model(model: Any, seed: int) -> tuple[str, Any]:
    """(HF directory, tokenizer) for a ModelConfig."""
    from transformers import AutoTokenizer

    path = Path(model.path)
    if model.tiny and not (path / "config.json").exists():
        from mrl.models.tiny import write_tiny_model

        write_tiny_model(model.tiny, path, seed=seed)
    return str(path), AutoTokenizer.from_pretrained(str(path))


def tokenize_samples(samples: list[dict], tokenizer: Any) -> list[dict]:
    """Each sample with "prompt_ids" (the tokenizer's own special-token convention, as vLLM applies it
    to text prompts) and "sft_targets", what SFT trains on: each demonstration (else the ground truth,
    if any) then end-of-sequence; a demonstrated conversation as an agent's episode lays it out, with
    its loss mask in "sft_masks" (mrl.agent.demonstrations; None for a text)."""
    chat = None
    for sample in samples:
        sample["prompt_ids"] = tokenizer(sample["prompt"])["input_ids"]
        truth = [] if sample["ground_truth"] is None else [sample["ground_truth"]]
        sample["sft_targets"], sample["sft_masks"] = [], []
        for shown in sample.get("demonstrations", truth):
            if isinstance(shown, list):  # chat messages (mrl.data.prompts.is_conversation)
                from mrl.agent.chat import ChatRenderer
                from mrl.agent.demonstrations import conversation_target

                chat = chat or ChatRenderer(tokenizer)
                target, mask = conversation_target(chat, shown)
            else:
                target, mask = tokenizer(shown, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id], None
            sample["sft_targets"].append(target)
            sample["sft_masks"].append(mask)
    return samples
