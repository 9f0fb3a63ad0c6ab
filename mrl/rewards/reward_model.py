"""A reward model scorer: an HF sequence-classification model with one output, batched on CPU/GPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

from mrl.rewards.base import RewardInput, RewardResult


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def reward_model_problem(path: str | None, check_files: bool = True) -> str | None:
    """Why `path` cannot serve as reward.model_path, in one line naming the fix; None when it can.
    Reads config.json only, so a config check does not load the model."""
    if not path:
        return ("reward.name 'reward_model' needs reward.model_path: set it to an HF sequence-classification "
                "model directory (num_labels=1).")
    if not check_files:
        return None
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return f"reward.model_path {path} has no config.json: point it at an HF model directory."
    config = json.loads(config_file.read_text())
    architectures = config.get("architectures") or []
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        return (f"reward.model_path {path} holds {'/'.join(architectures) or 'a model of no stated architecture'}, "
                "not a reward model: point it at a *ForSequenceClassification directory with num_labels=1.")
    labels = len(config["id2label"]) if config.get("id2label") else config.get("num_labels", 2)  # HF omits 2
    if labels != 1:
        return (f"reward.model_path {path} has num_labels={labels}: a reward model gives one score; "
                "point it at a model with num_labels=1.")
    if not any((Path(path) / name).is_file() for name in _TOKENIZER_FILES):
        return f"reward.model_path {path} has no tokenizer: save the reward model's tokenizer into that directory."
    return None


class RewardModelScorer:
    """Scores prompt + response with AutoModelForSequenceClassification (num_labels = 1).

    use_chat_template: format (prompt, response) as a user/assistant exchange with the tokenizer's
    chat template instead of plain concatenation.
    """

    def __init__(
        self,
        model_dir: str | Path,
        batch_size: int = 8,
        max_length: int = 2048,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        use_chat_template: bool = False,
    ) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer  # heavy: import on use

        if not (Path(model_dir) / "config.json").is_file():
            raise FileNotFoundError(f"reward model {model_dir} has no config.json: pass an HF model directory.")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"reward model {model_dir} has num_labels={self.model.config.num_labels}: a scorer needs a single output."
            )
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # Sequence classification pools the last non-pad token; it finds it by the pad id.
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size, self.max_length, self.device = batch_size, max_length, device
        self.use_chat_template = use_chat_template

    def text(self, sample: RewardInput) -> str:
        if self.use_chat_template:
            messages = [{"role": "user", "content": sample.prompt}, {"role": "assistant", "content": sample.response}]
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return sample.prompt + sample.response

    @torch.no_grad()
    def score_batch(self, samples: Sequence[RewardInput]) -> list[RewardResult]:
        """One scalar score per sample, computed batch_size samples at a time."""
        results: list[RewardResult] = []
        for start in range(0, len(samples), self.batch_size):
            texts = [self.text(s) for s in samples[start : start + self.batch_size]]
            encoded = self.tokenizer(
                texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
            ).to(self.device)
            logits = self.model(**encoded).logits[:, 0].float().cpu()
            results += [RewardResult(float(v)) for v in logits]
        return results

    def close(self) -> None:
        pass
