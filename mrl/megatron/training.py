"""Training state of the Megatron actor: DDP-wrapped chunks, Megatron's optimizer and LR schedule,
and a generic train step over micro-batches through Megatron's pipeline schedules.

`loss_fn(output, micro_batch) -> (loss, metrics)` receives the model's vocab-parallel logits
[b, s, V/tp] (Megatron's layout) on the last pipeline stage; policy losses (issue 5) plug in there.
`lm_loss` is next-token cross-entropy computed vocab-parallel (the vocabulary is never gathered).

The BuiltModel's chunks stay the raw GPTModel modules: DDP wraps them without copying parameters,
so the bridge (chunk.named_parameters()) reads the trained weights directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mrl.config.schema import OptimConfig
from mrl.megatron.context_parallel import (
    key_positions,
    local_positions,
    mean_over_ranks,
    release_mask,
    split_micro_batch,
)
from mrl.megatron.model import BuiltModel, transformer_engine_available

LossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]


@dataclass
class Trainable:
    """DDP-wrapped chunks, optimizer and scheduler over one BuiltModel."""

    built: BuiltModel
    ddp_chunks: list[torch.nn.Module]
    optimizer: Any
    scheduler: Any
    config: OptimConfig
    step: int = 0


@dataclass
class StepResult:
    """One optimizer step: mean loss (last stage, else None), grad norm, lr, skipped, loss metrics."""

    loss: float | None
    grad_norm: float | None
    lr: float
    skipped: bool
    metrics: dict = field(default_factory=dict)


def make_trainable(built: BuiltModel, config: OptimConfig) -> Trainable:
    """Wrap `built.chunks` in Megatron DDP and build Megatron's optimizer and param scheduler."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    _check_schedule(config)
    distributed = config.use_distributed_optimizer
    if distributed is None:
        distributed = torch.cuda.is_available()
    if distributed and not torch.cuda.is_available():
        raise ValueError(
            "use_distributed_optimizer=True needs CUDA: megatron-core 0.16.1's DistributedOptimizer "
            "rejects CPU parameters; leave it unset (None) or set it False on CPU"
        )
    model_config = built.chunks[0].config
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=distributed)
    ddp_chunks = [
        # Only the first chunk's buckets may be overlapped/disabled; none are here (no overlap on CPU).
        DistributedDataParallel(model_config, ddp_config, chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(built.chunks)
    ]
    model_config.finalize_model_grads_func = finalize_model_grads
    if not torch.cuda.is_available():
        # Batched p2p on gloo mismatches the simultaneous forward and backward transfers of the
        # interleaved (VPP) schedule between the same two ranks: micro-batch losses after the
        # warm-up come out wrong. Megatron's unbatched p2p orders sends and receives by rank parity.
        model_config.batch_p2p_comm = False
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=config.lr, min_lr=config.min_lr, weight_decay=config.weight_decay,
            adam_beta1=config.betas[0], adam_beta2=config.betas[1], adam_eps=config.eps,
            clip_grad=config.clip_grad, bf16=model_config.bf16, params_dtype=model_config.params_dtype,
            use_distributed_optimizer=distributed, **_offload_options(config.offload_fraction, distributed),
        ),
        ddp_chunks,
    )
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if config.warmup_steps else config.lr, max_lr=config.lr, min_lr=config.min_lr,
        lr_warmup_steps=config.warmup_steps, lr_decay_steps=_decay_steps(config),
        lr_decay_style=config.schedule, start_wd=config.weight_decay, end_wd=config.weight_decay,
        wd_incr_steps=_decay_steps(config), wd_incr_style="constant",
    )
    return Trainable(built, ddp_chunks, optimizer, scheduler, config)


