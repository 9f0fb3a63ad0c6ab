"""mrl.algo against values worked out by hand, edge cases, and the first-step identity."""

import math

import pytest
import torch

from mrl.algo import (
    ADVANTAGE_ESTIMATORS,
    AGGREGATIONS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    aggregate,
    clipped_value_loss,
    compute_advantages,
    entropy_bonus,
    informative_groups,
    kl_loss,
    kl_penalized_rewards,
    overlong_penalty,
    penalise_overlong,
    policy_loss,
)
from mrl.registry import UnknownNameError

t = torch.tensor


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# Scores sit on each sequence's last response token; rows have different response lengths.
# Groups: 0 → scores 1, 0, 1; 1 → scores 0, 1; 2 → a single sample scoring 5.
SCORES = [1.0, 0.0, 1.0, 0.0, 1.0, 5.0]
GROUPS = t([0, 0, 0, 1, 1, 2])
MASK = t([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.float32)


def outcome_rewards():
    rewards = torch.zeros(6, 3)
    for row, score in enumerate(SCORES):
        rewards[row, int(MASK[row].sum()) - 1] = score
    return rewards


def per_sequence(advantages):
    """The one advantage value each row carries on all its response tokens."""
    values = [advantages[row][MASK[row].bool()] for row in range(6)]
    for row, v in enumerate(values):
        assert torch.equal(v, v[:1].expand_as(v)), f"row {row} advantage varies over tokens: {v}"
    assert torch.equal(advantages * (1 - MASK), torch.zeros_like(advantages)), "padding must be 0"
    return torch.stack([v[0] for v in values])


def test_grpo_by_hand():
    adv, returns = compute_advantages(
        "grpo", token_level_rewards=outcome_rewards(), response_mask=MASK, group_ids=GROUPS, eps=0.0
    )
    std0 = math.sqrt(((1 / 3) ** 2 + (2 / 3) ** 2 + (1 / 3) ** 2) / 2)  # unbiased: n - 1 = 2
    std1 = math.sqrt((0.5**2 + 0.5**2) / 1)
    expected = [(1 / 3) / std0, (-2 / 3) / std0, (1 / 3) / std0, -0.5 / std1, 0.5 / std1, 0.0]
    close(per_sequence(adv), expected)
    assert torch.equal(adv, returns)


def test_grpo_without_std_normalisation_and_eps():
    adv, _ = compute_advantages(
        "grpo", token_level_rewards=outcome_rewards(), response_mask=MASK, group_ids=GROUPS, norm_by_std=False
    )
    close(per_sequence(adv), [1 / 3, -2 / 3, 1 / 3, -0.5, 0.5, 0.0])
    # A group whose scores are all equal has std 0: eps keeps the advantage finite (0).
    same, _ = compute_advantages(
        "grpo", token_level_rewards=torch.ones(2, 1), response_mask=torch.ones(2, 1), group_ids=t([7, 7])
    )
    assert torch.equal(same, torch.zeros(2, 1))


def test_rloo_by_hand():
    adv, _ = compute_advantages("rloo", token_level_rewards=outcome_rewards(), response_mask=MASK, group_ids=GROUPS)
    # score minus the mean of the other samples of the same prompt; a lone sample gets 0.
    close(per_sequence(adv), [1 - (0 + 1) / 2, 0 - (1 + 1) / 2, 1 - (1 + 0) / 2, 0 - 1, 1 - 0, 0.0])


def test_reinforce_plus_plus_by_hand():
    rewards = t([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    mask = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, returns = compute_advantages("reinforce_plus_plus", token_level_rewards=rewards, response_mask=mask, gamma=0.5)
    close(returns, [[0.25, 0.5, 1.0], [0.5, 1.0, 0.0]])
    valid = [0.25, 0.5, 1.0, 0.5, 1.0]
    mean = sum(valid) / 5  # 0.65
    var = sum((v - mean) ** 2 for v in valid) / 5  # 0.09
    scale = 1 / math.sqrt(var + 1e-8)
    close(adv, [[(0.25 - mean) * scale, (0.5 - mean) * scale, (1.0 - mean) * scale],
                [(0.5 - mean) * scale, (1.0 - mean) * scale, 0.0]], atol=1e-5)


def test_gae_by_hand_with_padding():
    rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = t([[0.5, 0.4, 0.8], [1.0, 1.0, 9.0]])  # 9.0 sits on padding and must be ignored
    mask = t([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, returns = compute_advantages(
        "gae", token_level_rewards=rewards, response_mask=mask, values=values, gamma=1.0, lam=0.5, whiten=False
    )
    # row 0: deltas 0+0.4-0.5=-0.1, 0+0.8-0.4=0.4, 1+0-0.8=0.2 → A2=0.2, A1=0.4+0.5·0.2=0.5, A0=-0.1+0.5·0.5=0.15
    # row 1: deltas 0+1-1=0, 2+0-1=1 → A1=1, A0=0+0.5·1=0.5
    close(adv, [[0.15, 0.5, 0.2], [0.5, 1.0, 0.0]])
    close(returns, [[0.65, 0.9, 1.0], [1.5, 2.0, 0.0]])
    whitened, _ = compute_advantages("gae", token_level_rewards=rewards, response_mask=mask, values=values, lam=0.5)
    valid = whitened[mask.bool()]
    close(valid.mean(), 0.0, atol=1e-6)
    assert whitened[1, 2] == 0


def test_gae_on_a_rollout_batch_puts_the_score_on_the_last_response_token():
    """The trainer's path: rollout_batch places each score on its last response label, the critic's
    values are aligned to the same labels, and GAE bootstraps 0 after the last response token. With
    lam = gamma = 1 every response token's return is the score and A_t = score - V_t, whatever sits
    on prompt and padding columns."""
    from mrl.experience import rollout_batch
    from mrl.rollout.engine import Generation

    groups = [[Generation([5, 6, 7], [8, 9], "", [-0.1, -0.2]), Generation([5, 6, 7], [10], "", [-0.3])],
              [Generation([11], [12, 13, 14], "", [-0.4, -0.5, -0.6])]]
    batch = rollout_batch(groups, [1.0, 0.0, 0.5])
    mask = batch["response_mask"]
    values = t([[9.0, 9.0, 0.25, 0.5], [9.0, 9.0, 0.4, 9.0], [0.1, 0.2, 0.3, 9.0]])  # 9.0: prompt or padding
    adv, returns = compute_advantages("gae", token_level_rewards=batch["token_level_rewards"], response_mask=mask,
                                      values=values, gamma=1.0, lam=1.0, whiten=False)
    close(returns, [[0, 0, 1.0, 1.0], [0, 0, 0.0, 0], [0.5, 0.5, 0.5, 0]])
    close(adv, [[0, 0, 0.75, 0.5], [0, 0, -0.4, 0], [0.4, 0.3, 0.2, 0]])


def test_clipped_value_loss_by_hand():
    old = t([[0.0, 1.0, 0.0]])
    returns = t([[1.0, 0.0, 5.0]])
    values = t([[0.8, 0.9, 7.0]], requires_grad=True)  # 7.0 sits on padding and must be ignored
    mask = t([[1.0, 1.0, 0.0]])
    loss, metrics = clipped_value_loss(values, old, returns, mask, cliprange=0.5)
    # token 0: V moved 0.8 from 0 → clipped to 0.5; errors (0.8-1)²=0.04, (0.5-1)²=0.25 → 0.5·0.25, clipped
    # token 1: V moved -0.1, inside the clip; error (0.9-0)²=0.81 both ways → 0.5·0.81, not clipped
    close(loss, (0.125 + 0.405) / 2)
    close(metrics["vf_clipfrac"], 0.5)
    loss.backward()
    # d/dV: token 0 takes the clipped branch (no gradient through the clamp), token 1 0.5·2·0.9 / 2.
    close(values.grad, [[0.0, 0.45, 0.0]])


def test_kl_estimators_by_hand_and_clamped():
    logp, ref = t([-1.0, 0.0, -50.0]), t([-2.0, -50.0, 0.0])
    close(KL_ESTIMATORS.get("k1")(logp, ref), [1.0, 50.0, -50.0])
    close(KL_ESTIMATORS.get("k2")(logp, ref), [0.5, 1250.0, 1250.0])
    # k3 = exp(ref-logp) - (ref-logp) - 1; log-ratios clamped to ±20, values to [-10, 10]
    close(KL_ESTIMATORS.get("k3")(logp, ref), [math.exp(-1) + 1 - 1, 10.0, 10.0])
    assert KL_ESTIMATORS.get("low_var_kl") is KL_ESTIMATORS.get("k3")
    same = torch.randn(4, 5)
    for name in ("k1", "k2", "k3"):
        assert torch.equal(KL_ESTIMATORS.get(name)(same, same), torch.zeros(4, 5))


def test_kl_in_loss():
    logp = t([[-1.0, -1.0], [-2.0, 0.0]])
    ref = t([[-2.0, -1.0], [-1.0, 5.0]])
    mask = t([[1.0, 1.0], [1.0, 0.0]])
    # k1 per token: 1, 0, -1 (the masked 0 - 5 is ignored) → token mean 0/3; k2: 0.5, 0, 0.5 → 1/3
    close(kl_loss(logp, ref, mask, "k1"), 0.0)
    close(kl_loss(logp, ref, mask, "k2"), 1 / 3)
    close(kl_loss(logp, ref, mask, "k2", "seq-mean-token-mean"), (0.25 + 0.5) / 2)


def test_kl_in_reward():
    rewards = t([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # a score on its last response token
    mask = t([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # second row has no response token
    kl = t([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    close(kl_penalized_rewards(rewards, mask, kl, kl_coef=0.5), [[-0.05, -0.1 + 1.0, 0.0], [0.0, 0.0, 0.0]])
    turns = t([[0.25, 0.75, 0.0], [0.0, 0.0, 0.0]])  # an episode's per-turn rewards stay where they were earned
    close(kl_penalized_rewards(turns, mask, kl, kl_coef=0.5), [[0.25 - 0.05, 0.75 - 0.1, 0.0], [0.0, 0.0, 0.0]])


def test_aggregations_by_hand():
    loss = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = t([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # last row all padding
    close(aggregate(loss, mask, "token-mean"), (1 + 2 + 4) / 3)
    close(aggregate(loss, mask, "seq-mean-token-sum"), ((1 + 2) + 4) / 2)
    close(aggregate(loss, mask, "seq-mean-token-mean"), ((1 + 2) / 2 + 4) / 2)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_aggregation_of_nothing_is_zero_with_a_graph(mode):
    loss = torch.randn(2, 3, requires_grad=True)
    value = aggregate(loss, torch.zeros(2, 3), mode)
    assert torch.equal(value.detach(), t(0.0))
    value.backward()
    assert torch.equal(loss.grad, torch.zeros(2, 3))


def test_ppo_clip_by_hand():
    ratios = t([[1.5, 0.5, 1.1, 0.7]])
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, m = policy_loss("ppo_clip", ratios.log(), torch.zeros(1, 4), adv, mask, clip_low=0.2, clip_high=0.2)
    # per token max(-A·r, -A·clip(r, 0.8, 1.2)): max(-1.5,-1.2)=-1.2*, max(-0.5,-0.8)=-0.5,
    # max(1.1,1.1)=1.1, max(0.7,0.8)=0.8*  (* = the clipped term was used)
    close(loss, (-1.2 - 0.5 + 1.1 + 0.8) / 4)
    close(m["pg_clipfrac"], 0.5)
    close(m["ppo_kl"], -math.log(1.5 * 0.5 * 1.1 * 0.7) / 4)
    close(m["ratio_mean"], (1.5 + 0.5 + 1.1 + 0.7) / 4)
    close(m["ratio_max"], 1.5)


def test_dapo_clip_higher_by_hand():
    ratios = t([[1.5, 0.5, 1.1, 0.7]])
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    loss, _ = policy_loss("dapo", ratios.log(), torch.zeros(1, 4), adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.28)
    close(loss, (-1.28 - 0.5 + 1.1 + 0.8) / 4)
    with pytest.raises(ValueError, match="token-mean"):
        policy_loss("dapo", ratios.log(), torch.zeros(1, 4), adv, torch.ones(1, 4), aggregation="seq-mean-token-mean")


def test_dual_clip_caps_negative_advantages():
    logp = t([[math.log(5.0), math.log(5.0)]])
    adv = t([[-1.0, 1.0]])
    loss, m = policy_loss("ppo_clip", logp, torch.zeros(1, 2), adv, torch.ones(1, 2), clip_ratio_c=3.0)
    # A=-1, r=5: max(5, 1.2)=5, capped at -A·c = 3.  A=1, r=5: max(-5, -1.2) = -1.2 (no cap for A>0)
    close(loss, (3.0 - 1.2) / 2)
    close(m["pg_clipfrac_lower"], 0.5)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss("ppo_clip", logp, torch.zeros(1, 2), adv, torch.ones(1, 2), clip_ratio_c=0.5)


def test_gspo_sequence_ratio_by_hand():
    # row 0: token ratios 2 and 0.5 → geometric mean 1; row 1: one token with ratio 1.5 (+ padding)
    logp = t([[math.log(2.0), math.log(0.5)], [math.log(1.5), 99.0]], requires_grad=True)
    adv = t([[1.0, 1.0], [1.0, 1.0]])
    mask = t([[1.0, 1.0], [1.0, 0.0]])
    loss, m = policy_loss("gspo", logp, torch.zeros(2, 2), adv, mask, clip_low=0.2, clip_high=0.2)
    # row 0: -A·s = -1 per token; row 1: s = 1.5 clipped to 1.2 → -1.2; seq-mean-token-mean → -1.1
    close(loss, (-1.0 + -1.2) / 2)
    close(m["ratio_mean"], (1 + 1 + 1.5) / 3)
    close(m["ratio_max"], 1.5)
    close(m["pg_clipfrac"], 1 / 3)
    close(m["ppo_kl"], -(math.log(2) + math.log(0.5) + math.log(1.5)) / 3)
    loss.backward()
    # d/dlogp_t of -s·exp(logp_t - sg(logp_t)) is -s = -1 per token, × 1/2 (token mean) × 1/2 (seq mean)
    close(logp.grad, [[-0.25, -0.25], [0.0, 0.0]])


@pytest.mark.parametrize("name", ["ppo_clip", "dapo", "gspo"])
def test_first_step_identity(name):
    torch.manual_seed(0)
    logp = -torch.rand(4, 6) * 3
    mask = torch.ones(4, 6)
    mask[1, 3:] = 0
    mask[2] = 0  # an all-masked row
    _, m = policy_loss(name, logp, logp.clone(), torch.randn(4, 6), mask)
    assert torch.equal(m["ratio_mean"], t(1.0))
    assert torch.equal(m["ratio_max"], t(1.0))
    assert torch.equal(m["ppo_kl"], t(0.0))
    assert torch.equal(m["pg_clipfrac"], t(0.0))


def test_entropy_bonus_by_hand():
    entropy = t([[1.0, 2.0], [3.0, 4.0]])
    mask = t([[1.0, 0.0], [1.0, 1.0]])
    term, mean = entropy_bonus(entropy, mask, coef=0.01)
    close(mean, (1 + 3 + 4) / 3)
    close(term, -0.01 * (1 + 3 + 4) / 3)
    term, mean = entropy_bonus(entropy, mask, coef=0.01, aggregation="seq-mean-token-mean")
    close(mean, (1 + 3.5) / 2)


def test_dynamic_sampling_keeps_groups_with_different_rewards():
    scores = t([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    groups = t([0, 0, 1, 1, 2, 2, 3])  # group 3 has a single sample
    assert informative_groups(scores, groups).tolist() == [False, False, True, True, False, False, False]


def test_overlong_penalty_by_hand():
    lengths = t([6, 7, 8, 10, 12])
    # max 10, buffer 4: free up to 6 tokens, then -1/4 per token, -1 at and past 10
    close(overlong_penalty(lengths, max_length=10, buffer_length=4), [0.0, -0.25, -0.5, -1.0, -1.0])
    close(overlong_penalty(lengths, 10, 4, penalty_factor=0.5), [0.0, -0.125, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(lengths, max_length=10, buffer_length=0)


def test_registry_typo_lists_valid_names():
    with pytest.raises(UnknownNameError, match=r"did you mean 'grpo'\? Valid: gae, grpo, reinforce_plus_plus, rloo"):
        ADVANTAGE_ESTIMATORS.get("grpoo")
    for registry in (POLICY_LOSSES, KL_ESTIMATORS, AGGREGATIONS):
        with pytest.raises(UnknownNameError, match="Valid:"):
            registry.get("nope")


@pytest.mark.parametrize(
    "estimator, loss_name",
    [("grpo", "ppo_clip"), ("rloo", "dapo"), ("grpo", "gspo"), ("reinforce_plus_plus", "ppo_clip")],
)
def test_pieces_compose_into_learning(estimator, loss_name):
    """A toy policy (a logit table per position) trained with the registered pieces learns to emit
    the rewarded token: the signs of advantages and losses point the right way."""
    torch.manual_seed(0)
    positions, vocab, target, groups, group_size = 3, 5, 2, 8, 4
    logits = torch.zeros(positions, vocab, requires_grad=True)
    optimizer = torch.optim.Adam([logits], lr=0.1)
    mask = torch.ones(groups * group_size, positions)
    mask[::3, 2] = 0  # some responses are a token shorter
    group_ids = torch.arange(groups).repeat_interleave(group_size)
    for _ in range(40):
        with torch.no_grad():
            tokens = torch.distributions.Categorical(logits=logits.expand(len(mask), -1, -1)).sample()
            scores = ((tokens == target).float() * mask).sum(-1) / mask.sum(-1)
            rewards = torch.zeros_like(mask)
            rewards[torch.arange(len(mask)), mask.sum(-1).long() - 1] = scores
            adv, _ = compute_advantages(estimator, token_level_rewards=rewards, response_mask=mask, group_ids=group_ids)
        logp = torch.log_softmax(logits, -1).expand(len(mask), -1, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        loss, metrics = policy_loss(loss_name, logp, logp.detach(), adv, mask)
        assert torch.equal(metrics["ppo_kl"], t(0.0))  # one on-policy update per batch
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert torch.softmax(logits, -1)[:, target].min() > 0.9


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
@pytest.mark.parametrize("size,score", [(8, 0.1), (16, 0.7), (3, 0.9)])
def test_groups_of_equal_inexact_scores_have_exactly_zero_advantage(estimator, size, score):
    # the float32 mean of 16 × 0.7 is not 0.7: the residue over std + eps gave 0.1 per sample
    mask = torch.ones(size + 3, 2)
    rewards = torch.zeros(size + 3, 2)
    rewards[:, -1] = t([score] * size + [0.0, 1.0, 0.5])
    adv, _ = compute_advantages(estimator, token_level_rewards=rewards, response_mask=mask,
                                group_ids=t([0] * size + [1, 1, 1]))
    assert torch.equal(adv[:size], torch.zeros(size, 2)), adv[:size]
    assert (adv[size:] != 0).any()


def test_overlong_penalty_reaches_samples_that_scored_zero():
    from mrl.config import RunConfig
    from mrl.trainer import shape_rewards

    # rows: scored 1 and truncated, scored 0 and truncated, scored 0 and short, no response at all
    mask = t([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.float32)
    rewards = torch.zeros(4, 4)
    rewards[0, 3] = 1.0
    cfg = RunConfig()
    cfg.rollout.max_new_tokens, cfg.algo.overlong.enable, cfg.algo.overlong.buffer_length = 4, True, 2
    batch = shape_rewards({"token_level_rewards": rewards, "response_mask": mask}, rewards.sum(-1), cfg, {})
    close(batch["token_level_rewards"], [[0, 0, 0, 0.0], [0, 0, 0, -1.0], [0, 0, 0, 0], [0, 0, 0, 0]])
    _, penalty = penalise_overlong(rewards, mask, max_length=4, buffer_length=2)
    close(penalty, [-1.0, -1.0, 0.0, 0.0])


def test_gspo_defaults_to_its_papers_aggregation():
    from mrl.config.schema import AlgoConfig

    assert AlgoConfig(policy_loss="gspo").aggregation == "seq-mean-token-mean"
    assert AlgoConfig(policy_loss="ppo_clip").aggregation == "token-mean"
    assert AlgoConfig(policy_loss="gspo", aggregation="token-mean").aggregation == "token-mean"  # explicit wins


# --- sequences split over ranks (context parallelism): each rank's share adds up to the whole -----


class _TwoRanks:
    """Two threads standing in for two CP ranks: SequenceParts.reduce adds up (or takes the larger
    of) their partial results."""

    def __init__(self):
        import threading

        self.barrier, self.slots = threading.Barrier(2), [None, None]

    def reduce(self, rank: int):
        def over_ranks(partial: torch.Tensor, op: str) -> torch.Tensor:
            self.slots[rank] = partial
            self.barrier.wait()
            whole = {"sum": torch.add, "max": torch.maximum}[op](self.slots[0], self.slots[1])
            self.barrier.wait()
            return whole
        return over_ranks

    def run(self, fn) -> list:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            return [f.result(timeout=30) for f in [pool.submit(fn, rank) for rank in (0, 1)]]


SPLIT_CASES = {
    "ppo_clip seq-mean-token-mean": ("ppo_clip", "seq-mean-token-mean", None),
    "ppo_clip seq-mean-token-sum": ("ppo_clip", "seq-mean-token-sum", None),
    "ppo_clip token-mean": ("ppo_clip", "token-mean", None),
    "gspo seq-mean-token-mean": ("gspo", "seq-mean-token-mean", None),
    "gspo token-mean": ("gspo", "token-mean", None),
    "ppo_clip mis": ("ppo_clip", "seq-mean-token-mean", "mis"),
    "ppo_clip tis": ("ppo_clip", "token-mean", "tis"),
    "ppo_clip icepop": ("ppo_clip", "token-mean", "icepop"),
}
CORRECTION_SETTINGS = {"mis": {"low": 0.8, "high": 1.25}, "tis": {"cap": 1.1}, "icepop": {"low": 0.8, "high": 1.25}}


@pytest.mark.parametrize("case", SPLIT_CASES)
def test_a_sequence_split_over_two_ranks_gives_the_whole_loss_and_gradient(case):
    """Megatron's load-balanced CP split of 12 positions (rank 0: chunks 0 and 3, rank 1: 1 and 2):
    the ranks' losses (token-mean weighed by the rank's share of the tokens, as split_micro_batch
    does) add up to the loss of whole sequences, and their gradients to its gradient; every rank's
    metrics (whole_mean, whole_max, whole_min: the policy loss's and the correction's) are the whole
    sequences', and on a first step the ratio mean is exactly 1."""
    from mrl.algo import SequenceParts, rollout_correction

    name, aggregation, correction = SPLIT_CASES[case]
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(4, 12, dtype=torch.float64)
    for row, (start, end) in enumerate([(0, 12), (2, 5), (4, 11), (9, 12)]):  # row 3: only on rank 0's chunk
        mask[row, start:end] = 1
    logp = -torch.rand(4, 12, generator=g, dtype=torch.float64)
    old = logp + 0.3 * torch.randn(4, 12, generator=g, dtype=torch.float64)
    rollout = old + 0.2 * torch.randn(4, 12, generator=g, dtype=torch.float64)
    advantages = torch.randn(4, 1, generator=g, dtype=torch.float64).expand(-1, 12)
    clip = {"clip_low": 0.2, "clip_high": 0.2} if name != "gspo" else {"clip_low": 0.5, "clip_high": 0.5}

    def loss_of(logp, old, rollout, advantages, mask, parts):
        corrected = (rollout_correction(correction, old, rollout, mask, parts, **CORRECTION_SETTINGS[correction])
                     if correction else None)
        loss, metrics = policy_loss(name, logp, old, advantages, mask, aggregation=aggregation,
                                    weights=corrected and corrected.weights, parts=parts, **clip)
        return loss, {**metrics, **(corrected.metrics if corrected else {})}

    whole_logp = logp.clone().requires_grad_()
    whole, whole_metrics = loss_of(whole_logp, old, rollout, advantages, mask, None)
    whole.backward()
    if correction == "mis":  # some sequences masked, some kept: the test sees both
        assert 0 < whole_metrics["is_seq_masked_frac"] < 1
    if correction:  # some tokens truncated or masked, some not
        assert 0 < whole_metrics.get("is_clipfrac", whole_metrics.get("is_masked_frac")) < 1

    columns = [torch.tensor([0, 1, 2, 9, 10, 11]), torch.tensor([3, 4, 5, 6, 7, 8])]
    ranks = _TwoRanks()

    def rank_loss(rank: int):
        cols = columns[rank]
        mine = logp[:, cols].clone().requires_grad_()
        parts = SequenceParts(mask.sum(-1), ranks.reduce(rank))
        loss, metrics = loss_of(mine, old[:, cols], rollout[:, cols], advantages[:, cols], mask[:, cols], parts)
        if aggregation == "token-mean":
            loss = loss * mask[:, cols].sum() / mask.sum()
        loss.backward()
        first_step = policy_loss(name, mine.detach(), mine.detach(), advantages[:, cols], mask[:, cols],
                                 aggregation=aggregation, parts=parts, **clip)[1]
        return loss.detach(), mine.grad, metrics, first_step

    (loss0, grad0, metrics0, first0), (loss1, grad1, metrics1, first1) = ranks.run(rank_loss)
    close(loss0 + loss1, whole.detach(), atol=1e-12)
    assert metrics0.keys() == metrics1.keys() == whole_metrics.keys()
    for key in whole_metrics:
        for metrics in (metrics0, metrics1):
            close(metrics[key], whole_metrics[key], atol=1e-12)
    assert first0["ratio_mean"] == first1["ratio_mean"] == 1.0 and first0["ppo_kl"] == first1["ppo_kl"] == 0.0
    grad = torch.zeros_like(logp)
    grad[:, columns[0]], grad[:, columns[1]] = grad0, grad1
    close(grad, whole_logp.grad, atol=1e-12)
    assert whole_logp.grad.abs().sum() > 0
