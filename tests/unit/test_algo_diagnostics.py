"""mrl.algo.diagnostics against statistics worked out by hand."""

import pytest
import torch

from mrl.algo import advantage_metrics, explained_variance

t = torch.tensor


def test_advantage_metrics_by_hand_ignore_padding():
    mask = t([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    returns = t([[1.0, 1.0, 50.0], [0.0, 0.0, 0.0]])  # 50 sits on padding and must be ignored
    values = t([[0.5, 1.0, -9.0], [0.5, 0.0, 0.0]])
    advantages = t([[2.0, -1.0, 7.0], [0.0, 1.0, -3.0]])
    m = advantage_metrics({"response_mask": mask, "returns": returns, "values": values, "advantages": advantages})
    # returns over tokens: 1, 1, 0, 0, 0 → mean 0.4, var 0.24; errors 0.5, 0, -0.5, 0, 0 → mean 0, var 0.1
    assert m["critic/returns_mean"] == pytest.approx(0.4)
    assert (m["critic/returns_max"], m["critic/returns_min"]) == (1.0, 0.0)
    assert m["critic/values_mean"] == pytest.approx(0.4)
    assert (m["critic/values_max"], m["critic/values_min"]) == (1.0, 0.0)
    assert m["critic/advantages_mean"] == pytest.approx(-0.2)
    assert (m["critic/advantages_max"], m["critic/advantages_min"]) == (2.0, -3.0)
    assert m["critic/vf_explained_var"] == pytest.approx(1 - 0.1 / 0.24)


def test_advantage_metrics_without_a_critic_have_no_value_keys():
    mask = t([[1.0, 0.0]])
    m = advantage_metrics({"response_mask": mask, "returns": t([[1.0, 3.0]]), "advantages": t([[0.5, 3.0]])})
    assert m == {"critic/advantages_mean": 0.5, "critic/advantages_max": 0.5, "critic/advantages_min": 0.5,
                 "critic/returns_mean": 1.0, "critic/returns_max": 1.0, "critic/returns_min": 1.0}


def test_explained_variance_perfect_mean_and_worse_critics():
    returns, mask = t([[0.0, 1.0, 0.0, 1.0]]), torch.ones(1, 4)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 0.5), returns, mask) == pytest.approx(0.0)
    assert explained_variance(1 - returns, returns, mask) == pytest.approx(-3.0)  # errors ±1: var 1 vs 0.25
    assert explained_variance(returns, torch.ones(1, 4), mask) == 0.0  # constant targets: nothing to explain