def _offload_options(fraction: float, distributed: bool) -> dict[str, Any]:
    """OptimizerConfig fields for megatron-core's optimizer offload (HybridDeviceOptimizer).

    On a GPU it runs inside the distributed optimizer with the precision-aware path, so the fp32
    master weights of the offloaded shards live in host memory too (Megatron-LM demands both
    flags; that config reads Transformer Engine's version, so TE must be installed); without it
    Megatron's Float16 wrapper would keep a second fp32 master copy on the GPU. On CPU the distributed optimizer is unavailable and host memory is the device: the offloaded
    part gets its own host copy (megatron_patches.cpu_hybrid_optimizer), so the same copy-step-copy
    back path runs and is tested against the plain optimizer.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"optim.offload_fraction must be in [0, 1], got {fraction}")
    if fraction == 0.0:
        return {}
    cuda = torch.cuda.is_available()
    if cuda and not distributed:
        raise ValueError("optim.offload_fraction > 0 on a GPU needs the distributed optimizer (megatron-core "
                         "offloads its shards and their fp32 master weights): set optim.use_distributed_optimizer "
                         "to true or null, or optim.offload_fraction to 0")
    if cuda and not transformer_engine_available():
        raise ValueError("optim.offload_fraction > 0 on a GPU needs Transformer Engine installed (pip install -e "
                         "'.[gpu]'): megatron-core 0.16.1's precision-aware optimizer config reads TE's version")
    return dict(optimizer_cpu_offload=True, optimizer_offload_fraction=fraction,
                use_precision_aware_optimizer=cuda, pin_cpu_grads=cuda, pin_cpu_params=cuda)


def _check_schedule(config: OptimConfig) -> None:
    if config.schedule not in ("constant", "cosine", "linear"):
        raise ValueError(f"schedule {config.schedule!r} is not one of constant, cosine, linear")
    if config.schedule != "constant" and config.total_steps is None:
        raise ValueError(f"a {config.schedule} LR schedule needs total_steps (mrl.config.derived.optim_for sets it)")


def _decay_steps(config: OptimConfig) -> int:
    """Megatron's scheduler wants a decay length past the warmup, even for a constant schedule."""
    return max(config.total_steps or 1, config.warmup_steps + 1)


def restart_lr_schedule(trainable: Trainable, config: OptimConfig) -> None:
    """Start a new LR schedule (warmup, peak, decay) from step 0, keeping Adam's moments: how an
    SFT warm start hands over to RL, which wants a much smaller learning rate."""
    _check_schedule(config)
    scheduler = trainable.scheduler
    scheduler.init_lr = 0.0 if config.warmup_steps else config.lr
    scheduler.max_lr, scheduler.min_lr = config.lr, config.min_lr
    scheduler.lr_warmup_steps = config.warmup_steps
    scheduler.lr_decay_steps = _decay_steps(config)
    scheduler.lr_decay_style = config.schedule
    for group in trainable.optimizer.param_groups:  # Megatron's groups carry their own peak and floor
        group["max_lr"], group["min_lr"] = config.lr, config.min_lr
    scheduler.num_steps = 0
    scheduler.step(0)
    trainable.config = config


