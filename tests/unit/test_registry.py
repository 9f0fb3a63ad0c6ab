"""HF config → Megatron config translation and its errors."""

import pytest

from mrl.models.registry import SUPPORTED_ARCHITECTURES, UnsupportedModelError, model_spec_from_hf
from mrl.models.tiny import TINY_ARCHS, tiny_hf_config


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_every_tiny_architecture_translates(arch):
    spec = model_spec_from_hf(tiny_hf_config(arch))
    assert spec.arch == arch
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
