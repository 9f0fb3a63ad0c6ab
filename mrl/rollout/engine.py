"""The rollout engine protocol: what the trainer asks of any inference backend.

Weights arrive as a stream of buckets between `begin_weight_update` and `finish_weight_update`;
the engine never needs the whole model in one piece. Prompt scoring (`score`) is the parity gate's
view of the engine: the log-probability the engine assigns to each given token.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from mrl.sync.wire import Bucket, WeightUpdateReport



@dataclass(frozen=True)
class SamplingSettings:
    """Sampling knobs passed through to the backend unchanged (defaults: greedy, 64 tokens)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    max_tokens: int = 64
    n: int = 1  # samples per prompt
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()  # besides EOS (an agent's turn: the chat template's end of turn)


def per_prompt(sampling: SamplingSettings | Sequence[SamplingSettings], prompts: int) -> list[SamplingSettings]:
    """One SamplingSettings per prompt, from one for all or one each (partial rollout's continued
    samples each have their own seed and token budget)."""
    if isinstance(sampling, SamplingSettings):
        return [sampling] * prompts
    if len(sampling) != prompts:
        raise ValueError(f"{len(sampling)} sampling settings for {prompts} prompts: give one, or one per prompt")
    return list(sampling)


def seeded_per_prompt(sampling: SamplingSettings, keys: Sequence[int]) -> list[SamplingSettings]:
    """One SamplingSettings per prompt, each with a seed of its own derived from `sampling.seed`
    and the prompt's key (e.g. its index in the data); None stays None (unseeded).

    vLLM gives every seeded request its own random generator, seeded with the request's seed, and
    draws a prompt's sample i from seed + i. Prompts sharing one seed would therefore draw sample i
    from the same noise: every prompt of a batch sampled with the same random numbers. A seed from
    the prompt's key, not its place in the batch, keeps its samples the same whichever engine,
    chunk or mode generates it."""
    if sampling.seed is None:
        return [sampling] * len(keys)
    return [replace(sampling, seed=_mix(sampling.seed, key)) for key in keys]


def _mix(seed: int, key: int) -> int:
    """A 56-bit seed from (seed, key): seed + i stays far below vLLM's and torch's limits."""
    return int.from_bytes(hashlib.blake2b(f"{seed}|{key}".encode(), digest_size=7).digest(), "big")


@dataclass
class Generation:
    """One sampled response: token ids, text, and the log-probability of each sampled token.

    `weight_version` is the number of weight updates the engine had finished when it generated
    this (0: the weights it started with), so a trace can tell which policy produced a sample.
    `token_versions` is that number per token: a sample continued across a weight update
    (async.partial_rollout) has tokens of two or more versions, and `weight_version` is then its
    oldest token's. `logprobs` are always the engine's, each under the weights that sampled it.
    finish_reason None: not finished (interrupted by a weight update, to be continued).
    `routed_experts` (rollout.return_routes, MoE models): the expert ids the engine routed each
    forwarded token to, [len(prompt_ids) + len(token_ids) - 1, MoE layers, top-k] (mrl/routes.py),
    each token's under the weights that forwarded it; None when not recorded (or no token yet).
    An agent's episode (mrl.agent.loop) is one Generation whose `token_ids` interleave the policy's
    turns with appended tool, environment or user tokens: `loss_mask` is 1 where the policy
    generated the token (None: every token, a plain sample), `logprobs` 0.0 elsewhere, and `agent`
    holds its turns, tool calls and conversation (Trajectory.stats)."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str | None = None
    weight_version: int | None = None
    token_versions: list[int] | None = None  # None: data from before this field (one version: weight_version)
    routed_experts: np.ndarray | None = field(default=None, compare=False)
    loss_mask: list[int] | None = None
    agent: dict | None = field(default=None, compare=False)

    def to_state(self) -> dict:
        """Plain data a checkpoint loads with weights_only: the routes as a tensor, not a numpy array."""
        state = asdict(self)
        if self.routed_experts is not None:
            state["routed_experts"] = torch.from_numpy(np.array(self.routed_experts))  # a copy: Ray's are read-only
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Generation:
        routes = state.get("routed_experts")
        return cls(**{**state, "routed_experts": routes.numpy() if isinstance(routes, torch.Tensor) else routes})

    def versions(self) -> list[int]:
        """Per token, the weight version that generated it."""
        if self.token_versions is not None:
            return list(self.token_versions)
        return [] if self.weight_version is None else [self.weight_version] * len(self.token_ids)


ROW_KEYS = ("prompt", "ground_truth", "metadata")  # what an episode gets of its dataset sample


@dataclass(frozen=True)
class Task:
    """A prompt with its dataset row: a run with an agent loop sends these to the rollout, and
    each episode gets the row as sample["row"] (mrl.agent.loop); the engine sees `prompt_ids`."""

    prompt_ids: list[int]
    row: dict

    @classmethod
    def of(cls, sample: dict) -> Task:
        """A tokenized dataset sample (mrl.inputs.tokenize_samples) as a Task."""
        return cls(sample["prompt_ids"], {key: sample.get(key) for key in ROW_KEYS})


def join_routes(prefix: Generation, rest: Generation, tokens: int) -> np.ndarray | None:
    """The routes of an interrupted sample (`prefix`) continued by `rest` (whose prompt is prefix's
    prompt and tokens), cut to the merged sample's first `tokens` tokens: each segment's rows from the
    weights that produced its tokens. The prefix's rows cover the positions that sampled its tokens;
    from its last token on (forwarded first by the continuation), the rows are the continuation's."""
    if prefix.routed_experts is None and rest.routed_experts is None:
        return None
    cut = len(prefix.prompt_ids) + len(prefix.token_ids) - 1  # positions the prefix's weights forwarded
    if rest.routed_experts is None or (prefix.token_ids and prefix.routed_experts is None):
        raise ValueError(f"a continued sample has routes for one segment only (prefix: "
                         f"{prefix.routed_experts is not None}, continuation: {rest.routed_experts is not None}): "
                         "every engine must run with rollout.return_routes")
    if prefix.token_ids and len(prefix.routed_experts) != cut:
        raise ValueError(f"an interrupted sample of {len(prefix.prompt_ids)} + {len(prefix.token_ids)} tokens has "
                         f"{len(prefix.routed_experts)} rows of routes, not {cut}")
    head = prefix.routed_experts if prefix.token_ids else rest.routed_experts[:0]  # no token: nothing it produced
    return np.concatenate([head, rest.routed_experts[len(head):]])[: len(prefix.prompt_ids) + tokens - 1]


