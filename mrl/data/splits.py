"""The run's train and held-out prompt samples, from a prompt file or the synthetic task."""

from __future__ import annotations

from typing import Any

from mrl.data.arithmetic import ArithmeticTask
from mrl.data.prompts import PromptTemplate, load_records, prompt_samples


def load_splits(data: Any, seed: int, tokenizer: Any = None) -> tuple[list[dict], list[dict]]:
    """(train, heldout) samples {"prompt", "ground_truth", "metadata"} for a DataConfig.

    A file without `heldout_path` has no held-out split (evaluation is then skipped).
    """
    template = PromptTemplate(data.template, data.chat_template, data.system_prompt)
    if data.synthetic:
        a = data.arithmetic
        task = ArithmeticTask(tuple(a.ops), a.min_operand, a.max_operand, a.heldout_fraction, seed, a.teacher_error,
                              a.tool_calls)
        train, heldout = task.sample(a.train_size, "train"), task.sample(a.heldout_size, "heldout")
        return (prompt_samples(train, template, "answer", tokenizer, sft_key="demonstrations"),
                prompt_samples(heldout, template, "answer", tokenizer))
    train = prompt_samples(load_records(data.path), template, data.answer_key, tokenizer, data.sft_key)
    heldout = (prompt_samples(load_records(data.heldout_path), template, data.answer_key, tokenizer)
               if data.heldout_path else [])
    return train, heldout
