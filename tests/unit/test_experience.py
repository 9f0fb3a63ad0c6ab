"""Generations → the actor's batch: every per-token tensor lines up with labels = tokens[:, 1:]."""

import pytest
import torch

from mrl.experience import rollout_batch, select_rows, sft_batch
from mrl.rollout.engine import Generation


def _gen(prompt, response, logprobs):
    return Generation(prompt_ids=prompt, token_ids=response, text="", logprobs=logprobs)


def test_rollout_batch_aligns_responses_rewards_and_logprobs_with_labels():
    groups = [[_gen([5, 6, 7], [8, 9], [-0.1, -0.2]), _gen([5, 6, 7], [10], [-0.3])],
              [_gen([11], [12, 13, 14], [-0.4, -0.5, -0.6])]]
    batch = rollout_batch(groups, [1.0, 0.0, 0.5])
    assert batch["tokens"].tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 10, 0], [11, 12, 13, 14, 0]]
    labels = batch["tokens"][:, 1:]
    mask = batch["response_mask"].bool()
    # The masked labels are exactly the response tokens, in order.
    assert [labels[i][mask[i]].tolist() for i in range(3)] == [[8, 9], [10], [12, 13, 14]]
    assert batch["token_level_rewards"].tolist() == [[0, 0, 0, 1.0], [0, 0, 0, 0], [0, 0, 0.5, 0]]
    assert torch.allclose(batch["rollout_logprobs"][mask], torch.tensor([-0.1, -0.2, -0.3, -0.4, -0.5, -0.6]))
    assert batch["group_ids"].tolist() == [0, 0, 1]
    kept = select_rows(batch, torch.tensor([True, False, True]))
    assert kept["tokens"].shape == (2, 5) and kept["group_ids"].tolist() == [0, 1]
    assert kept["sample_ids"].tolist() == [0, 2]  # a kept row still knows which sample it is


def test_sft_batch_trains_on_the_target_only():
    batch = sft_batch([[1, 2, 3], [4]], [[7, 2], [8, 9, 2]])
    labels, mask = batch["tokens"][:, 1:], batch["response_mask"].bool()
    assert [labels[i][mask[i]].tolist() for i in range(2)] == [[7, 2], [8, 9, 2]]


def test_packed_sft_batch_keeps_sequences_apart():
    from mrl.experience import packed_sft_batch

    prompts, targets = [[1, 2, 3], [4], [5, 6]], [[7, 2], [8, 9, 2], [10]]  # lengths 5, 4, 3
    batch = packed_sft_batch(prompts, targets, row_tokens=8, rows_multiple=2)
    # First fit by decreasing length: [5 tokens + 3 tokens], [4 tokens]; no 3rd row (2 is a multiple of 2).
    assert batch["tokens"].tolist() == [[1, 2, 3, 7, 2, 5, 6, 10], [4, 8, 9, 2, 0, 0, 0, 0]]
    assert batch["segments"].tolist() == [[1, 1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 0, 0, 0]]
    labels, mask = batch["tokens"][:, 1:], batch["response_mask"].bool()
    # Only target tokens are labels; the label from one sequence's end into the next (2 → 5) is not.
    assert [labels[i][mask[i]].tolist() for i in range(2)] == [[7, 2, 10], [8, 9, 2]]
    assert packed_sft_batch(prompts, targets, row_tokens=8, rows_multiple=4)["tokens"].shape == (4, 8)
    with pytest.raises(ValueError, match="raise trainer.sft_pack_tokens to at least 5"):
        packed_sft_batch(prompts, targets, row_tokens=4)
