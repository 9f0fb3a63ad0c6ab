"""One rank of the Megatron actor (or of a PPO critic): what a trainer worker process holds and the
work it is asked to do.

A plain class (no Ray): mrl/launch/worker_group.py runs one per process as a Ray actor, tests may
run it under run_local. Every method except `address` is collective: the driver calls it on every
rank at once with the same arguments.

Batches arrive whole on every rank (see mrl/experience.py for their layout); each rank keeps the
rows of its data-parallel slice. Results come back from one rank per DP slice (the last pipeline
stage, TP rank 0) as {"dp": dp_rank, ...}; every other rank returns None.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mrl.layout import ParallelLayout


@dataclass
class ActorSetup:
    """What a rank needs to build its part of the actor (plain data: it crosses process boundaries)."""

    hf_dir: str
    layout: ParallelLayout
    params_dtype: str = "float32"
    transformer_impl: str = "auto"
    seed: int = 0
    optim: dict | None = None  # mrl.megatron.training.OptimConfig fields
    reference: bool = False  # keep a frozen copy of the initial weights for the KL term
    micro_batch_size: int = 1
    max_tokens_per_micro_batch: int | None = None
    value_head: bool = False  # a PPO critic: the same transformer with a scalar value head


def _slice_rows(batch: dict, dp_rank: int, dp_size: int) -> dict:
    rows = next(iter(batch.values())).shape[0]
    if rows % dp_size:
        raise ValueError(f"a batch of {rows} sequences does not split over {dp_size} data-parallel ranks: "
                         "make data.batch_size × rollout.n_samples_per_prompt a multiple of DP")
    size = rows // dp_size
    return {key: value[dp_rank * size : (dp_rank + 1) * size] for key, value in batch.items()}


class MegatronActor:
    """This process's rank of the actor model, its optimizer, its reference copy and its sync sender."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.trainable = self.reference = self.coords = self.setup_args = self.sender = self.saver = None

    def hostname(self) -> str:
        return socket.gethostname()

    def pid(self) -> int:
        """This rank's process id: a failure report names it (and tests kill it)."""
        return os.getpid()

    def address(self) -> tuple[str, int]:
        """Host and a free port for the default group's rendezvous (asked of rank 0)."""
        host = socket.gethostbyname(socket.gethostname())
        with socket.socket() as sock:
            sock.bind(("", 0))
            return host, sock.getsockname()[1]

    def init_process_group(self, master: tuple[str, int], local_rank: int = 0, timeout_s: float = 300.0) -> None:
        """torchrun's job done by hand: the env variables, then the default group (gloo on CPU)."""
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(local_rank),
                          MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        else:
            torch.set_num_threads(1)  # several ranks share a few cores: oversubscription costs more
        dist.init_process_group(backend, rank=self.rank, world_size=self.world_size,
                                timeout=timedelta(seconds=timeout_s))

    def setup(self, args: ActorSetup) -> dict:
        """Build this rank's model in the layout, load the HF weights, make optimizer and scheduler."""
        from mrl.bridge.hf_import import load_hf_weights
        from mrl.megatron.model import build_model
        from mrl.megatron.parallel import initialize_layout
        from mrl.megatron.training import OptimConfig, make_trainable
        from mrl.models.registry import model_spec_from_hf

        self.setup_args = args
        self.coords = initialize_layout(args.layout, seed=args.seed)
        spec = model_spec_from_hf(args.hf_dir)
        dtype = getattr(torch, args.params_dtype)

        def load() -> Any:
            built = build_model(spec, args.layout, params_dtype=dtype, transformer_impl=args.transformer_impl,
                                value_head=args.value_head)
            load_hf_weights(built, self.coords, args.hf_dir)
            return built

        self.trainable = make_trainable(load(), OptimConfig(**(args.optim or {})))
        if args.reference:
            self.reference = load()
            for chunk in self.reference.chunks:
                chunk.requires_grad_(False)
        params = sum(p.numel() for chunk in self.trainable.built.chunks for p in chunk.parameters())
        return {"rank": self.rank, "coords": vars(self.coords), "params": params}

    def restart_lr_schedule(self, optim: dict) -> None:
        """A new learning-rate schedule from step 0 (SFT → RL hand-over); Adam's moments stay."""
        from mrl.megatron.training import OptimConfig, restart_lr_schedule

        restart_lr_schedule(self.trainable, OptimConfig(**optim))

    # --- per-step work -------------------------------------------------------------------------

    def _mine(self, batch: dict) -> dict:
        from megatron.core import parallel_state as ps

        return _slice_rows(batch, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())

    def _reporter(self) -> bool:
        from megatron.core import parallel_state as ps

        return ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0

    def logprobs(self, batch: dict, reference: bool = False, with_entropy: bool = False) -> dict | None:
        """Per-token log-probs [B/DP, L] of this rank's slice under the actor (or the reference)."""
        from mrl.megatron.policy import compute_logprobs

        model = self.reference if reference else self.trainable
        args = self.setup_args  # the update's micro-batching: the first step's ratio is then exactly 1
        out = compute_logprobs(model, self._mine(batch), args.layout.tp, args.micro_batch_size,
                               with_entropy=with_entropy, max_tokens=args.max_tokens_per_micro_batch)
        return {"dp": self.coords.dp, **out} if out is not None and self._reporter() else None

    def update(self, batch: dict, algo: Any) -> dict | None:
        """One optimizer step of the policy loss on this rank's slice; metrics from the reporters."""
        from mrl.megatron.policy import update_actor

        metrics = update_actor(self.trainable, self._mine(batch), algo, self.setup_args.micro_batch_size,
                               self.setup_args.max_tokens_per_micro_batch)
        return {"dp": self.coords.dp, **metrics} if self._reporter() else None

    def values(self, batch: dict) -> dict | None:
        """A critic's values [B/DP, L] of this rank's slice (the update's micro-batching)."""
        from mrl.megatron.policy import compute_values

        args = self.setup_args
        out = compute_values(self.trainable, self._mine(batch), args.micro_batch_size, args.max_tokens_per_micro_batch)
        return {"dp": self.coords.dp, **out} if out is not None and self._reporter() else None

    def update_critic(self, batch: dict, cliprange: float, aggregation: str) -> dict | None:
        """One optimizer step of a critic's clipped value loss on this rank's slice."""
        from mrl.megatron.policy import update_critic

        args = self.setup_args
        metrics = update_critic(self.trainable, self._mine(batch), cliprange, aggregation, args.micro_batch_size,
                                args.max_tokens_per_micro_batch)
        return {"dp": self.coords.dp, **metrics} if self._reporter() else None

    def sft_step(self, batch: dict) -> dict | None:
        """One optimizer step of masked next-token loss (response tokens only)."""
        from mrl.megatron.policy import update_sft

        metrics = update_sft(self.trainable, self._mine(batch), self.setup_args.micro_batch_size,
                           self.setup_args.max_tokens_per_micro_batch)
        return {"dp": self.coords.dp, **metrics} if self._reporter() else None

    def probe_logprobs(self, sequences: list[list[int]]) -> list[list[float]] | None:
        """The trainer's side of the parity gate (full sequences, whole vocabulary; tiny batches)."""
        from mrl.megatron.forward import sequence_logprobs

        out = sequence_logprobs(self.trainable.built, sequences)
        return out if out is not None and self._reporter() and self.coords.dp == 0 else None

    # --- weight sync and checkpoints ---------------------------------------------------------

    def push_weights(self, endpoint: Any, sync_id: str, transport: str, bucket_bytes: int,
                     timeout_s: float) -> dict | None:
        """Stream the current weights to the rollout engine; the leader's report, else None."""
        from mrl.rollout.weight_sync import WeightSender

        if self.sender is None:  # its process groups are made once (a collective)
            self.sender = WeightSender(endpoint, self.trainable.built, self.coords, transport=transport,
                                       bucket_bytes=bucket_bytes, timeout_s=timeout_s)
        sent = self.sender.push(sync_id)
        return None if sent is None else {"bytes": sent.bytes, "seconds": sent.seconds,
                                          "checksums": sent.checksums}

    def sync_channels(self) -> int:
        return 1 if self.sender is None or self.sender.transport == "colocated" else self.setup_args.layout.pp

    def save(self, root: str, step: int, data_state: dict, config: dict, keep: int, async_save: bool) -> None:
        """Save iteration `step` under `root`, keep the newest `keep` (an async save publishes at the
        next save or at `finish_save`)."""
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

        state = load_checkpoint(path, self.trainable)
        return {"step": state["step"], "data": state["data"]}

    def load_policy(self, path: str, into_reference: bool = False) -> None:
        """A policy checkpoint's weights (the one RL starts from): into the frozen reference copy, or
        into this model's transformer (a critic: its value head stays), optimizer state kept."""
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
