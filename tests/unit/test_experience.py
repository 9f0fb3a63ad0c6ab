"""Generations → the actor's batch: every per-token tensor lines up with labels = tokens[:, 1:]."""

import pytest
import torch

from mrl.experience import rollout_batch, select_rows, sft_batch, split_rows
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


def test_split_rows_gives_mini_batches_of_whole_data_parallel_shares_in_batch_order():
    batch = {"tokens": torch.arange(16).unsqueeze(1), "advantages": torch.arange(16.0)}
    parts = split_rows(batch, 4, 2)  # 8 prompts × 2 samples, mini-batches of 2 prompts, DP2
    assert [p["tokens"].flatten().tolist() for p in parts] == [list(range(i, i + 4)) for i in (0, 4, 8, 12)]
    assert all(torch.equal(p["advantages"], p["tokens"].flatten().float()) for p in parts)  # every key alike
    assert split_rows(batch, 1, 2)[0]["tokens"].shape[0] == 16
    # a batch dynamic sampling shrank (6 rows, DP2) into 4 parts: runs of whole DP shares, none empty
    assert [p["tokens"].shape[0] for p in split_rows({"tokens": torch.zeros(6, 1)}, 4, 2)] == [2, 2, 2]


def test_train_epochs_steps_once_per_mini_batch_and_pass():
    from mrl.config import load_config
    from mrl.trainer import train_epochs

    recipe = "configs/tiny_cpu_grpo.yaml"  # 8 prompts × 8 samples, DP2
    cfg = load_config(recipe, ["trainer.ppo_mini_batch_size=2"], check_files=False)
    batch = {"tokens": torch.arange(64).unsqueeze(1)}
    seen = []

    def update(part):  # two DP ranks' answers, as a worker group returns them
        seen.append(part["tokens"].flatten().tolist())
        return [{"dp": 0, "loss": float(len(seen))}, {"dp": 1, "loss": float(len(seen))}]

    metrics = train_epochs(cfg, 2, batch, update)
    assert seen == [list(range(i, i + 16)) for i in (0, 16, 32, 48)] * 2  # 4 mini-batches, 2 passes
    assert metrics == {"loss": sum(range(1, 9)) / 8}
    seen.clear()
    train_epochs(load_config(recipe, [], check_files=False), 1, batch, update)
    assert seen == [list(range(64))]


def test_rollout_batch_carries_each_samples_checked_routes():
    import numpy as np

    from mrl.routes import RouteShape

    shape = RouteShape(layers=2, top_k=2, n_experts=8)
    first, second = _gen([5, 6, 7], [8, 9], [-0.1, -0.2]), _gen([11], [12, 13], [-0.4, -0.5])
    first.routed_experts = np.array([[[0, 1], [2, 3]]] * 4, dtype=np.uint8)  # 3 + 2 - 1 = 4 positions
    second.routed_experts = np.array([[[4, 5], [6, 7]]] * 2, dtype=np.uint8)  # 1 + 2 - 1 = 2
    batch = rollout_batch([[first, second]], [1.0, 0.0], route_shape=shape)
    assert batch["routes"].dtype == torch.uint8 and batch["routes"].shape == (2, 4, 2, 2)
    assert batch["routes_len"].tolist() == [4, 2]
    assert batch["routes"][1, :2].tolist() == [[[4, 5], [6, 7]]] * 2 and batch["routes"][1, 2:].sum() == 0
    assert "routes" not in rollout_batch([[first, second]], [1.0, 0.0])  # no shape: no routes
    second.routed_experts = second.routed_experts[:1]  # the engine forwarded 2 positions
    with pytest.raises(ValueError, match=r"sample 1: routes have shape \(1, 2, 2\), expected \(2, 2, 2\)"):
        rollout_batch([[first, second]], [1.0, 0.0], route_shape=shape)
    del second.routed_experts
    with pytest.raises(ValueError, match="sample 1: no routes"):
        rollout_batch([[first, second]], [1.0, 0.0], route_shape=shape)
