"""Micro-batching of rollout batches (mrl.megatron.policy.micro_batches): no process group needed."""

from __future__ import annotations

import pytest
import torch

from mrl.megatron.policy import ActorLoss, micro_batches, restore_order


def _batch(lengths: list[int], width: int = 12, prompt: int = 3) -> dict:
    """Rows of `prompt` prompt tokens + lengths[i] response tokens, right-padded to width+1 tokens."""
    generator = torch.Generator().manual_seed(0)
    count = len(lengths)
    tokens = torch.zeros(count, width + 1, dtype=torch.long)
    mask = torch.zeros(count, width)
    for row, length in enumerate(lengths):
        tokens[row, : prompt + length] = torch.randint(1, 100, (prompt + length,), generator=generator)
        mask[row, prompt - 1 : prompt - 1 + length] = 1.0
    return {"tokens": tokens, "response_mask": mask, "advantages": torch.randn(count, width, generator=generator),
            "old_logprobs": -torch.rand(count, width, generator=generator)}


def test_token_budget_equal_shapes_cover_once_and_restore_order():
    batch = _batch([2, 5, 1, 4, 3])  # last response label at column 3 - 1 + 5 - 1 = 6: 7 columns kept
    micro = micro_batches(batch, tp=2, micro_batch_size=1, max_tokens_per_micro_batch=17)
    assert {tuple(m["tokens"].shape) for m in micro} == {(2, 8)}  # 7 → 8 (TP multiple); 17 // 8 = 2 rows
    for m in micro:
        assert {tuple(m[k].shape) for k in ("labels", "response_mask", "advantages", "old_logprobs")} == {(2, 8)}
        assert torch.equal(m["loss_mask"], m["response_mask"])
        assert m["tokens"].numel() <= 17
    index = torch.cat([m["index"] for m in micro])
    assert sorted(index[index >= 0].tolist()) == list(range(5)) and (index < 0).sum() == 1
    # Input/label shift and the per-token tensors line up with the original rows.
    for m in micro:
        for row, original in enumerate(m["index"].tolist()):
            if original < 0:
                assert m["tokens"][row].eq(0).all() and m["response_mask"][row].eq(0).all()
                continue
            assert torch.equal(m["tokens"][row, :7], batch["tokens"][original, :7])
            assert torch.equal(m["labels"][row, :7], batch["tokens"][original, 1:8])
            assert torch.equal(m["advantages"][row, :7], batch["advantages"][original, :7])
    restored = restore_order([m["old_logprobs"] for m in micro], micro, 5, 12)
    expected = batch["old_logprobs"].clone()
    expected[:, 7:] = 0.0  # trimmed columns come back as zeros
    assert torch.equal(restored, expected)


def test_loss_weights_make_token_mean_over_the_whole_batch():
    batch = _batch([2, 5, 1, 4, 3])
    micro = micro_batches(batch, tp=1, micro_batch_size=2)
    values = torch.randn(5, 12)
    whole = (values * batch["response_mask"]).sum() / batch["response_mask"].sum()
    per_micro = []
    for m in micro:
        rows = m["index"].clamp(min=0)
        mb_values = values[rows, : m["tokens"].shape[1]]
        mean = (mb_values * m["response_mask"]).sum() / m["response_mask"].sum().clamp(min=1)
        per_micro.append(mean * m["loss_scale_tokens"])
    # The pipeline schedule averages the micro-batch losses.
    assert torch.allclose(torch.stack(per_micro).mean(), whole)


def test_no_budget_and_no_response_labels():
    batch = _batch([2, 5, 1])
    micro = micro_batches(batch, tp=1, micro_batch_size=2)
    assert [tuple(m["tokens"].shape) for m in micro] == [(2, 7), (2, 7)]
    empty = {"tokens": batch["tokens"], "response_mask": torch.zeros(3, 12)}
    assert [tuple(m["tokens"].shape) for m in micro_batches(empty, tp=4, micro_batch_size=8)] == [(3, 4)]


def test_bad_input_errors():
    batch = _batch([2, 5])
    with pytest.raises(ValueError, match="raise it to at least 8"):
        micro_batches(batch, tp=2, micro_batch_size=1, max_tokens_per_micro_batch=5)
    with pytest.raises(ValueError, match="advantages"):
        micro_batches({**batch, "advantages": torch.zeros(2, 3)}, tp=1, micro_batch_size=1)
    with pytest.raises(ValueError, match="response_mask"):
        micro_batches({"tokens": batch["tokens"]}, tp=1, micro_batch_size=1)


def test_actor_loss_reads_algo_config_and_dicts():
    from mrl.config.schema import AlgoConfig

    config = ActorLoss.of(AlgoConfig(policy_loss="dapo", clip_high=0.28, kl_coef=0.1, kl_in_reward=True))
    assert config.policy_loss == "dapo" and config.clip_high == 0.28 and not config.kl_in_loss
    assert ActorLoss.of({"kl_coef": 0.1}).kl_in_loss and ActorLoss.of({}).clip_low == 0.2


def test_unknown_aggregation_fails_before_any_step():
    from mrl.megatron.policy import policy_loss_fn

    with pytest.raises(ValueError, match="bogus"):
        policy_loss_fn({"aggregation": "bogus"})
