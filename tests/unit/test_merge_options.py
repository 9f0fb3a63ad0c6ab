"""mrl-merge option parsing and the fused-expert expansion of the expected HF layout."""

import pytest

from checkpoints_tools.errors import CheckpointError
from checkpoints_tools.merge import _per_expert, parse_size


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5 kb") == 1500
    assert parse_size("1024") == 1024
    for bad in ("five", "5GX", "-1GB", "5G"):
        with pytest.raises(CheckpointError, match="is not a size"):
            parse_size(bad)


def test_fused_experts_expand_to_file_layout():
    up = _per_expert("model.layers.1.mlp.experts.gate_up_proj", (2, 64, 16))
    assert up == {f"model.layers.1.mlp.experts.{e}.{p}_proj.weight": (32, 16) for e in (0, 1) for p in ("gate", "up")}
    down = _per_expert("model.layers.1.mlp.experts.down_proj", (2, 16, 32))
    assert down == {f"model.layers.1.mlp.experts.{e}.down_proj.weight": (16, 32) for e in (0, 1)}
    assert _per_expert("model.norm.weight", (16,)) == {"model.norm.weight": (16,)}
