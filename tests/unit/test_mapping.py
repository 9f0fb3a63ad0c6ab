"""Mapping segments: import reads and export writes the same rows, so round trips are identities."""

import pytest
import torch

from mrl.bridge.mapping import (
    MappingError, Split, SplitDims, canonical_name, hf_shapes, lookup, segments, table_for, template_of,
)
from mrl.models.registry import model_spec_from_hf


def _round_trip(split, names, hf, shape, shards, dims):
    """Build every shard from HF tensors by segments, then rebuild HF tensors from the shards."""
    shard_data = []
    for rank in range(shards):
        parts = [
            torch.zeros(seg.rows, *shape[1:]) if seg.hf is None
            else (hf[seg.hf][seg.start:seg.stop] if seg.cols is None else hf[seg.hf][seg.start:seg.stop, seg.cols[0]:seg.cols[1]])
            for seg in segments(split, names, shape, rank, shards, dims)
        ]
        shard_data.append(torch.cat(parts))
    rebuilt = {n: torch.full(s, float("nan")) for n, s in hf_shapes(split, names, shape, shards, dims).items()}
    for rank, data in enumerate(shard_data):
        offset = 0
        for seg in segments(split, names, shape, rank, shards, dims):
            if seg.hf is not None:
                target = rebuilt[seg.hf][seg.start:seg.stop]
                target = target if seg.cols is None else target[:, seg.cols[0]:seg.cols[1]]
                target.copy_(data[offset:offset + seg.rows])
            offset += seg.rows
    return shard_data, rebuilt


@pytest.mark.parametrize("heads, groups, tp", [(4, 2, 2), (4, 1, 2), (8, 2, 4), (8, 8, 4), (4, 1, 4)])
def test_qkv_interleave_round_trip_including_fewer_kv_heads_than_tp(heads, groups, tp):
    hd, hidden = 4, 5  # (heads + 2·groups)·hd must divide by TP, as Megatron requires
    dims = SplitDims(heads, groups, vocab_size=0)
    hf = {"q": torch.randn(heads * hd, hidden), "k": torch.randn(groups * hd, hidden), "v": torch.randn(groups * hd, hidden)}
    shape = ((heads + 2 * groups) * hd, hidden)
    shards, rebuilt = _round_trip(Split.QKV, ("q", "k", "v"), hf, shape, tp, dims)
    assert all(torch.equal(rebuilt[n], hf[n]) for n in hf)
    # Megatron's global layout: per group [its g query heads | its key | its value].
    g = heads // groups
    full = torch.cat(shards).view(groups, (g + 2) * hd, hidden)
    assert torch.equal(full[0, : g * hd], hf["q"][: g * hd])
    assert torch.equal(full[0, g * hd : (g + 1) * hd], hf["k"][:hd])


def test_gated_shards_hold_their_gate_rows_then_their_up_rows():
    gate, up = torch.arange(8.0).view(8, 1), 100 + torch.arange(8.0).view(8, 1)
    shards, rebuilt = _round_trip(Split.GATED, ("g", "u"), {"g": gate, "u": up}, (16, 1), 2, SplitDims(1, 1, 0))
    assert shards[1].flatten().tolist() == [4, 5, 6, 7, 104, 105, 106, 107]
    assert torch.equal(rebuilt["g"], gate) and torch.equal(rebuilt["u"], up)


def test_vocab_padding_is_zero_and_stripped():
    emb = torch.randn(10, 3)
    shards, rebuilt = _round_trip(Split.VOCAB, ("e",), {"e": emb}, (16, 3), 2, SplitDims(1, 1, vocab_size=10))
    assert torch.equal(shards[1][2:], torch.zeros(6, 3))
    assert rebuilt["e"].shape == (10, 3) and torch.equal(rebuilt["e"], emb)


def test_row_split_takes_columns():
    w = torch.randn(4, 6)
    shards, rebuilt = _round_trip(Split.ROW, ("w",), {"w": w}, (4, 6), 3, SplitDims(1, 1, 0))
    assert torch.equal(shards[2], w[:, 4:6]) and torch.equal(rebuilt["w"], w)


def test_names_globalise_layers_and_experts():
    assert template_of("decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight") == (
        "decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc1.weight", 3, 5)
    assert canonical_name("decoder.layers.0.mlp.experts.linear_fc2.weight7") == (
        "decoder.layers.0.mlp.experts.local_experts.7.linear_fc2.weight")


def test_expert_lookup_and_unknown_tensor(tiny_model_dir):
    spec = model_spec_from_hf(tiny_model_dir("deepseek_v3"))
    table = table_for(spec)
    rule, names = lookup(table, "decoder.layers.2.mlp.experts.local_experts.6.linear_fc1.weight", spec.arch)
    assert names == ("model.layers.2.mlp.experts.6.gate_proj.weight", "model.layers.2.mlp.experts.6.up_proj.weight")
    assert rule.expert and rule.split is Split.GATED
    with pytest.raises(MappingError, match="no deepseek_v3 mapping for Megatron tensor 'decoder.layers.0.mystery.weight'"):
        lookup(table, "decoder.layers.0.mystery.weight", spec.arch)
