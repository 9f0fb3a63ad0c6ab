"""Log-probs and entropy from vocab-parallel logits [b, s, V/tp], without gathering the vocabulary.

Padded vocabulary rows are masked out, so the trainer scores over the support vLLM samples from.
"""

from __future__ import annotations

import torch

# Padded vocabulary rows (V/tp·tp beyond the real vocabulary, in the last TP shard) are masked out
# of the RL log-probs and entropy: vLLM samples from the real vocabulary, so the trainer's log-probs
# must be over the same support, or every step would show a train/rollout gap on tokens the engine
# can never sample. Megatron's own LM loss (SFT here) does not mask them; they are never exported,
# so that only wastes a little.
# Logit given to padded vocabulary rows: exp() of it is exactly 0, and 0 · it stays finite (-inf
# would make the entropy's p·log p a NaN).
_PADDED_LOGIT = -1e30


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """Logits [b, s, V/tp] with the rows past the real vocabulary (Megatron's TP padding, in the
    last shard) pushed to _PADDED_LOGIT, so the softmax is over the vocabulary vLLM samples from."""
    from megatron.core import parallel_state as ps

    local = logits.shape[-1]
    first = ps.get_tensor_model_parallel_rank() * local
    if vocab_size is None or first + local <= vocab_size:
        return logits
    padded = torch.arange(first, first + local, device=logits.device) >= vocab_size
    return logits.masked_fill(padded, _PADDED_LOGIT)


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """log softmax(logits)[label] [b, s] from vocab-parallel logits [b, s, V/tp]; differentiable.

    Built on Megatron's vocab_parallel_cross_entropy (logprob = -CE): max and sum all-reduces over
    the TP group, the vocabulary is never gathered. With `vocab_size`, padded rows are excluded.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    # Megatron's kernel works in place on `logits.float()`, which is `logits` itself for fp32: a
    # contiguous fp32 copy keeps the caller's logits intact (entropy reads them too).
    work = mask_padded_vocab(logits, vocab_size).to(dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)
    return -vocab_parallel_cross_entropy(work, labels.contiguous())


def vocab_parallel_entropy(logits: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """Entropy [b, s] of softmax(logits) from vocab-parallel logits [b, s, V/tp]; differentiable.

    H = log Σ e^(z-m) - Σ e^(z-m)·(z-m) / Σ e^(z-m), with the global max m (an all-reduce MAX, no
    gradient: H does not depend on the shift) and both sums all-reduced over the TP group.
    The sums go through reduce_from_tensor_model_parallel_region (all-reduce forward, identity
    backward): every TP rank holds the same H and loss, so d loss / d local-sum = d loss / d sum.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    logits = mask_padded_vocab(logits.float(), vocab_size)
    with torch.no_grad():
        shift = logits.max(dim=-1, keepdim=True).values
        if ps.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = logits - shift
    exp = shifted.exp()
    # One all-reduce for both sums: [b, s, 2].
    sums = reduce_from_tensor_model_parallel_region(
        torch.stack([exp.sum(dim=-1), (exp * shifted).sum(dim=-1)], dim=-1)
    )
    total, weighted = sums.unbind(dim=-1)
    return total.log() - weighted / total
