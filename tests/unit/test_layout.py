"""Layout arithmetic errors: each names the number and the flag to change."""

import pytest

from mrl.layout import LayoutError, ModelDims, ParallelLayout

DENSE = ModelDims(num_layers=4, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128)
MOE = ModelDims(num_layers=4, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                num_experts=8, moe_ffn_hidden_size=32)


@pytest.mark.parametrize(
    "layout, dims, world, message",
    [
        (ParallelLayout(tp=3), DENSE, None, "4 attention heads are not divisible by --tp 3"),
        (ParallelLayout(ep=3), MOE, None, "8 routed experts are not divisible by --ep 3"),
        (ParallelLayout(pp=3), DENSE, None, "4 layers cannot be split into PP×VPP = 3×1"),
        (ParallelLayout(pp=2, vpp=4), DENSE, None, "PP×VPP = 2×4 = 8"),
        (ParallelLayout(vpp=2), DENSE, None, "--vpp 2 needs --pp > 1"),
        (ParallelLayout(ep=2), DENSE, None, "--ep/--etp given for a dense model"),
        (ParallelLayout(tp=2), DENSE, 3, "world size 3 does not fit layout TP2×PP1"),
        (ParallelLayout(tp=2, ep=2), MOE, 2, "must be a multiple of 4"),
        (ParallelLayout(tp=0), DENSE, None, "--tp must be >= 1"),
        (ParallelLayout(cp=0), DENSE, None, "--cp must be >= 1"),
        (ParallelLayout(tp=2, cp=2), DENSE, 6, "world size 6 does not fit layout TP2×PP1×CP2: it must be a multiple of 4"),
    ],
)
def test_layout_errors_name_the_problem(layout, dims, world, message):
    with pytest.raises(LayoutError, match=None) as err:
        layout.validate(dims, world)
    assert message in str(err.value)


def test_kv_heads_fewer_than_tp_is_allowed_but_not_a_non_multiple():
    ParallelLayout(tp=4).validate(ModelDims(4, 4, 1, 128), 4)  # 1 KV head over 4 ranks: replicated
    with pytest.raises(LayoutError, match="3 KV heads cannot be split over --tp 2"):
        ParallelLayout(tp=2).validate(ModelDims(4, 6, 3, 128))


@pytest.mark.parametrize(
    "layout, world",
    [(ParallelLayout(), 1), (ParallelLayout(tp=2, pp=2), 4), (ParallelLayout(ep=2), 2),
     (ParallelLayout(ep=2, tp=2), 4), (ParallelLayout(etp=2), 2), (ParallelLayout(tp=2, ep=4, etp=1), 4),
     (ParallelLayout(cp=2), 2), (ParallelLayout(tp=2, cp=2, pp=2), 8), (ParallelLayout(cp=2, ep=4), 4)],
)
def test_min_world_size(layout, world):
    assert layout.min_world_size() == world


def test_context_parallel_sequences_split_into_two_chunks_a_rank():
    from megatron_patches.sdpa_attention import chunk_positions, gathered_positions

    assert ParallelLayout(tp=2, cp=2).sequence_multiple == 8 and ParallelLayout(tp=2).sequence_multiple == 2
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7] and chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(gathered_positions(12, 3).tolist()) == list(range(12))
    with pytest.raises(ValueError, match="does not split into 2·CP = 4 equal chunks"):
        chunk_positions(6, 2, 0)


def test_context_parallel_mask_is_one_additive_tensor_for_every_layer():
    import torch

    from megatron_patches.sdpa_attention import causal_mask

    cpu = torch.device("cpu")
    mask = causal_mask(8, 2, 1, torch.bfloat16, cpu)  # rank 1 holds positions 2, 3, 4, 5
    assert mask.dtype == torch.bfloat16 and causal_mask(8, 2, 1, torch.bfloat16, cpu) is mask  # shared: saved once
    allowed = (mask == 0).tolist()
    keys = [0, 1, 6, 7, 2, 3, 4, 5]  # gather order: rank 0's chunks, then rank 1's
    assert allowed == [[k <= q for k in keys] for q in (2, 3, 4, 5)]
    assert torch.isinf(mask[~(mask == 0)]).all()
