"""RL algorithm math: pure torch functions on tensors, registered by name (no megatron, no ray)."""

from mrl.algo.advantages import ADVANTAGE_ESTIMATORS, compute_advantages, discounted_returns
from mrl.algo.aggregation import AGGREGATIONS, SequenceParts, aggregate
from mrl.algo.dapo import informative_groups, overlong_penalty, penalise_overlong
from mrl.algo.diagnostics import advantage_metrics, explained_variance
from mrl.algo.entropy import entropy_bonus
from mrl.algo.kl import KL_ESTIMATORS, kl_loss, kl_penalized_rewards
from mrl.algo.policy_loss import BEHAVIOUR_LOSSES, POLICY_LOSSES, default_aggregation, policy_loss
from mrl.algo.rollout_correction import (
    ROLLOUT_CORRECTIONS,
    behaviour_weights,
    correction_settings,
    foreign_settings,
    rollout_correction,
    uses_rollout_logprobs,
)
from mrl.algo.value_loss import clipped_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATIONS", "BEHAVIOUR_LOSSES", "KL_ESTIMATORS", "POLICY_LOSSES",
    "ROLLOUT_CORRECTIONS", "SequenceParts", "advantage_metrics", "aggregate", "behaviour_weights", "clipped_value_loss",
    "compute_advantages", "correction_settings", "default_aggregation", "discounted_returns", "entropy_bonus",
    "explained_variance", "foreign_settings", "informative_groups", "kl_loss", "kl_penalized_rewards",
    "overlong_penalty", "penalise_overlong", "policy_loss", "rollout_correction", "uses_rollout_logprobs",
]