def route_bytes_per_token(samples: Sequence[Generation]) -> float | None:
    """rollout/route_bytes_per_token: the routes' bytes over the tokens they cover (None: no routes)."""
    routes = [g.routed_experts for g in samples if g.routed_experts is not None]
    rows = sum(len(r) for r in routes)
    return sum(r.nbytes for r in routes) / rows if rows else None


class RolloutEngine(Protocol):
    def generate(self, prompts: Sequence[str | list[int]],
                 sampling: SamplingSettings | Sequence[SamplingSettings]) -> list[list[Generation]]:
        """Per prompt, `sampling.n` generations (`sampling`: one for all prompts or one per prompt)."""

    def interrupt(self) -> None:
        """From another thread: stop generating now; generate returns what it has (finish_reason
        None) until the next weight update finishes."""

    def score(self, sequences: Sequence[list[int]]) -> list[list[float]]:
        """Log-probability of tokens 1..n-1 of each sequence given its prefix (teacher forcing)."""

    def begin_weight_update(self) -> None: ...

    def load_weights(self, bucket: Bucket) -> None:
        """One bucket, whose tensors may be views of the sender's memory (CUDA IPC, or a /dev/shm
        file it reuses: mrl.sync.wire.reused), rewritten later: keep copies, not views, past the return. An engine that loads in other processes may also offer
        `load_shared(header, flat)`: the receiver then hands it buckets left in shared memory as
        their header (mrl.sync.wire.shared_bytes maps them in any process) and its own view.
        The sync reads three optional attributes: `device` ("cuda": a colocated trainer's GPU
        buckets come as CUDA IPC handles), `quantization` ("fp8") and `ipc_opens` (how many
        times its processes open a CUDA IPC bucket: the receiver's, then worker r's as opener
        1 + r; each open needs a handle of its own, mrl.sync.cuda_ipc). An engine whose workers
        receive their own slices (sync.transport routed, mrl.sync.routing) offers `routes()` (per
        worker, the HF boxes it needs) and `load_routed(header)`."""

    def finish_weight_update(self) -> WeightUpdateReport:
        """Post-load processing (e.g. MLA's derived matrices), prefix-cache reset, the report; the
        engine's weight version (stamped on each Generation) goes up by one."""

    def sleep(self) -> None:
        """Release accelerator memory between rollouts where the backend allows it. generate,
        score and begin_weight_update wake the engine themselves: no caller has to remember to."""

    def wake_up(self) -> None: ...
