"""Rollout throughput through mrl's engine against calling vLLM directly, on the same prompts.

One vLLM engine (one per process), three ways to generate the same batch, each best of --repeats:
  - direct: `LLM.generate(prompts, SamplingParams)`, outputs untouched;
  - mrl: `VLLMEngine.generate(prompts, SamplingSettings)`, which also converts every output into
    `Generation` records (token ids, text, per-token logprobs);
  - mrl stepping: the same engine as started for partial rollout (`interruptible`): one request a
    sample, and mrl steps vLLM itself so that a weight push can interrupt it;
  - mrl via Ray: the same call on the engine in its Ray actor (what the trainer uses), which adds
    the actor round trip, the serialisation of the results and the episode runner every rollout
    goes through (one-turn episodes, mrl/agent/runner.py) (a second engine, in the actor).
Generated tokens per second; the overhead is 1 − (mrl tokens/s ÷ direct tokens/s).

    .venv/bin/python benchmarks/rollout_overhead.py [--model DIR] [--prompts 64] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ENGINE = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=256 << 20)


def best_tokens_per_s(fns: dict, repeats: int) -> dict[str, float]:
    """Best tokens/s of each function over `repeats` rounds; the functions take turns within a
    round, so load on the shared machine affects them alike."""
    best = dict.fromkeys(fns, 0.0)
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            tokens = fn()
            best[name] = max(best[name], tokens / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF model directory (default: the tiny Qwen3 of the zoo)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-ray", action="store_true")
    args = parser.parse_args()

    from vllm import SamplingParams

    from mrl.models.tiny import write_tiny_model
    from mrl.rollout.engine import SamplingSettings
    from mrl.rollout.vllm_engine import VLLMEngine

    model = args.model or str(write_tiny_model("qwen3", tempfile.mkdtemp(prefix="mrl-bench-") + "/qwen3"))
    settings = SamplingSettings(temperature=1.0, max_tokens=args.tokens, ignore_eos=True, seed=0)
    params = SamplingParams(temperature=1.0, max_tokens=args.tokens, ignore_eos=True, seed=0, logprobs=0)
    engine = VLLMEngine(model, **ENGINE)
    tokenizer = engine.llm.get_tokenizer()  # token ids, as mrl's rollouts send them
    prompts = [tokenizer(f"{i}+{2 * i + 1}=").input_ids for i in range(args.prompts)]

    def direct() -> int:
        outputs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outputs for c in o.outputs)

    def through_mrl() -> int:
        return sum(len(g.token_ids) for per_prompt in engine.generate(prompts, settings) for g in per_prompt)

    def stepping() -> int:
        engine.interruptible = True  # only which path generate takes: the engine is the same
        try:
            return through_mrl()
        finally:
            engine.interruptible = False

    direct(), through_mrl(), stepping()  # warm-up
    result = {"prompts": args.prompts, "tokens_per_prompt": args.tokens}
    best = best_tokens_per_s({"direct": direct, "mrl": through_mrl, "mrl_stepping": stepping}, args.repeats)
    result["direct_tok_s"], result["mrl_tok_s"] = best["direct"], best["mrl"]
    result["mrl_overhead"] = 1 - result["mrl_tok_s"] / result["direct_tok_s"]
    result["mrl_stepping_tok_s"] = best["mrl_stepping"]
    result["mrl_stepping_overhead"] = 1 - result["mrl_stepping_tok_s"] / result["direct_tok_s"]
    if not args.no_ray:
        import ray

        from mrl.launch.rollout_actor import start_rollout_actor

        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        actor = start_rollout_actor(model, ENGINE)

        def through_ray() -> int:
            outs = ray.get(actor.generate.remote(prompts, settings))
            return sum(len(g.token_ids) for per_prompt in outs for g in per_prompt)

        through_ray()
        result["ray_tok_s"] = best_tokens_per_s({"ray": through_ray}, args.repeats)["ray"]
        result["ray_overhead"] = 1 - result["ray_tok_s"] / result["direct_tok_s"]
        ray.shutdown()
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
