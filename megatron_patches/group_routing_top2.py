"""Score an expert group by the sum of its two best experts, as DeepSeek-V3 does in HF and vLLM.

Upstream (megatron-core 0.16.1): `moe_utils.group_limited_topk` ranks the groups of group-limited
routing (`moe_router_num_groups` / `moe_router_group_topk`) by the sum of each group's top
`topk // group_topk` expert scores; transformers' DeepseekV3TopkRouter and vLLM's grouped_topk
(with e_score_correction_bias) by the sum of the top 2, whatever topk is. The two agree only when
num_experts_per_tok / topk_group == 2 (DeepSeek-V3 itself: 8 / 4); any other ratio picks other
groups for some tokens, so Megatron trains a different model than the checkpoint and the rollout
engine run, without any error.

Patch: `group_limited_topk` ranks groups by their top-2 sum, on GPUs too (its scope: its docstring).

Drop when: upstream makes the number of experts scored per group configurable (not up to 0.16.1)
and the registry sets it to 2.
"""

from __future__ import annotations

CPU_ONLY = False

EXPERTS_SCORED_PER_GROUP = 2  # DeepseekV3TopkRouter: .topk(2, dim=-1)[0].sum(dim=-1)


def group_limited_topk(scores, topk, num_tokens, num_experts, num_groups, group_topk):
    """Upstream's signature and result; groups ranked by their top-2 expert scores (the rest, masking
    the unselected groups and top-k over the remaining experts, is upstream's). mrl's only
    group-limited configs come from DeepSeek-V3 checkpoints (mrl/models/registry.py, which refuses
    groups of fewer than 2 experts), so the HF rule is the one wanted everywhere, GPUs included.
    TE's fused router (`moe_router_fusion`, never enabled by mrl) is not covered."""
    import torch

    grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(EXPERTS_SCORED_PER_GROUP, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    masked_scores = scores.masked_fill(~score_mask.bool(), float("-inf"))
    return torch.topk(masked_scores, k=topk, dim=-1)



def apply() -> None:
    from megatron.core.transformer.moe import moe_utils

    # topk_routing_with_score_function looks the name up in moe_utils at each call.
    moe_utils.group_limited_topk = group_limited_topk
