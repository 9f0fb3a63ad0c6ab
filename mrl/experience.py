"""Generations and scores → the tensor batch the actor trains on.

Layout (B sequences, every row right-padded with PAD_ID to the longest one, L + 1 tokens):
  tokens              long  [B, L+1]  prompt ids then response ids
  response_mask       float [B, L]    1 where labels = tokens[:, 1:] is a response token the policy generated
                                      (an agent's appended tool / environment tokens are 0: Generation.loss_mask)
  token_level_rewards float [B, L]    the sequence score on its last response label, 0 elsewhere (turn_rewards:
                                      an episode's per-turn parts on their turns' last labels, the rest on its last)
  rollout_logprobs    float [B, L]    the engine's log-prob of each sampled response token
  group_ids           long  [B]       index of the prompt a sample answers (GRPO, RLOO groups)
  sample_ids          long  [B]       the row's place in the step's sample order (kept through select_rows,
                                      so the rollout trace finds each row's generation after dynamic sampling)
  routes    uint8|int16 [B, L, M, K]  (MoE, when the samples carry routes: mrl.routes) expert ids per input
                                      position tokens[:, t] and MoE layer, 0 past a row's routes
  routes_len          long  [B]       positions with a route: len(prompt) + len(response) - 1
Per-token tensors are aligned to the labels, so position t scores tokens[:, t+1] given tokens[:, :t+1].
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from mrl.rollout.engine import Generation
from mrl.routes import ROUTES_KEY, RouteShape

PAD_ID = 0  # causal attention: trailing padding never influences the real tokens before it


def _pad_rows(rows: Sequence[Sequence[float]], width: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.full((len(rows), width), PAD_ID, dtype=dtype)
    for index, row in enumerate(rows):
        out[index, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


def _rows(prompts: Sequence[list[int]], responses: Sequence[list[int]],
          masks: Sequence[list[int] | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, L+1] and response_mask [B, L] of prompt + response pairs; `masks` (an agent's
    episodes: 1 where the policy generated the token, None: every response token) per response."""
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    tokens = _pad_rows([list(p) + list(r) for p, r in zip(prompts, responses)], width, torch.long)
    mask = torch.zeros(len(prompts), width - 1)
    for index, (prompt, response) in enumerate(zip(prompts, responses)):
        own = None if masks is None else masks[index]
        mask[index, len(prompt) - 1 : len(prompt) - 1 + len(response)] = 1.0 if own is None else torch.tensor(own)
    return tokens, mask


def rollout_batch(groups: Sequence[Sequence[Generation]], scores: Sequence[float],
                  route_shape: RouteShape | None = None, turn_rewards: bool = False) -> dict[str, torch.Tensor]:
    """The batch of `groups` (one list of samples per prompt) with `scores` in sample order; with
    `route_shape` (the model's: MoE routes captured by the engine) every sample's routes, checked;
    with `turn_rewards` (agent.turn_rewards) each episode's score split where its turns earned it."""
    samples = [g for group in groups for g in group]
    if len(samples) != len(scores):
        raise ValueError(f"{len(scores)} scores for {len(samples)} samples")
    tokens, mask = _rows([s.prompt_ids for s in samples], [s.token_ids for s in samples],
                         [s.loss_mask for s in samples])
    rewards = torch.zeros_like(mask)
    logprobs = torch.zeros_like(mask)
    for index, sample in enumerate(samples):
        start = len(sample.prompt_ids) - 1
        if sample.token_ids:  # on the last token the policy generated (an episode ends with one)
            last = _last_policy_token(sample)
            parts = (sample.agent or {}).get("turn_rewards", []) if turn_rewards else []
            rewards[index, start + last] = scores[index] - sum(reward for _, reward in parts)
            for at, reward in parts:
                rewards[index, start + min(max(at, 0), last)] += reward
            logprobs[index, start : start + len(sample.logprobs)] = torch.tensor(sample.logprobs)
    group_ids = torch.tensor([g for g, group in enumerate(groups) for _ in group])
    batch = {"tokens": tokens, "response_mask": mask, "token_level_rewards": rewards,
             "rollout_logprobs": logprobs, "group_ids": group_ids, "sample_ids": torch.arange(len(samples))}
    if route_shape is not None:
        batch.update(route_rows(samples, mask.shape[1], route_shape))
    return batch


def _last_policy_token(sample: Generation) -> int:
    mask = sample.loss_mask
    return len(sample.token_ids) - 1 if mask is None else max(i for i, m in enumerate(mask) if m)


def sample_routes(sample: Any) -> Any:
    """A sample's routes (ROUTES_KEY, an attribute or a dict entry), or None."""
    return sample.get(ROUTES_KEY) if isinstance(sample, dict) else getattr(sample, ROUTES_KEY, None)


