"""One rank of the Megatron actor (or of a PPO critic): what a trainer worker process holds and the
work it is asked to do.

A plain class (no Ray): mrl/launch/worker_group.py runs one per process as a Ray actor, and the
driver calls it through the typed proxy mrl.launch.proxies.ActorGroup; tests may run it under
run_local. It sits above megatron, bridge and sync (it joins them), so none of those imports it.
Every method except `address` is collective: the driver calls it on every rank at once with the
same arguments.

Batches arrive whole on every rank (see mrl/experience.py for their layout); each rank keeps the
rows of its data-parallel slice. Results come back from one rank per DP slice (the last pipeline
stage, TP rank 0, CP rank 0) as {"dp": dp_rank, ...}; every other rank returns None.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mrl.config.schema import OptimConfig, Recompute, SyncConfig
from mrl.layout import ParallelLayout
from mrl.profiling import TraceRecorder, stage, trace_file
from mrl.sync.channel import SyncEndpoint


@dataclass
class ActorSetup:
    """What a rank needs to build its part of the actor (plain data: it crosses process boundaries)."""

    hf_dir: str
    layout: ParallelLayout
    params_dtype: str = "float32"
    transformer_impl: str = "auto"
    recompute: Recompute = field(default_factory=Recompute)
    fp8: str | None = None  # model.fp8: Transformer Engine's FP8 recipe for the training GEMMs
    seed: int = 0
    optim: OptimConfig = field(default_factory=OptimConfig)  # also the update's micro-batching
    reference: bool = False  # keep a frozen copy of the initial weights for the KL term
    value_head: bool = False  # a PPO critic: the same transformer with a scalar value head
    router_replay: str = "none"  # algo.router_replay (MoE): none | R2 | R3 (mrl.megatron.router_replay)


class MegatronActor:
    """This process's rank of the actor model, its optimizer, its reference copy and its sync sender."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.trainable = self.reference = self.coords = self.setup_args = self.saver = None
        self.sender = None  # mrl.sync.sender.WeightSender, made by open_sender (a collective)
        self.sender_for: tuple | None = None  # the endpoints and SyncConfig it was opened with
        self.trace = TraceRecorder()  # profile.steps: this rank's torch.profiler trace of a step
        self._master_store: dist.TCPStore | None = None  # rank 0 hosts the default group's rendezvous
        self.offloader = None  # trainer.offload_actor_during_rollout: mrl.megatron.offload.StateOffloader

    def hostname(self) -> str:
        return socket.gethostname()

    def pid(self) -> int:
        """This rank's process id: a failure report names it (and tests kill it)."""
        return os.getpid()

    def visible_devices(self) -> str | None:
        """The accelerators Ray gave this rank (CUDA_VISIBLE_DEVICES; None: unset, a CPU run)."""
        return os.environ.get("CUDA_VISIBLE_DEVICES")

    def address(self) -> tuple[str, int]:
        """Host and port of the default group's rendezvous store (asked of rank 0, which hosts it).

        The store binds port 0 and is held from here on: probing a free port and binding it later
        can lose the port to another process in between (EADDRINUSE)."""
        host = socket.gethostbyname(socket.gethostname())
        self._master_store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)  # not "": it hangs
        return host, self._master_store.port

    def init_process_group(self, master: tuple[str, int], local_rank: int = 0, timeout_s: float = 300.0) -> None:
        """torchrun's job done by hand: the env variables, then the default group (gloo on CPU)."""
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(local_rank),
                          MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        else:
            torch.set_num_threads(1)  # several ranks share a few cores: oversubscription costs more
        store = self._master_store or dist.TCPStore(
            master[0], master[1], is_master=False, timeout=timedelta(seconds=timeout_s))
        store.set_timeout(timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=self.rank,
                                world_size=self.world_size, timeout=timedelta(seconds=timeout_s))

    def setup(self, args: ActorSetup) -> dict:
        """Build this rank's model in the layout, load the HF weights, make optimizer and scheduler."""
        from mrl.bridge.hf_import import load_hf_weights
        from mrl.megatron.model import build_model
        from mrl.megatron.parallel import initialize_layout
        from mrl.megatron.training import make_trainable
        from mrl.models.registry import model_spec_from_hf

        self.setup_args = args
        self.coords = initialize_layout(args.layout, seed=args.seed)
        spec = model_spec_from_hf(args.hf_dir)
        dtype = getattr(torch, args.params_dtype)

        def load() -> Any:
            built = build_model(spec, args.layout, params_dtype=dtype, transformer_impl=args.transformer_impl,
                                value_head=args.value_head, recompute=args.recompute, fp8=args.fp8)
            load_hf_weights(built, self.coords, args.hf_dir)
            return built

        self.trainable = make_trainable(load(), args.optim)
        if args.reference:
            self.reference = load()
            for chunk in self.reference.chunks:
                chunk.requires_grad_(False)
        params = sum(p.numel() for chunk in self.trainable.built.chunks for p in chunk.parameters())
        return {"rank": self.rank, "coords": vars(self.coords), "params": params}

    def restart_lr_schedule(self, optim: OptimConfig) -> None:
        """A new learning-rate schedule from step 0 (SFT → RL hand-over); Adam's moments stay."""
        from mrl.megatron.training import restart_lr_schedule

        restart_lr_schedule(self.trainable, optim)

    # --- per-step work -------------------------------------------------------------------------

    def _mine(self, batch: dict) -> dict:
        from mrl.megatron.parallel import data_parallel_size
        from mrl.megatron.policy import data_parallel_rows

        return data_parallel_rows(batch, self.coords.dp, data_parallel_size())

    def _report(self, result: dict | None) -> dict | None:
        """{"dp": ..., **result} from the rank that reports its DP slice; None from the others."""
        from mrl.megatron.parallel import is_reporter

        return {"dp": self.coords.dp, **result} if result is not None and is_reporter() else None

    @stage("logprobs")
    def logprobs(self, batch: dict, reference: bool = False, with_entropy: bool = False) -> dict | None:
        """Per-token log-probs [B/DP, L] of this rank's slice under the actor (or the reference).

        MoE (mrl.megatron.router_replay): R3 replays the batch's routes; the actor's pass reports
        "routing_counts" (mrl.routes.agreement_counts, sum them over DP) when the batch has routes,
        and with R2 its own "routes" and "routes_len" for the updates to replay."""
        self._on_device("logprobs")
        from mrl.megatron.policy import compute_logprobs
        from mrl.megatron.router_replay import prepare, route_shape_of, routing_results

        model = self.reference if reference else self.trainable
        mine = self._mine(batch)
        built = model if reference else model.built
        inputs, routes = prepare(mine, built, self.setup_args.router_replay, "ref" if reference else "old")
        optim = self.setup_args.optim  # the update's micro-batching: the first step's ratio is then exactly 1
        result = compute_logprobs(model, inputs, self.setup_args.layout.tp, optim.micro_batch_size,
                                  with_entropy=with_entropy, max_tokens=optim.max_tokens_per_micro_batch,
                                  routes=routes)
        if result is not None and "own_routes" in result:
            own = result.pop("own_routes")
            result.update(routing_results(own, mine, self.setup_args.router_replay, route_shape_of(built)))
        return self._report(result)

    @stage("update")
    def update(self, batch: dict, algo: Any) -> dict | None:
        """One optimizer step of the policy loss on this rank's slice; metrics from the reporters."""
        self._on_device("update")
        from mrl.megatron.policy import update_actor

        from mrl.megatron.router_replay import prepare

        optim = self.setup_args.optim
        inputs, routes = prepare(self._mine(batch), self.trainable.built, self.setup_args.router_replay, "update")
        return self._report(update_actor(self.trainable, inputs, algo, optim.micro_batch_size,
                                         optim.max_tokens_per_micro_batch, routes=routes))

    @stage("values")
    def values(self, batch: dict) -> dict | None:
        """A critic's values [B/DP, L] of this rank's slice (the update's micro-batching)."""
        self._on_device("values")
        from mrl.megatron.policy import compute_values

        optim = self.setup_args.optim
        return self._report(compute_values(self.trainable, self._mine(batch), optim.micro_batch_size,
                                           optim.max_tokens_per_micro_batch))

    @stage("update_critic")
    def update_critic(self, batch: dict, cliprange: float, aggregation: str) -> dict | None:
        """One optimizer step of a critic's clipped value loss on this rank's slice."""
        self._on_device("update_critic")
        from mrl.megatron.policy import update_critic

        optim = self.setup_args.optim
        return self._report(update_critic(self.trainable, self._mine(batch), cliprange, aggregation,
                                          optim.micro_batch_size, optim.max_tokens_per_micro_batch))

    @stage("sft_step")
    def sft_step(self, batch: dict) -> dict | None:
        """One optimizer step of masked next-token loss (response tokens only)."""
        self._on_device("sft_step")
        from mrl.megatron.policy import update_sft

        optim = self.setup_args.optim
        return self._report(update_sft(self.trainable, self._mine(batch), optim.micro_batch_size,
                                       optim.max_tokens_per_micro_batch))

    def probe_logprobs(self, sequences: list[list[int]]) -> list[list[float]] | None:
        """The trainer's side of the parity gate (full sequences, whole vocabulary; tiny batches)."""
        self._on_device("probe_logprobs", "weights")
        from mrl.megatron.forward import sequence_logprobs

        from mrl.megatron.parallel import is_reporter

        out = sequence_logprobs(self.trainable.built, sequences)
        return out if out is not None and is_reporter() and self.coords.dp == 0 else None

    # --- colocated offload (trainer.offload_actor_during_rollout) ---------------------------------

    def offload_state(self, parts: list[str], move_host_tensors: bool = False) -> dict:
        """Move `parts` of this rank's state ("weights", "grads", "optimizer", "reference") off the
        GPU while the colocated engine generates; {"rank", "bytes", "by_part", "moved", "seconds"}.
        Without CUDA a no-op that reports the bytes (mrl.megatron.offload); `move_host_tensors`
        runs the release/restore path on host tensors too (tests)."""
        from mrl.megatron.offload import StateOffloader, trainable_tensors

        if self.offloader is None:
            self.offloader = StateOffloader(lambda part: trainable_tensors(self.trainable, self.reference, part),
                                            move_host_tensors)
        return {"rank": self.rank, **self.offloader.offload(parts)}

    def onload_state(self) -> dict:
        """Bring every offloaded part back before the rank's next forward; the same report."""
        if self.offloader is None:
            return {"rank": self.rank, "bytes": 0, "by_part": {}, "moved": False, "seconds": 0.0}
        return {"rank": self.rank, **self.offloader.onload()}

    def _on_device(self, method: str, *parts: str) -> None:
        """A method that reads the state while some of it is offloaded brings it back first (the
        driver onloads explicitly before a step; this covers any other path), and says so."""
        if self.offloader is None or not self.offloader.away:
            return
        wanted = parts or tuple(self.offloader.away)
        if any(p in self.offloader.away for p in wanted):
            import logging

            logging.getLogger(__name__).warning("rank %d: %s found %s offloaded; bringing it back", self.rank, method,
                                                sorted(self.offloader.away))
            self.offloader.onload(wanted)

    # --- profiling (profile.steps) --------------------------------------------------------------

    def start_profile(self) -> None:
        """Start recording this rank's torch.profiler trace (the driver calls it as a step begins)."""
        self.trace.start()

    def stop_profile(self, directory: str, role: str) -> str:
        """Stop recording; write the trace as DIRECTORY/<role>_rank<rank>.pt.trace.json, return its path."""
        return str(self.trace.stop(Path(directory) / trace_file(role, self.rank)))

    # --- weight sync and checkpoints ---------------------------------------------------------

    def open_sender(self, endpoints: list[SyncEndpoint], settings: SyncConfig) -> None:
        """Make this rank's weight sender for these engines (endpoints[0] is the hub) with these
        settings: a collective (its process groups and export plan), once before the first push and
        again when the engines change. The same engines and settings keep the open sender (and the
        channel it keeps from push to push); others close it first."""
        self._on_device("open_sender", "weights")
        from mrl.sync.sender import WeightSender

        if self.sender is not None:
            if self.sender_for == (endpoints, settings):
                return
            self.sender.close()
            self.sender = None  # a failed open leaves none: push_weights then says so
        self.sender = WeightSender(endpoints, self.trainable.built, self.coords, transport=settings.transport,
                                   bucket_bytes=settings.bucket_mb << 20, timeout_s=settings.timeout_s)
        self.sender_for = (endpoints, settings)

    @stage("push_weights")
    def push_weights(self, sync_id: str) -> dict | None:
        """Stream the current weights to the engines of the open sender (open_sender); the
        leader's report, else None."""
        self._on_device("push_weights", "weights")
        if self.sender is None:
            raise RuntimeError(f"rank {self.rank}: push_weights before open_sender: open the sender with the "
                               "engines' endpoints and the sync settings first (mrl.sync.driver.WeightSync does)")
        sent = self.sender.push(sync_id)
        return None if sent is None else {"bytes": sent.bytes, "seconds": sent.seconds,
                                          "checksums": sent.checksums}

    def save(self, root: str, step: int, data_state: dict, config: dict, keep: int, async_save: bool) -> None:
        """Save iteration `step` under `root`, keep the newest `keep` (an async save publishes at the
        next save or at `finish_save`)."""
        self._on_device("save")
        from mrl.megatron.checkpoint import SavePolicy

        if self.saver is None or self.saver.root != Path(root):  # the SFT checkpoint has a root of its own
            self.finish_save()
            self.saver = SavePolicy(root, interval=1, keep=keep, async_save=async_save)
        self.saver.maybe_save(self.trainable, step, data_state=data_state, config=config,
                              hf_dir=self.setup_args.hf_dir)

    def finish_save(self) -> None:
        if self.saver is not None:
            self.saver.finish()

    def load(self, path: str) -> dict:
        from mrl.megatron.checkpoint import load_checkpoint

        self._on_device("load")
        state = load_checkpoint(path, self.trainable)
        return {"step": state["step"], "data": state["data"]}

    def load_policy(self, path: str, into_reference: bool = False) -> None:
        """A policy checkpoint's weights (the one RL starts from): into the frozen reference copy, or
        into this model's transformer (a critic: its value head stays), optimizer state kept."""
        self._on_device("load_policy")
        from mrl.megatron.checkpoint import load_policy_weights

        if into_reference:
            if self.reference is not None:
                load_policy_weights(path, self.reference)
            return
        load_policy_weights(path, self.trainable.built)
        self.trainable.optimizer.reload_model_params()  # master copies (bf16 training) follow the weights

    def shutdown(self) -> None:
        self.finish_save()
        if dist.is_initialized():
            dist.destroy_process_group()