def lm_loss(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, dict]:
    """Mean next-token cross-entropy over `batch["loss_mask"]`, vocab-parallel.

    `logits` [b, s, V/tp] are the model's outputs for `batch["tokens"]`; position t predicts
    `batch["labels"][:, t]` (the caller shifts, see lm_micro_batches). With CP each rank means over
    its own tokens (mrl's RL and SFT losses weigh them instead: mrl.megatron.policy).
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # Megatron's kernel wants [s, b, V/tp]; it returns the per-token loss [s, b].
    per_token = vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous().float(), batch["labels"].t().contiguous())
    mask = batch["loss_mask"].t().float()
    loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, {"lm loss": loss.detach()}


def lm_micro_batches(tokens: torch.Tensor, tp: int, micro_batch_size: int = 1) -> list[dict]:
    """Split [b, s] token ids into next-token micro-batches, right-padded to a multiple of TP."""
    batch, seq = tokens.shape
    padded = -(-(seq - 1) // tp) * tp  # sequence parallelism wants a TP multiple
    inputs = torch.nn.functional.pad(tokens[:, :-1], (0, padded - (seq - 1)))
    labels = torch.nn.functional.pad(tokens[:, 1:], (0, padded - (seq - 1)))
    mask = torch.zeros(batch, padded)
    mask[:, : seq - 1] = 1.0
    return [
        {"tokens": inputs[i : i + micro_batch_size], "labels": labels[i : i + micro_batch_size],
         "loss_mask": mask[i : i + micro_batch_size]}
        for i in range(0, batch, micro_batch_size)
    ]


def attention_mask(micro_batch: dict, use_te: bool, device: torch.device | None = None) -> torch.Tensor | None:
    """None (plain causal attention), or for packed rows (micro_batch["segments"] [b, s] of the
    whole micro-batch, before the CP split; see mrl.experience.packed_sft_batch) Megatron's boolean
    mask, True = masked out: causal within each segment, [b, 1, s, s] (under CP [b, 1, s/CP, s]:
    this rank's queries over the keys in the order CP attention gathers them). Positions are not
    restarted per segment: rotary embeddings only see position differences, which are the same (up
    to float rounding of the angles).
    """
    segments = micro_batch.get("segments")
    if segments is None:
        return None
    if use_te:
        raise ValueError("packed sequences (trainer.sft_pack_tokens) need mrl's local attention: Transformer "
                         "Engine's causal attention ignores the segment mask; set model.transformer_impl: local "
                         "or trainer.sft_pack_tokens: null")
    segments = segments.to(device or segments.device)
    seq = segments.shape[1]
    queries, keys = (p.to(segments.device) for p in (local_positions(seq), key_positions(seq)))
    causal = keys.unsqueeze(0) <= queries.unsqueeze(1)
    same = segments[:, queries, None] == segments[:, None, keys]
    return ~(same & causal).unsqueeze(1)


def train_step(trainable: Trainable, micro_batches: list[dict], loss_fn: LossFn = lm_loss, replay: Any = None) -> StepResult:
    """Forward/backward over `micro_batches` (dicts with "tokens" [mb, s]) and one optimizer step.
    `replay`: a mrl.megatron.router_replay.RoutePass whose hooks run around each chunk's forward.

    Every micro-batch must have the same shape (Megatron's pipeline schedules communicate fixed
    shapes). The reported loss is the mean of the micro-batch losses on the last pipeline stage
    (with CP, also over the CP ranks: each computed its metrics on its part of the sequences).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        raise ValueError("train_step needs at least one micro-batch")
    mbs, seq = micro_batches[0]["tokens"].shape
    multiple = trainable.built.layout.sequence_multiple
    if seq % multiple:
        raise ValueError(f"sequence length {seq} is not a multiple of TP·2CP = {multiple} "
                         f"({trainable.built.layout.describe()}): pad it")
    device = trainable.built.device
    positions = local_positions(seq).unsqueeze(0).to(device)

    def forward_step(data_iterator, model):
        whole = next(data_iterator)
        micro_batch = split_micro_batch(whole, device)  # CP: this rank's part of each sequence
        if replay is not None:
            replay.before(model, micro_batch)
        output = model(micro_batch["tokens"], positions, attention_mask(whole, trainable.built.use_te, device))
        if replay is not None:
            replay.after(model)

        def loss_func(out):
            loss, metrics = loss_fn(out, micro_batch)
            # The schedule divides the returned loss by num_microbatches in place: metrics that
            # share its storage (loss.detach()) would be divided too, so they are copied first.
            return loss, {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in metrics.items()}

        return output, loss_func

    chunks = trainable.ddp_chunks
    for chunk in chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    trainable.optimizer.zero_grad()
    iterators = [iter(micro_batches) for _ in chunks]  # every virtual chunk walks the micro-batches
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micro_batches), seq_length=seq, micro_batch_size=mbs, forward_only=False,
    )
    release_mask()  # CP attention's mask, shared by the pass's layers and micro-batches
    updated, grad_norm, _ = trainable.optimizer.step()
    lr = trainable.optimizer.param_groups[0]["lr"]
    if updated:
        trainable.scheduler.step(increment=1)
        trainable.step += 1
    loss, metrics = None, {}
    if ps.is_pipeline_last_stage(ignore_virtual=True) and outputs:
        # Metrics come back as loss_fn returned them (only the backward loss is scaled by 1/num_microbatches).
        for key in outputs[0]:
            metrics[key] = float(torch.stack([m[key].float() for m in outputs]).mean())
        metrics = mean_over_ranks(metrics)  # CP: every rank saw its own part of the sequences
        loss = next(iter(metrics.values()))
    return StepResult(loss, None if grad_norm is None else float(grad_norm), lr, not updated, metrics)
