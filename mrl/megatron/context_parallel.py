"""Context parallelism (parallel.cp): each sequence is split over the CP ranks, and attention gathers
the keys and values of the whole sequence.

The split is Megatron's load-balanced one (megatron.core.utils.get_batch_on_this_cp_rank, and the
rotary embedding's get_pos_emb_on_this_cp_rank): the sequence is cut into 2·CP equal chunks and
CP rank r holds chunks r and 2·CP-1-r, so under a causal mask every rank has the same attention work.
Here a micro-batch's per-token tensors are sliced before the model sees them (`split_micro_batch`)
and per-token results (log-probs, entropy, values, logits) are gathered back into sequence order
(`gather_outputs`). Core attention (megatron_patches/sdpa_attention.py, where the chunk positions
are defined) all-gathers K and V over the CP group. Megatron's DDP reduces the replicated weights'
gradients over DP×CP; each rank's loss is its share of the micro-batch's (a sequence's mean or
importance ratio over the whole sequence: mrl.algo.aggregation), so the shares add up to the loss of
whole sequences. With CP 1 every function here is the identity.
"""

from __future__ import annotations

import torch

from megatron_patches.sdpa_attention import causal_mask, chunk_positions, gathered_positions
from mrl.algo.aggregation import SequenceParts


def cp_size() -> int:
    """The CP group's size (1 before Megatron's groups exist: a loss built outside a worker)."""
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def cp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_rank()


def local_positions(seq: int) -> torch.Tensor:
    """This rank's positions of a `seq`-token sequence (all of them without CP)."""
    return chunk_positions(seq, cp_size(), cp_rank()) if cp_size() > 1 else torch.arange(seq)


def key_positions(seq: int) -> torch.Tensor:
    """The positions of the keys CP attention sees, in the order its all-gather returns them (all
    of them in order without CP)."""
    return gathered_positions(seq, cp_size()) if cp_size() > 1 else torch.arange(seq)


def split_micro_batch(micro: dict, device: torch.device | None = None) -> dict:
    """This CP rank's share of a micro-batch, on `device` (the model's: batches are made in host
    memory): every [b, s] tensor sliced to its positions along the sequence (scalars and the row
    index untouched), its token-mean loss weight rescaled to its tokens, "cp_size" set, and
    "sequence_parts": each whole sequence's response tokens and the sum over the CP group that
    sequence-level losses and whole-sequence metrics need (mrl.algo.aggregation.SequenceParts).
    Without CP only the device changes."""
    if device is not None:
        micro = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in micro.items()}
    size = cp_size()
    if size == 1:
        return micro
    seq = micro["tokens"].shape[1]
    mine = local_positions(seq)
    local = {key: value[:, mine] if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq
             else value for key, value in micro.items()}
    local["cp_size"] = size
    if "loss_scale_tokens" in micro:
        # A token-mean is over this rank's tokens now: weigh it by its share of the micro-batch's
        # (Megatron's schedule multiplies the loss by CP, DDP averages gradients over DP×CP).
        whole, here = (float((m["response_mask"] != 0).sum()) for m in (micro, local))
        local["loss_scale_tokens"] = micro["loss_scale_tokens"] * here / whole if whole else 0.0
    if "response_mask" in micro:
        local["sequence_parts"] = SequenceParts((micro["response_mask"] != 0).sum(-1), _over_cp)
    return local


def _over_cp(partial: torch.Tensor, op: str) -> torch.Tensor:
    """Per-sequence partial sums or maxima [B] of this rank → the whole sequences' (a constant)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    whole = partial.detach().clone()
    dist.all_reduce(whole, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op],
                    group=ps.get_context_parallel_group())
    return whole


def gather_sequence(local: torch.Tensor) -> torch.Tensor:
    """A per-token result [b, s/CP, ...] of this rank's positions → [b, s, ...] in sequence order on
    every CP rank (no gradient: for log-probs, values and logits that leave the model)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    size = cp_size()
    if size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=ps.get_context_parallel_group())
    gathered = torch.cat(parts, dim=1)
    out = torch.empty_like(gathered)
    out[:, gathered_positions(gathered.shape[1], size)] = gathered
    return out


def gather_outputs(outputs):
    """gather_sequence over each per-token tensor of a score's result (a tensor, or a tuple of
    tensors and Nones)."""
    if isinstance(outputs, tuple):
        return tuple(None if t is None else gather_sequence(t) for t in outputs)
    return gather_sequence(outputs)


def mean_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Each metric averaged over the CP group (every rank saw its own tokens); the identity without CP."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if cp_size() == 1 or not metrics:
        return metrics
    # on the GPU where there is one: the CP group is NCCL's there
    values = torch.tensor([metrics[k] for k in metrics], dtype=torch.float64,
                          device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(values, group=ps.get_context_parallel_group())
    return {k: float(v) / cp_size() for k, v in zip(metrics, values)}


def release_mask() -> None:
    """Drop CP attention's cached causal mask (after a forward or training pass: it would otherwise
    stay allocated, e.g. while a colocated engine generates)."""
    causal_mask.cache_clear()
