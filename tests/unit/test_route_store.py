"""The engine side of MoE routes without vLLM: the store that files each forward's rows by request
and serves prefix-cache hits from cached blocks (mrl/rollout/route_store.py), a continued sample's
routes joined per segment, routes in a checkpoint's state, and the setting's checks."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from mrl.config import ConfigError, load_config
from mrl.modes import GeneratedBatch, continue_generation
from mrl.rollout.detokenize import SampleText
from mrl.rollout.engine import Generation, join_routes, route_bytes_per_token
from mrl.rollout.route_store import RouteError, RouteStore

LAYERS, TOP_K, BLOCK = 2, 2, 4


def rows(first: int, count: int) -> np.ndarray:
    """Distinct rows for positions first..first+count-1 (the row of position p holds p, p + 1)."""
    p = np.arange(first, first + count)
    return np.stack([np.stack([p, p + 1], -1)] * LAYERS, 1).astype(np.uint8)  # [count, L, K]


def store(retired: int = 8) -> RouteStore:
    return RouteStore(LAYERS, TOP_K, np.uint8, BLOCK, retired)


def test_prefill_then_decode_steps_give_the_forwarded_rows():
    s, tokens = store(), np.arange(100, 110)
    s.record("mrl-0", 0, rows(0, 6), tokens)  # prefill of a 6-token prompt
    s.record("mrl-0", 6, rows(6, 1), tokens)  # two decode steps
    s.record("mrl-0", 7, rows(7, 1), tokens)
    np.testing.assert_array_equal(s.take("mrl-0", 8), rows(0, 8))  # prompt 6 + 3 tokens - 1
    assert len(s) == 0


def test_a_prefix_cache_hit_gets_the_cached_blocks_rows():
    s, prompt = store(), np.arange(200, 210)
    s.record("mrl-0", 0, rows(0, 10), prompt)
    s.record("mrl-1", 8, rows(8, 2), prompt)  # vLLM served two full blocks (8 tokens) from its cache
    np.testing.assert_array_equal(s.take("mrl-1", 10), rows(0, 10))
    assert s.copied_rows == 8
    other = prompt.copy()
    other[5] += 1  # another prompt from token 5 on: only its first block may come from the cache
    s.record("mrl-2", 8, rows(8, 2), other)
    with pytest.raises(RouteError, match="mrl-2: no routes for token 4 of 10"):
        s.take("mrl-2", 10)


def test_cached_blocks_outlive_their_request_for_the_retired_budget():
    s, prompt = store(retired=2), np.arange(300, 312)  # 3 blocks
    s.record("0", 0, rows(0, 12), prompt)  # not ours (e.g. prompt scoring): dropped once out of the batch
    s.forget(keep={"0"}, ours="mrl-")
    assert len(s) == 1
    s.forget(keep=set(), ours="mrl-")
    assert len(s) == 0
    s.record("mrl-1", 4, rows(4, 1), prompt)  # block 0 retired last among 3, 2 kept: blocks 1 and 2
    with pytest.raises(RouteError, match="token 0 of 5"):
        s.take("mrl-1", 5)
    s.record("mrl-2", 8, rows(8, 1), prompt)
    assert s.copied_rows == 0  # block 0 gone: the chain breaks at once
    s.reset()
    with pytest.raises(RouteError, match="no routes recorded"):
        s.take("mrl-2", 9)


def test_rows_never_forwarded_are_refused_not_zero():
    s = store()
    s.record("mrl-0", 0, rows(0, 3), np.arange(3))
    with pytest.raises(RouteError, match="no routes for token 3 of 5"):
        s.take("mrl-0", 5)
    assert s.take("mrl-9", 0).shape == (0, LAYERS, TOP_K)  # a request without a token has no rows to give


def sample(prompt: list[int], tokens: list[int], routes: np.ndarray | None, version: int) -> Generation:
    return Generation(prompt, tokens, "", [-0.5] * len(tokens), None, version, [version] * len(tokens), routes)


def plain(prompt_ids, token_ids, stop_terminated):
    return SampleText("t" * len(token_ids), len(token_ids), None)


def test_a_continued_sample_keeps_each_segments_routes():
    prompt, first, second = [1, 2, 3], [4, 5], [6, 7, 8]
    old = sample(prompt, first, rows(0, 4), 0)  # 3 + 2 - 1 rows under the old weights
    new_rows = rows(0, 7) + 100  # the continuation forwarded everything again under the new weights
    rest = sample(prompt + first, second, new_rows, 1)
    rest.finish_reason = "length"
    merged = continue_generation(old, rest, plain)
    expected = np.concatenate([rows(0, 4), new_rows[4:]])  # position 4 (token 5) produced token 6: new weights
    np.testing.assert_array_equal(merged.routed_experts, expected)
    assert len(merged.routed_experts) == len(prompt) + len(merged.token_ids) - 1
    # a prefix without a token: the continuation's rows alone; a stop inside cuts the rows with the tokens
    np.testing.assert_array_equal(join_routes(sample(prompt, [], None, 0), rest, 3), new_rows[:5])
    np.testing.assert_array_equal(join_routes(old, rest, 3), expected[:5])
    with pytest.raises(ValueError, match="routes for one segment only"):
        join_routes(old, sample(prompt + first, second, None, 1), 5)


def test_routes_survive_a_checkpoints_weights_only_load():
    routes = rows(0, 4)
    batch = GeneratedBatch(3, [0], [[sample([1, 2, 3], [4, 5], routes, 1), sample([1], [2], None, 1)]], 0, 1.0)
    buffer = io.BytesIO()
    torch.save(batch.to_state(), buffer)
    buffer.seek(0)
    loaded = GeneratedBatch.from_state(torch.load(buffer, weights_only=True))
    got = loaded.groups[0][0].routed_experts
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, routes)
    assert loaded.groups[0][1].routed_experts is None
    assert route_bytes_per_token([g for group in loaded.groups for g in group]) == LAYERS * TOP_K


CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_return_routes_is_off_by_default_and_needs_a_moe_model():
    tiny = CONFIGS / "tiny_cpu_grpo.yaml"
    assert load_config(tiny, [], check_files=False).rollout.return_routes is False
    assert load_config(tiny, ["rollout.return_routes=true"], check_files=False).rollout.return_routes
    with pytest.raises(ConfigError) as info:
        load_config(tiny, ["rollout.return_routes=true", "model.tiny=qwen3"], check_files=False)
    assert info.value.errors[-1] == ("rollout.return_routes records MoE routes, but the model has no experts: "
                                     "set it to false.")  # (after the recipe's expert layout, refused too)
