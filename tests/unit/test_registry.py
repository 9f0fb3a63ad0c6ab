"""HF config → Megatron config translation and its errors."""

from pathlib import Path

import pytest

from mrl.models.registry import (
    DEEPSEEK_V3_DEFAULTS,
    SUPPORTED_ARCHITECTURES,
    UnsupportedModelError,
    model_spec_from_hf,
)
from mrl.models.tiny import TINY_MODELS, TINY_VARIANTS, tiny_hf_config

FIXTURES = Path(__file__).parent.parent / "fixtures"


@pytest.mark.parametrize("arch", TINY_MODELS)
def test_every_tiny_architecture_translates(arch):
    spec = model_spec_from_hf(tiny_hf_config(arch))
    assert spec.arch == TINY_VARIANTS.get(arch, (arch,))[0]
    assert spec.config["num_layers"] == tiny_hf_config(arch)["num_hidden_layers"]


def test_unsupported_architecture_lists_the_supported_ones():
    with pytest.raises(UnsupportedModelError) as err:
        model_spec_from_hf({"architectures": ["GPT2LMHeadModel"]})
    assert "GPT2LMHeadModel is not supported" in str(err.value)
    assert all(name in str(err.value) for name in SUPPORTED_ARCHITECTURES)


def test_architecture_specific_settings():
    qwen2 = model_spec_from_hf(tiny_hf_config("qwen2"))
    assert qwen2.config["add_qkv_bias"]
    qwen3 = model_spec_from_hf(tiny_hf_config("qwen3"))
    assert qwen3.config["qk_layernorm"] and qwen3.config["kv_channels"] == tiny_hf_config("qwen3")["head_dim"]
    dsv3 = model_spec_from_hf(tiny_hf_config("deepseek_v3"))
    hf = tiny_hf_config("deepseek_v3")
    assert dsv3.mla and dsv3.config["moe_router_score_function"] == "sigmoid"
    assert dsv3.config["moe_router_enable_expert_bias"]
    assert dsv3.config["moe_layer_freq"][: hf["first_k_dense_replace"] + 1] == [0] * hf["first_k_dense_replace"] + [1]
    assert dsv3.config["rope_type"] == "yarn"


def test_unsupported_rope_scaling_is_refused():
    hf = tiny_hf_config("llama") | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0}}
    with pytest.raises(UnsupportedModelError, match="rope_scaling"):
        model_spec_from_hf(hf)


def test_missing_config_field_is_named():
    hf = {k: v for k, v in tiny_hf_config("qwen3").items() if k != "intermediate_size"}
    with pytest.raises(UnsupportedModelError, match="lacks field 'intermediate_size'"):
        model_spec_from_hf(hf)


def test_published_deepseek_v3_config_translates():
    spec = model_spec_from_hf(FIXTURES / "deepseek_v3_671b")
    c = spec.config
    assert (c["moe_router_num_groups"], c["moe_router_group_topk"], c["moe_router_topk"]) == (8, 4, 8)
    assert c["rope_type"] == "yarn" and (c["mscale"], c["mscale_all_dim"]) == (1.0, 1.0)


def _without(hf: dict, *keys: str) -> dict:
    return {k: v for k, v in hf.items() if k not in keys}


def test_deepseek_v3_fields_left_out_mean_what_they_mean_to_transformers():
    """A config.json without n_group, routed_scaling_factor, … is read with transformers' defaults."""
    from transformers import AutoConfig

    # 32 experts: transformers' default 8 groups need at least 2 experts each.
    hf = _without(tiny_hf_config("deepseek_v3"), *DEEPSEEK_V3_DEFAULTS) | dict(n_routed_experts=32)
    reference = AutoConfig.for_model("deepseek_v3", **_without(hf, "model_type"))
    assert DEEPSEEK_V3_DEFAULTS == {k: getattr(reference, k) for k in DEEPSEEK_V3_DEFAULTS}
    c = model_spec_from_hf(hf).config
    assert c["moe_router_num_groups"] == reference.n_group
    assert c["moe_router_group_topk"] == reference.topk_group
    assert c["moe_router_topk_scaling_factor"] == reference.routed_scaling_factor
    assert c["moe_shared_expert_intermediate_size"] == reference.moe_intermediate_size * reference.n_shared_experts
    assert c["moe_layer_freq"].count(0) == reference.first_k_dense_replace
    assert c["q_lora_rank"] == reference.q_lora_rank


