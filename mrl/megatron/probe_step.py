"""One real optimizer step on a probe batch: how `mrl verify --rollout` moves the weights.

Megatron's DDP (gradient buffers, the TP/sequence-parallel and embedding all-reduces of
`finalize_model_grads`) and Megatron's Adam, on next-token cross-entropy computed vocab-parallel
inside the model: the same machinery a training step uses, so the synced weights are those a
trainer would hold after a step, replicas included.
"""

from __future__ import annotations

import torch

from mrl.megatron.model import BuiltModel


def one_lm_step(built: BuiltModel, tokens: torch.Tensor, *, lr: float = 1e-3) -> float | None:
    """One Adam step on next-token loss over `tokens` [b, s]; the loss on the last stage, else None."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = built.chunks[0].config
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False)
    chunks = [DistributedDataParallel(config, ddp_config, chunk) for chunk in built.chunks]
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        # No clipping: megatron 0.16.1 asserts CUDA gradients in clip_grad_by_total_norm_fp32.
        OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, clip_grad=0.0, bf16=config.bf16,
                        params_dtype=config.params_dtype, use_distributed_optimizer=False),
        chunks,
    )
    batch, seq = tokens.shape
    tp = built.layout.tp
    padded = -(-(seq - 1) // tp) * tp  # inputs are tokens[:-1]; sequence parallelism wants a TP multiple
    inputs = torch.nn.functional.pad(tokens[:, :-1], (0, padded - (seq - 1)))
    labels = torch.nn.functional.pad(tokens[:, 1:], (0, padded - (seq - 1)))
    mask = torch.zeros(batch, padded)
    mask[:, : seq - 1] = 1.0
    positions = torch.arange(padded).unsqueeze(0)
    micro_batches = [(inputs[i : i + 1], labels[i : i + 1], mask[i : i + 1]) for i in range(batch)]

    def forward_step(data_iterator, model):
        ids, target, weight = next(data_iterator)
        per_token = model(ids, positions, None, labels=target)

        def loss_func(output):
            loss = (output.float() * weight).sum() / weight.sum()
            return loss, {"lm loss": loss.detach()}

        return per_token, loss_func

    for chunk in chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    iterators = [iter(micro_batches) for _ in chunks]
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=batch, seq_length=padded, micro_batch_size=1, forward_only=False,
    )
    updated, _, _ = optimizer.step()
    if not updated:
        raise RuntimeError("the probe optimizer step was skipped (non-finite gradients)")
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return float(torch.stack([m["lm loss"] for m in losses]).mean())
