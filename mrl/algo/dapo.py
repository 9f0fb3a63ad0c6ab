"""DAPO's batch shaping: dynamic sampling of informative groups and the soft overlong penalty.

Shapes: B samples. scores [B], group_ids [B], response_lengths [B]; token_level_rewards and
response_mask [B, T] (T response positions).
"""

from __future__ import annotations

import torch

from mrl.algo.masked import add_on_last_token


def informative_groups(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Keep-mask [B] (bool): True for samples whose group's scores are not all equal.

    A group with all-equal rewards has zero GRPO advantage everywhere and only dilutes the batch;
    a group of one sample is all-equal by definition and is dropped too.
    """
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    low = torch.full((groups,), float("inf"), dtype=torch.float64).scatter_reduce(
        0, inverse, scores.double(), "amin"
    )
    high = torch.full((groups,), float("-inf"), dtype=torch.float64).scatter_reduce(
        0, inverse, scores.double(), "amax"
    )
    return (high > low)[inverse]


def overlong_penalty(
    response_lengths: torch.Tensor, max_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """Soft overlong punishment [B] to add to the scores.

    0 up to max_length - buffer_length tokens, then falling linearly to -penalty_factor at
    max_length, and -penalty_factor beyond (a truncated answer).
    """
    if not 0 < buffer_length <= max_length:
        raise ValueError(
            f"overlong buffer_length must be in (0, max_length={max_length}], got {buffer_length}: "
            "set algo.overlong.buffer_length below the maximum response length."
        )
    excess = response_lengths.double() - (max_length - buffer_length)
    penalty = -(excess / buffer_length).clamp(min=0.0, max=1.0) * penalty_factor
    return penalty.to(torch.get_default_dtype())


def penalise_overlong(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, max_length: int, buffer_length: int,
    penalty_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_level_rewards with the overlong penalty added on each sequence's last response token,
    the penalty [B]). The last token is found from the mask, not from a non-zero reward: a sample
    that scored 0 has no non-zero reward and would otherwise escape its penalty."""
    lengths = response_mask.sum(-1)
    penalty = overlong_penalty(lengths, max_length, buffer_length, penalty_factor)
    return add_on_last_token(token_level_rewards, response_mask, penalty), penalty

