"""The rollout engine in its own Ray actor, with the engine side of the weight sync.

The actor runs one call at a time (generate, score, a weight receipt), in order, except
`interrupt`, which has a concurrency group of its own ("control") so that it reaches the engine
while a generate runs: it only sets the engine's interrupt flag, never touches vLLM; `shutdown`,
which stops the engine before the actor is killed, whatever it was doing; and, for an engine
started with `streaming` (async.streaming), `generate_streaming`, whose calls run at once on
threads of their own ("generate"), their requests in one running batch (VLLMEngine.generate). The
driver never sends a weight update while any generate is in flight (the engine refuses one)."""

from __future__ import annotations

import os
from typing import Any, Sequence

import ray

from mrl.rollout.engine import Generation, SamplingSettings
from mrl.sync.channel import SyncEndpoint
from mrl.sync.wire import WeightUpdateReport


# A streaming engine's generate calls in flight at once (each holds a thread of the actor while it
# waits for its requests); more queue in Ray until one returns.
STREAMING_CALLS = 128


class RolloutServer:
    """One vLLM engine and its weight receiver (runs inside a Ray actor process)."""

    def __init__(self, model: str, engine_options: dict[str, Any], sync_timeout_s: float = 300.0):
        from mrl.agent.runner import AgentSettings, EpisodeRunner
        from mrl.rollout.vllm_engine import VLLMEngine
        from mrl.sync.receiver import WeightReceiver

        agent = AgentSettings(**engine_options.get("agent", {}))  # every rollout runs as episodes (none: plain)
        # multi-turn episodes take turns whenever their tools answer: a streaming engine batches them as they
        # come (agent.turn_batching rounds: a plain engine, one call a round)
        multi_turn = agent.loop not in ("none", "single_turn")
        streaming = {"streaming": True} if multi_turn and agent.turn_batching == "streaming" else {}
        self.engine = VLLMEngine(model, **{k: v for k, v in engine_options.items() if k != "agent"} | streaming)
        self.episodes = EpisodeRunner(self.engine, agent)
        self.receiver = WeightReceiver(self.engine, host=ray.util.get_node_ip_address(), timeout_s=sync_timeout_s)

    def endpoint(self):
        return self.receiver.endpoint

    def node_ip(self) -> str:
        """The node this engine runs on: a fleet names it when the engine fails."""
        return ray.util.get_node_ip_address()

    def place(self) -> dict:
        """Ray's id of that node and the GPUs the engine's workers see (the run's map, ranks.json)."""
        return engine_place()

    def receive_weights(self, sync_id: str, channels: int, engines: int = 1, index: int = 0,
                        hub: SyncEndpoint | None = None) -> WeightUpdateReport:
        """This engine's part of an update (engine `index` of `engines`; `hub` is engine 0's endpoint
        for the others). Holds this (single-threaded) actor until the update is complete: ask for
        endpoint() first."""
        return self.receiver.receive(sync_id, channels, engines, index, hub)

    def load_checkpoint(self, model_dir: str, weight_version: int = 0) -> WeightUpdateReport:
        """Load a HuggingFace checkpoint from disk through the engine's own update path (the same
        apply and checks as a sync), one safetensors file a bucket, clear the KV cache and tag the
        generations that follow with `weight_version`: the engine is then as if started on it."""
        from pathlib import Path

        from safetensors.torch import load_file

        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {model_dir}: pass a HuggingFace model directory")
        self.engine.begin_weight_update()
        for file in files:
            self.engine.load_weights(sorted(load_file(file).items()))
        report = self.engine.finish_weight_update()
        self.engine.clear_kv_cache()
        self.engine.weight_version = weight_version
        return report

    def set_weight_version(self, version: int) -> None:
        """A restarted engine takes its peers' weight version before its first update, so that
        its generations carry the versions theirs do (mrl/launch/restarts.py)."""
        self.engine.weight_version = version

    def generate(self, prompts: Sequence[list[int]],
                 sampling: SamplingSettings | Sequence[SamplingSettings]) -> list[list[Generation]]:
        """Per prompt its samples: its episodes (mrl.agent.runner; plain samples without an agent)."""
        return self.episodes.generate(prompts, sampling)

    @ray.method(concurrency_group="generate")
    def generate_streaming(self, prompts: Sequence[list[int]],
                           sampling: SamplingSettings | Sequence[SamplingSettings]) -> list[list[Generation]]:
        """generate, beside the other generate_streaming calls in flight (async.streaming)."""
        return self.episodes.generate(prompts, sampling)

    @ray.method(concurrency_group="control")
    def interrupt(self) -> None:
        """async.partial_rollout: the generate running now returns its samples as they are, and so
        do the generates queued behind it, until the next weight update (VLLMEngine.interrupt)."""
        self.engine.interrupt()

    def score(self, sequences: Sequence[list[int]]) -> list[list[float]]:
        return self.engine.score(sequences)

    def sleep(self) -> None:
        """Free accelerator memory until the next generate, score or weight update (which wake it)."""
        self.engine.sleep()

    @ray.method(concurrency_group="control")
    def shutdown(self) -> None:
        """Stop the engine's workers before the actor is killed: a killed actor whose engine has worker
        processes (TP > 1) leaves vLLM's message queues behind in /dev/shm (two files an engine, never freed)."""
        self.episodes.close()  # the agent's tool threads and endpoint first: they call the engine
        self.engine.shutdown()


def engine_place() -> dict:
    """Where this process of an engine runs: Ray's node id, CUDA_VISIBLE_DEVICES (None: unset)."""
    return {"node_id": ray.get_runtime_context().get_node_id(), "devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


# The engine core runs in the actor's process (no hidden engine core process).
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}


def launch_rollout_actor(model: str, engine_options: dict[str, Any], *, num_cpus: float = 1,
                         num_gpus: float = 0, sync_timeout_s: float = 300.0, strategy: Any = None,
                         env: dict[str, str] | None = None) -> Any:
    """Start the actor without waiting for its engine (a fleet starts several, then waits once);
    `strategy`: where Ray places it (a placement-group bundle: mrl.launch.engine_nodes); `env`: added
    to its environment (colocated on GPUs: the GPUs its workers see)."""
    # interrupt() runs in a group of its own, generate_streaming() in another (a thread per call in
    # flight); every other call in the default group, one at a time
    groups = {"control": 1, "generate": STREAMING_CALLS if engine_options.get("streaming") else 1}
    return ray.remote(concurrency_groups=groups)(RolloutServer).options(
        num_cpus=num_cpus, num_gpus=num_gpus, runtime_env={"env_vars": ENGINE_ENV | (env or {})},
        scheduling_strategy=strategy,
    ).remote(model, engine_options, sync_timeout_s)


def start_rollout_actor(model: str, engine_options: dict[str, Any], *, num_cpus: float = 1,
                        num_gpus: float = 0, sync_timeout_s: float = 300.0, start_timeout_s: float = 600.0) -> Any:
    """Start the actor and wait until its engine is up: an engine that fails or hangs raises here."""
    actor = launch_rollout_actor(model, engine_options, num_cpus=num_cpus, num_gpus=num_gpus,
                                 sync_timeout_s=sync_timeout_s)
    try:
        ray.get(actor.endpoint.remote(), timeout=start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.kill(actor)
        raise TimeoutError(
            f"the vLLM engine for {model} did not start within {start_timeout_s:.0f}s "
            f"(options {engine_options}); its log is in the Ray session's worker logs; raise "
            "rollout.start_timeout_s if it is only slow"
        ) from None
    return actor