def route_rows(samples: Sequence[Generation], width: int, shape: RouteShape) -> dict[str, torch.Tensor]:
    """"routes" [B, width, M, K] and "routes_len" [B] of the samples, each checked against the
    contract first (mrl.routes.check_routes: the sample, MoE layer and token of a bad route named)."""
    routes = torch.zeros(len(samples), width, shape.layers, shape.top_k, dtype=shape.torch_dtype)
    lengths = torch.zeros(len(samples), dtype=torch.long)
    for index, sample in enumerate(samples):
        tokens = len(sample.prompt_ids) + len(sample.token_ids) - 1
        checked = shape.check(sample_routes(sample), tokens=tokens, sample=index)
        routes.numpy()[index, :tokens] = checked  # numpy's copy: Ray hands the arrays over read-only
        lengths[index] = tokens
    return {"routes": routes, "routes_len": lengths}


def sft_batch(prompts: Sequence[list[int]], targets: Sequence[list[int]],
              masks: Sequence[list[int] | None] | None = None) -> dict[str, torch.Tensor]:
    """Prompt + target pairs with the loss on the target tokens only; with `masks` (a demonstrated
    conversation: 1 on the assistant's tokens, 0 on the tool's; None: the whole target) on those."""
    tokens, mask = _rows(prompts, targets, masks)
    return {"tokens": tokens, "response_mask": mask}


def packed_sft_batch(prompts: Sequence[list[int]], targets: Sequence[list[int]], row_tokens: int,
                     rows_multiple: int = 1,
                     masks: Sequence[list[int] | None] | None = None) -> dict[str, torch.Tensor]:
    """sft_batch with several sequences per row, each row at most `row_tokens` tokens.

    First-fit decreasing by length. A row's sequences are separated by segment ids: `segments`
    [R, L] numbers the sequence each input position (tokens[:, :-1]) belongs to, from 1 (0:
    padding); the model attends only within a segment (mrl.megatron.training.segment_attention_mask),
    and the label that would cross into the next sequence is masked out. The row count is
    padded with empty rows to a multiple of `rows_multiple` (the data-parallel size).
    """
    sequences = [list(p) + list(t) for p, t in zip(prompts, targets)]
    too_long = [len(s) for s in sequences if len(s) > row_tokens]
    if too_long:
        raise ValueError(f"a sequence of {max(too_long)} tokens does not fit a packed row of {row_tokens}: "
                         f"raise trainer.sft_pack_tokens to at least {max(too_long)}")
    rows: list[list[int]] = []  # indices of the sequences in each row
    room: list[int] = []
    for index in sorted(range(len(sequences)), key=lambda i: -len(sequences[i])):
        fit = next((r for r, free in enumerate(room) if free >= len(sequences[index])), None)
        if fit is None:
            rows.append([])
            room.append(row_tokens)
            fit = len(rows) - 1
        rows[fit].append(index)
        room[fit] -= len(sequences[index])
    rows += [[] for _ in range(-len(rows) % rows_multiple)]
    width = max(row_tokens - free for free in room)
    tokens = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    mask, segments = torch.zeros(len(rows), width - 1), torch.zeros(len(rows), width - 1)
    for r, members in enumerate(rows):
        start = 0
        for segment, index in enumerate(members, start=1):
            sequence, prompt = sequences[index], len(prompts[index])
            end = start + len(sequence)
            tokens[r, start:end] = torch.tensor(sequence)
            segments[r, start : min(end, width - 1)] = segment
            own = None if masks is None else masks[index]  # the target's labels; end - 1 would cross over
            mask[r, start + prompt - 1 : end - 1] = 1.0 if own is None else torch.tensor(own, dtype=mask.dtype)
            start = end
    return {"tokens": tokens, "response_mask": mask, "segments": segments}


def select_rows(batch: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rows of every tensor of `batch` (a boolean mask or indices)."""
    return {key: value[rows] for key, value in batch.items()}


def split_rows(batch: dict[str, torch.Tensor], parts: int, multiple: int) -> list[dict[str, torch.Tensor]]:
    """`batch` as `parts` consecutive runs of rows (PPO's mini-batches), each a multiple of
    `multiple` rows (the data-parallel size: every rank gets its equal share), as equal as that
    allows; an empty run is left out. A batch of whole prompt groups whose mini-batch holds a whole
    number of groups splits between groups."""
    rows = batch["tokens"].shape[0]
    units = rows // multiple
    bounds = [multiple * (units * i // parts) for i in range(parts)] + [rows]
    return [{key: value[a:b] for key, value in batch.items()} for a, b in zip(bounds, bounds[1:]) if b > a]


def actor_inputs(batch: dict[str, torch.Tensor], rollout_logprobs: bool = False) -> dict[str, torch.Tensor]:
    """What the actor workers need of a batch (nothing the driver alone uses crosses to them); the
    engine's log-probs only with `rollout_logprobs` (an off-policy correction or decoupled PPO); MoE
    routes when the batch has them (mrl.megatron.router_replay)."""
    keys = ("tokens", "response_mask", "advantages", "old_logprobs", "ref_logprobs")
    routes = ("routes", "routes_len", "sample_ids") if "routes" in batch else ()  # sample_ids name a bad route
    return _pick(batch, keys + routes + (("rollout_logprobs",) if rollout_logprobs else ()))


def critic_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the critic workers need: the sequences, and for its update the values and GAE returns."""
    return _pick(batch, ("tokens", "response_mask", "values", "returns"))


def _pick(batch: dict[str, torch.Tensor], keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    return {key: batch[key] for key in keys if key in batch}
