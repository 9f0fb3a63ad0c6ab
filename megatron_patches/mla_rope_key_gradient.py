"""Give MLA's shared rotary key its whole gradient under tensor parallelism (local layer spec).

Upstream (megatron-core 0.16.1, `MLASelfAttention.get_query_key_value_tensors`): with the local
spec, `linear_kv_down_proj` is a ColumnParallelLinear whose all-gathered output keeps only this
rank's slice of the gradient in backward. The rotary key (k_pos_emb, shared by every head) is used
by this rank's heads only, so the other ranks' shares of its gradient are dropped: the forward is
right, training is silently off (tiny DeepSeek-V3, TP2: grad norm 1.23652 against TP1's 1.23693).
Transformer Engine's spec (a duplicated linear) takes a branch that is right. The step by step is
at `_whole_columns`.

Patch: a forward hook makes the ColumnParallelLinear answer like the duplicated linear, so
upstream's own right branch runs; weights, their split and names are unchanged. Applies on GPUs too.

Drop when: upstream all-reduces k_pos_emb's gradient in the ColumnParallelLinear branch (not up to 0.16.1).
"""

from __future__ import annotations

CPU_ONLY = False


# Upstream (megatron-core 0.16.1, `transformer/multi_latent_attention.py`,
# `MLASelfAttention.get_query_key_value_tensors`): with the local spec, `linear_kv_down_proj` is a
# ColumnParallelLinear, so under TP each rank computes a slice of the (kv_lora_rank +
# qk_pos_emb_head_dim) columns for the whole sequence, then all-gathers them with
# `gather_from_tensor_model_parallel_region` (backward: keep this rank's slice of the gradient). The
# compressed KV part is then scattered back to the sequence-parallel region, whose backward sums the
# TP ranks' contributions: right. The rotary key part (k_pos_emb, shared by every head) is used by
# this rank's heads only, so its gradient holds only this rank's heads' share, and the slice backward
# drops the other ranks' shares: the rope columns of linear_kv_down_proj and everything before them
# get a partial gradient (tiny DeepSeek-V3, TP2: the layers' gradients 0.05–0.5 % off TP1's, grad
# norm 1.23652 against 1.23693). Transformer Engine's spec (a duplicated linear) takes the other
# branch, which gathers k_pos_emb from the sequence-parallel region and sums its gradient over TP.
#
# The hook: on a ColumnParallelLinear kv down-projection under TP (with sequence parallelism, which
# mrl always sets with TP), gather the output columns and scatter the sequence back, so the
# projection answers like the duplicated linear [s/TP, b, kv_lora_rank + rope] and upstream's own
# duplicated-linear branch runs (its k_pos_emb gradient summed over TP). The weights, their TP split
# and their names are unchanged (checkpoints and the bridge see the same tensors). It applies on GPUs
# too: the local spec runs there when Transformer Engine is not used.
def _whole_columns(module, inputs, output):
    """[s, b, (kv + rope)/TP] → [s/TP, b, kv + rope], as the duplicated linear returns it."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region, scatter_to_sequence_parallel_region

    out, bias = output
    return scatter_to_sequence_parallel_region(gather_from_tensor_model_parallel_region(out)), bias


def apply() -> None:
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    init = MLASelfAttention.__init__
    if getattr(init, "_mrl_patched", False):
        return

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        proj = self.linear_kv_down_proj
        if isinstance(proj, ColumnParallelLinear) and proj.tp_group.size() > 1:
            if not self.config.sequence_parallel:
                raise NotImplementedError("MLA with a column-parallel kv down-projection under TP needs sequence "
                                          "parallelism (mrl sets it with TP > 1)")
            proj.register_forward_hook(_whole_columns)

    __init__._mrl_patched = True
    MLASelfAttention.__init__ = __init__