def test_qwen3_head_dim_left_out_means_what_it_means_to_transformers():
    from transformers import AutoConfig

    hf = _without(tiny_hf_config("qwen3"), "head_dim")
    reference = AutoConfig.for_model("qwen3", **_without(hf, "model_type"))
    assert model_spec_from_hf(hf).config["kv_channels"] == reference.head_dim == 128
    # Qwen3-MoE has no such default: head_dim is hidden_size // heads there.
    moe = _without(tiny_hf_config("qwen3_moe"), "head_dim")
    assert model_spec_from_hf(moe).config["kv_channels"] == moe["hidden_size"] // moe["num_attention_heads"]


_YARN = tiny_hf_config("deepseek_v3")["rope_scaling"]

# Settings transformers (or vLLM) honours and the Megatron model built here would not: each must be
# refused at load with a one-line message naming it, not run as a different model.
REFUSED = {
    "hidden_act": ("llama", dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    "qwen2_sliding_window": ("qwen2", dict(use_sliding_window=True, sliding_window=16), "sliding-window attention"),
    "qwen3_sliding_layer_types": (
        "qwen3", dict(layer_types=["full_attention"] * 3 + ["sliding_attention"]), "sliding-window attention",
    ),
    "qwen3_moe_sliding_window": ("qwen3_moe", dict(use_sliding_window=True), "sliding-window attention"),
    "partial_rotary": ("qwen3", dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5 is not supported"),
    "dsv3_top1": ("deepseek_v3", dict(num_experts_per_tok=1), "norm_topk_prob=true and num_experts_per_tok=1"),
    "dsv3_unnormed": ("deepseek_v3", dict(norm_topk_prob=False), "norm_topk_prob=false"),
    "dsv3_groups_uneven": ("deepseek_v3", dict(n_group=3), "n_routed_experts=8, n_group=3, topk_group=1"),
    "dsv3_group_of_one": ("deepseek_v3", dict(n_group=8, topk_group=2), "groups of at least 2 experts"),
    "dsv3_too_many_groups": ("deepseek_v3", dict(topk_group=3), "topk_group must be at most n_group"),
    "dsv3_topk_over_groups": ("deepseek_v3", dict(num_experts_per_tok=5), "num_experts_per_tok at most"),
    "dsv3_softmax": ("deepseek_v3", dict(scoring_func="softmax"), "scoring_func='softmax' is not supported"),
    "dsv3_scoring_left_out": ("deepseek_v3", dict(scoring_func=None), "scoring_func=None is not supported"),
    "dsv3_greedy": ("deepseek_v3", dict(topk_method="greedy"), "topk_method='greedy' is not supported"),
    "dsv3_yarn_mscale_alone": (
        "deepseek_v3", dict(rope_scaling=_YARN | dict(mscale=0.707, mscale_all_dim=0)), "set both, or neither",
    ),
    "dsv3_yarn_mscale_all_dim_alone": (
        "deepseek_v3", dict(rope_scaling=_without(_YARN, "mscale")), "mscale=None with mscale_all_dim=1.0",
    ),
    "dsv3_yarn_attention_factor": (
        "deepseek_v3", dict(rope_scaling=_YARN | dict(attention_factor=1.2)), "attention_factor is set",
    ),
    "dsv3_yarn_no_truncate": ("deepseek_v3", dict(rope_scaling=_YARN | dict(truncate=False)), "truncate=false"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_settings_megatron_would_ignore_are_refused_in_one_line(case):
    arch, changes, message = REFUSED[case]
    hf = {k: v for k, v in (tiny_hf_config(arch) | changes).items() if v is not None}
    with pytest.raises(UnsupportedModelError) as refused:
        model_spec_from_hf(hf)
    assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def test_route_shape_counts_moe_layers_only():
    from mrl.routes import RouteShape

    shapes = {arch: model_spec_from_hf(tiny_hf_config(arch)).route_shape
              for arch in ("qwen3", "qwen3_moe", "qwen3_moe_dense", "deepseek_v3", "deepseek_v3_groups")}
    assert shapes == {"qwen3": None, "qwen3_moe": RouteShape(4, 2, 8), "qwen3_moe_dense": RouteShape(3, 2, 8),
                      "deepseek_v3": RouteShape(3, 2, 8),  # first_k_dense_replace 1
                      "deepseek_v3_groups": RouteShape(3, 3, 12)}
