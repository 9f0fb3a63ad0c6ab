"""Forward passes through the pipeline: full-vocabulary logits for a batch of token ids.

Used by `mrl verify` (parity with transformers) and later for scoring probe batches. Vocab-parallel
logits are gathered over TP here because verify needs the whole distribution; RL losses use
vocab-parallel log-probs instead and never gather the vocabulary.
"""

from __future__ import annotations

import torch

from mrl.megatron.context_parallel import gather_sequence, local_positions, split_micro_batch
from mrl.megatron.model import BuiltModel


def forward_logits(built: BuiltModel, tokens: torch.Tensor) -> torch.Tensor | None:
    """Logits [b, s, V] (padding stripped) on the last pipeline stage, None on other stages.

    Runs one micro-batch per sequence through Megatron's pipeline schedule (forward only).
    The sequence is right-padded to a multiple of TP for sequence parallelism (× 2·CP with context
    parallelism, more with FP8); causal attention keeps the real positions unaffected and their
    logits are returned (with CP, gathered from the CP ranks in sequence order).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    batch, seq = tokens.shape
    multiple = built.sequence_multiple  # TP (sequence parallelism), more with FP8
    padded = -(-seq // multiple) * multiple
    tokens = torch.nn.functional.pad(tokens, (0, padded - seq)).to(built.device)
    positions = local_positions(padded).unsqueeze(0).to(built.device)
    micro_batches = [tokens[i : i + 1] for i in range(batch)]
    chunks = len(built.chunks)
    # Every virtual chunk calls forward_step; each needs its own pass over the micro-batches.
    iterators = [iter(micro_batches) for _ in range(chunks)]

    def forward_step(data_iterator, model):
        ids = split_micro_batch({"tokens": next(data_iterator)})["tokens"]  # CP: this rank's positions
        output = model(ids, positions, None)

        def keep_logits(output_tensor, non_loss_data=True):
            return gather_sequence(gather_from_tensor_model_parallel_region(output_tensor))

        return output, keep_logits

    for chunk in built.chunks:
        chunk.eval()
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if chunks > 1 else iterators[0],
            model=built.chunks if chunks > 1 else built.chunks[0],
            num_microbatches=batch,
            seq_length=padded,
            micro_batch_size=1,
            forward_only=True,
            collect_non_loss_data=True,
        )
    if not ps.is_pipeline_last_stage():
        return None
    return torch.cat(outputs)[:, :seq, : built.spec.vocab_size].float().cpu()


def sequence_logprobs(built: BuiltModel, sequences: list[list[int]]) -> list[list[float]] | None:
    """log p(token_i | tokens_<i) for i ≥ 1 of each equal-length sequence (last stage; None elsewhere).

    The trainer's side of the rollout parity gate; probe batches are small, so gathering the
    vocabulary here is cheap.
    """
    tokens = torch.tensor(sequences)
    logits = forward_logits(built, tokens)
    if logits is None:
        return None
    logprobs = logits[:, :-1].log_softmax(-1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    return logprobs.tolist()


def greedy_decode(built: BuiltModel, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[list[float]]] | None:
    """Argmax continuation of equal-length prompts and each chosen token's logprob.

    One full forward per token (probe batches are tiny). The last stage's choice is broadcast over
    the pipeline group so every stage extends the sequence alike. Results on the last stage only.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tokens, logprobs = torch.tensor(prompts), []
    for _ in range(steps):
        logits = forward_logits(built, tokens)
        choice = torch.zeros(tokens.shape[0], dtype=torch.long)
        if logits is not None:
            last = logits[:, -1].log_softmax(-1)
            choice = last.argmax(-1)
            logprobs.append(last.gather(-1, choice.unsqueeze(-1)).squeeze(-1))
        if ps.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(choice, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        tokens = torch.cat([tokens, choice.unsqueeze(-1)], dim=1)
    if not logprobs:
        return None
    return tokens[:, len(prompts[0]):].tolist(), torch.stack(logprobs, dim=1).tolist()
