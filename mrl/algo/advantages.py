"""Advantage estimators, registered by name in ADVANTAGE_ESTIMATORS.

Shapes: B sequences, T response positions.
  token_level_rewards : [B, T] reward per response token (an outcome score sits on the last token;
                        with the KL in the reward every token also carries -kl_coef·kl)
  response_mask       : [B, T] 1 on response tokens, 0 on padding
  group_ids           : [B]    integer id of the prompt each sample answers (GRPO, RLOO)
  values              : [B, T] critic values (GAE)
Every estimator returns (advantages [B, T], returns [B, T]), zero on padding. All take keyword
arguments so a trainer can call any of them with one set of inputs.
"""

from __future__ import annotations

import torch

from mrl.algo.dapo import informative_groups
from mrl.algo.masked import masked_whiten
from mrl.registry import Registry

ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: (score - group mean) / (group std + eps), the same for every token of a sequence.

    score is the sum of the token-level rewards; std is the unbiased sample std of the group.
    norm_by_std=False gives Dr. GRPO (mean-centred only). A group whose scores are all equal (a
    group of one sample included) carries no learning signal: its advantage is exactly 0, not the
    float residue of an inexact mean (0.1 three times) divided by a std of ~1e-8 + eps.
    """
    scores = (token_level_rewards * response_mask).sum(-1)
    mean, std, _ = _group_stats(scores, group_ids)
    centred = scores - mean
    advantage = centred / (std + eps) if norm_by_std else centred
    advantage = torch.where(informative_groups(scores, group_ids), advantage, torch.zeros_like(advantage))
    advantages = advantage.unsqueeze(-1) * response_mask
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(
    *, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: torch.Tensor, **_: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: score minus the mean score of the *other* samples of the same prompt.

    Equals G/(G-1) · (score - group mean). A group of all-equal scores (one sample included) has
    advantage exactly 0.
    """
    scores = (token_level_rewards * response_mask).sum(-1)
    mean, _, size = _group_stats(scores, group_ids)
    others = (size - 1).clamp(min=1)
    advantage = torch.where(informative_groups(scores, group_ids), (scores - mean) * size / others,
                            torch.zeros_like(scores))
    advantages = advantage.unsqueeze(-1) * response_mask
    return advantages, advantages


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus_advantages(
    *, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0, **_: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted returns-to-go per token, whitened over every response token of the
    batch (global, not per group). Put the KL penalty into token_level_rewards (kl_penalized_rewards).

    returns: the un-whitened discounted returns.
    """
    returns = discounted_returns(token_level_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


@ADVANTAGE_ESTIMATORS.register("gae")
def gae_advantages(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation for PPO with a critic.

    delta_t = r_t + gamma·V_{t+1} - V_t,  A_t = delta_t + gamma·lam·A_{t+1}, with V and A past the
    last response token taken as 0. Padding positions are skipped: they neither add a step nor
    break the recursion. returns = A + V (the critic's regression target, before whitening);
    advantages are whitened over the batch's response tokens when `whiten`.
    """
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = advantage * m
        next_advantage = advantage * m + next_advantage * (1 - m)
        next_value = values[:, t] * m + next_value * (1 - m)
    returns = (advantages + values) * mask
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def discounted_returns(rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma·G_{t+1} over response tokens (padding skipped), 0 on padding. [B, T]."""
    mask = response_mask.to(rewards.dtype)
    running = torch.zeros_like(rewards[:, 0])
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + gamma * running) * mask[:, t] + running * (1 - mask[:, t])
        returns[:, t] = running * mask[:, t]
    return returns


def compute_advantages(name: str, **inputs: torch.Tensor | float | bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator called `name` on keyword inputs (see the module legend)."""
    return ADVANTAGE_ESTIMATORS.get(name)(**inputs)


def _group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-sample (group mean, unbiased group std, group size) of `scores` [B] by `group_ids` [B]."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    size = torch.zeros(groups, dtype=scores.dtype, device=scores.device).index_add_(0, inverse, torch.ones_like(scores))
    total = torch.zeros_like(size).index_add_(0, inverse, scores)
    mean = total / size
    squared = torch.zeros_like(size).index_add_(0, inverse, (scores - mean[inverse]).square())
    std = (squared / (size - 1).clamp(min=1)).sqrt()
    return mean[inverse], std[inverse], size[inverse]
