"""What the OpenAI-compatible endpoint (mrl/agent/openai_server.py) adds per call, against the
generate handle called directly.

A fake handle answers with --tokens tokens, at once or after --engine-ms. Direct: the handle awaited
with prompt ids rendered before the clock starts, --turns calls per episode. Endpoint: the same handle behind uvicorn on
127.0.0.1, driven by AsyncOpenAI (in a process of its own) with chat messages: each turn appends
the reply and a user message, so the endpoint renders only the delta (token-in/token-out), parses
tool calls and records. Per setting: latency per call (p50, p95), the added milliseconds (mean), the
calls/s of --episodes concurrent episodes and their ratio (target >= 0.9 in issue 40), and the
endpoint's own CPU time per call (its process: HTTP, JSON, rendering, parsing, recording).

    .venv/bin/python benchmarks/agent_endpoint.py [--episodes 1,16] [--engine-ms 0,50] [--turns 4]
        [--repeats 25] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import multiprocessing
import queue

import openai

from mrl.agent.chat import ChatRenderer
from mrl.agent.openai_server import LocalServer, OpenAIEndpoint
from mrl.rollout.engine import Generation, SamplingSettings

TEMPLATE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "chat_templates" / "qwen2_5.jinja"


def tokenizer():
    from transformers import PreTrainedTokenizerFast

    from mrl.models.tiny import build_tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), eos_token="<|im_end|>", pad_token="<pad>")
    tok.chat_template = TEMPLATE.read_text()
    return tok


class Handle:
    """A generate handle with a fixed answer of `tokens` tokens (the last one <|im_end|>)."""

    def __init__(self, tok, tokens: int, engine_s: float):
        words = tok.encode(" the answer is 42." * tokens, add_special_tokens=False)[: tokens - 1]
        self.ids = words + [tok.convert_tokens_to_ids("<|im_end|>")]
        self.text, self.engine_s = tok.decode(words), engine_s

    async def __call__(self, prompt_ids: list[int], sampling: SamplingSettings) -> Generation:
        if self.engine_s:
            await asyncio.sleep(self.engine_s)
        return Generation(prompt_ids, list(self.ids), self.text, [-0.1] * len(self.ids), "stop", 0, [0] * len(self.ids))


def first_messages(episode: int) -> list[dict]:
    return [{"role": "system", "content": "answer briefly."}, {"role": "user", "content": f"question {episode}?"}]


def prepared(renderer: ChatRenderer, episodes: int, turns: int) -> dict[int, tuple[list[int], list[list[int]]]]:
    """Per episode, its first prompt ids and each turn's appended ids, made before the clock starts."""
    deltas = [renderer.append_ids([{"role": "user", "content": f"and then {t}?"}]) for t in range(turns)]
    return {e: (renderer.prompt_ids(first_messages(e)), deltas) for e in range(episodes)}


async def direct_episode(handle: Handle, prompts: dict, episode: int, turns: int, out: list[float]) -> None:
    prompt, deltas = prompts[episode]
    for turn in range(turns):
        start = time.perf_counter()
        generation = await handle(prompt, SamplingSettings(max_tokens=len(handle.ids)))
        out.append(time.perf_counter() - start)
        prompt = prompt + generation.token_ids + deltas[turn]


async def endpoint_episode(base: openai.AsyncOpenAI, root: str, episode: int, turns: int, out: list[float]) -> None:
    # with_options shares the base client's connections; a new client per episode pays ~30 ms for its
    # SSL context (httpx loads the CA bundle) before its first call.
    client = base.with_options(base_url=f"{root}/episodes/e{episode}/v1")
    messages = first_messages(episode)
    for turn in range(turns):
        start = time.perf_counter()
        response = await client.chat.completions.create(model="policy", messages=messages)
        out.append(time.perf_counter() - start)
        messages += [response.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": f"and then {turn}?"}]


async def agents(root: str, episodes: int, repeats: int, turns: int) -> tuple[list[float], float, float]:
    base = openai.AsyncOpenAI(base_url=f"{root}/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        return await timed(lambda e, out: endpoint_episode(base, root, e, turns, out), episodes, repeats)
    finally:
        await base.close()


def agent_process(root: str, episodes: int, repeats: int, turns: int, results: multiprocessing.Queue) -> None:
    """The agents, in a process of their own: the endpoint's process then spends only its own CPU."""
    results.put(asyncio.run(agents(root, episodes, repeats, turns)))


def through_endpoint(root: str, episodes: int, repeats: int, turns: int) -> tuple[list[float], float, float]:
    """The agents' latencies and calls/s, and this process's (the endpoint's) CPU ms per call."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=agent_process, args=(root, episodes, repeats, turns, results))
    cpu = time.process_time()
    child.start()
    try:
        latencies, rate, _ = results.get(timeout=600)
    except queue.Empty:
        raise TimeoutError("waited 600 s for the agent process's results") from None
    finally:
        child.join(60)
    return latencies, rate, 1e3 * (time.process_time() - cpu) / len(latencies)


async def timed(make, episodes: int, repeats: int) -> tuple[list[float], float, float]:
    """Per-call latencies, calls/s and this process's CPU ms per call of `repeats` rounds of
    `episodes` concurrent episodes."""
    latencies: list[float] = []
    start, cpu = time.perf_counter(), time.process_time()
    for round_ in range(repeats):
        await asyncio.wait_for(asyncio.gather(*(make(round_ * episodes + e, latencies) for e in range(episodes))), 600)
    calls = len(latencies)
    return latencies, calls / (time.perf_counter() - start), 1e3 * (time.process_time() - cpu) / calls


def ms(values: list[float], q: float) -> float:
    return 1e3 * statistics.quantiles(values, n=100)[int(q) - 1] if q < 100 else 1e3 * max(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", default="1,16")
    parser.add_argument("--engine-ms", default="0,50")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    tok = tokenizer()
    renderer = ChatRenderer(tok)
    print(f"{'episodes':>8} {'engine':>7} | {'direct ms p50/p95':>18} | {'endpoint ms p50/p95':>20} | "
          f"{'added ms mean':>13} | {'calls/s direct':>14} {'endpoint':>9} {'ratio':>6} | {'endpoint CPU ms/call':>20}")
    for engine_ms in (float(x) for x in args.engine_ms.split(",")):
        handle = Handle(tok, args.tokens, engine_ms / 1e3)
        endpoint = OpenAIEndpoint(handle, tok, renderer=renderer, defaults=SamplingSettings(max_tokens=args.tokens))
        with LocalServer(endpoint.app) as server:
            for episodes in (int(x) for x in args.episodes.split(",")):
                prompts = prepared(renderer, episodes * args.repeats, args.turns)
                direct, direct_rate, _ = asyncio.run(timed(
                    lambda e, out: direct_episode(handle, prompts, e, args.turns, out), episodes, args.repeats))
                root = f"http://{server.host}:{server.port}"
                through, served_rate, served_cpu = through_endpoint(root, episodes, args.repeats, args.turns)
                assert all(endpoint.assemble(e, pop=True)[0].linear for e in endpoint.log.episodes())
                added = 1e3 * (statistics.mean(through) - statistics.mean(direct))
                print(f"{episodes:>8} {engine_ms:>5.0f}ms | {ms(direct, 50):>8.2f} /{ms(direct, 95):>8.2f} | "
                      f"{ms(through, 50):>9.2f} /{ms(through, 95):>9.2f} | {added:>13.2f} | "
                      f"{direct_rate:>14.1f} {served_rate:>9.1f} {served_rate / direct_rate:>6.2f} | "
                      f"{served_cpu:>20.2f}")


if __name__ == "__main__":
    main()
