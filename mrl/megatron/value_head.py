"""The critic's head: one scalar per position in place of the vocabulary logits.

A PPO critic is the policy's transformer with its output layer swapped for this head (see
build_model(value_head=True)). The head is small, so every TP rank holds all of it: under sequence
parallelism it first gathers the sequence, then every TP rank computes the same values and loss.
"""

from __future__ import annotations

import torch

# Parameters that exist only in mrl's critic, not in any HuggingFace checkpoint: the bridge skips
# tensors that carry this attribute (they are saved in mrl's own checkpoints).
NOT_IN_HF = "mrl_not_in_hf"


class ValueHead(torch.nn.Module):
    """hidden [s(/tp), b, h] → values [s, b, 1], called as GPTModel calls its output layer."""

    def __init__(self, hidden_size: int, sequence_parallel: bool, dtype: torch.dtype):
        super().__init__()
        self.sequence_parallel = sequence_parallel  # GPTModel reads this attribute of its output layer
        # Zero: the first values are 0 everywhere, whatever the trunk (a random head would add noise
        # the critic must first unlearn). Named weight and bias, as Megatron's checkpointing of
        # GPTModel expects of an output layer.
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        for param in (self.weight, self.bias):
            setattr(param, NOT_IN_HF, True)

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # Backward splits (not reduce-scatters) the gradient: every TP rank's loss is the same
            # whole loss, so each rank's gradient for the full sequence is already complete.
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None
