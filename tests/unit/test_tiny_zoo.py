"""The tiny model zoo: complete HF directories that transformers loads, written deterministically."""

import hashlib
import json

import pytest
import torch

from mrl.models.tiny import TINY_ARCHS, TINY_MODELS, main, tiny_hf_config, write_tiny_model

MOE_ARCHS = ("qwen3_moe", "deepseek_v3")


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_loads_in_transformers_and_tokenizes(arch, tiny_model_dir):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_dir(arch)
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    # Nothing missing (would be silently random-initialised), unexpected or reshaped.
    assert not any(info.values()), info
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("12+7=19", return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == "12+7=19"
    assert 512 <= len(tokenizer) <= model.config.vocab_size
    # transformers 5 substitutes its own tokenizer class for some model types (Qwen2Tokenizer for
    # qwen2); whatever it picks must tokenise exactly as tokenizer.json does.
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    for text in ("12+7=19", "What is 123 plus 45? The answer is 168.", "héllo\n  world"):
        assert tokenizer(text).input_ids == raw.encode(text).ids, (arch, type(tokenizer).__name__, text)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all() and logits.std() > 0.1  # random, not degenerate
    assert all(t.dtype == torch.float32 for t in _tensors(path).values())
    size = sum(f.stat().st_size for f in path.iterdir())
    assert 0.5e6 < size < 10e6
    assert path.stat().st_mode & 0o777 == 0o755  # readable by others, like any model directory
    assert all(f.stat().st_mode & 0o777 == 0o644 for f in path.iterdir())


@pytest.mark.parametrize("arch", TINY_MODELS)  # variants too: their point is the fields they change
def test_config_json_is_the_table_and_transformers_reads_it_as_meant(arch, tiny_model_dir):
    from transformers import AutoConfig

    path = tiny_model_dir(arch)
    written = json.loads((path / "config.json").read_text())
    assert written == tiny_hf_config(arch)  # hub spelling, exactly the table
    config = AutoConfig.from_pretrained(path)
    assert config.dtype == torch.float32
    # A misspelt field would be kept as an inert attribute; check the ones the model reads landed.
    legacy = {"rope_scaling", "rope_theta", "torch_dtype", "architectures", "model_type"}
    for key, value in written.items():
        if key not in legacy:
            assert getattr(config, key) == value, key
    assert config.rope_parameters["rope_theta"] == written["rope_theta"]
    for key, value in written.get("rope_scaling", {}).items():
        assert config.rope_parameters[key] == value, key
    assert written["vocab_size"] >= 512  # the tokenizer's size


def test_some_vocab_sizes_need_padding():
    sizes = [tiny_hf_config(arch)["vocab_size"] for arch in TINY_ARCHS]
    assert any(size % 128 for size in sizes) and any(size % 256 for size in sizes)


def test_tiny_hf_config_returns_independent_copies():
    config = tiny_hf_config("llama")
    config["rope_scaling"]["factor"] = 99.0
    assert tiny_hf_config("llama")["rope_scaling"]["factor"] == 8.0


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_checkpoints_use_per_expert_hub_keys(arch, tiny_model_dir):
    tensors = _tensors(tiny_model_dir(arch))
    layer = 1  # a MoE layer in both (DeepSeek-V3's layer 0 is dense)
    experts = {n for n in tensors if n.startswith(f"model.layers.{layer}.mlp.experts.")}
    assert len(experts) == 8 * 3
    assert tensors[f"model.layers.{layer}.mlp.experts.7.gate_proj.weight"].shape == (32, 64)
    assert tensors[f"model.layers.{layer}.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    assert not any("gate_up_proj" in n for n in tensors)  # no fused expert slabs
    if arch == "deepseek_v3":
        bias = tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
        assert bias.dtype == torch.float32 and bias.abs().min() > 0
        assert "model.layers.0.mlp.gate_proj.weight" in tensors  # first_k_dense_replace=1


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_transformers_save_round_trips_the_file(arch, tiny_model_dir, tmp_path):
    """Loading fuses experts in memory; transformers' own save must give back the same tensors."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(arch)
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).save_pretrained(tmp_path)
    original, resaved = _tensors(path), _tensors(tmp_path)
    assert original.keys() == resaved.keys()
    assert all(torch.equal(original[n], resaved[n]) for n in original)


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    def digest(path, name="model.safetensors"):
        return hashlib.sha256((path / name).read_bytes()).hexdigest()

    torch.manual_seed(123)
    before = torch.rand(3)
    a = write_tiny_model("deepseek_v3", tmp_path / "a", seed=3)
    torch.manual_seed(123)
    b = write_tiny_model("deepseek_v3", tmp_path / "b", seed=3)
    assert torch.equal(torch.rand(3), before)  # the caller's global RNG stream is untouched
    c = write_tiny_model("deepseek_v3", tmp_path / "c", seed=4)
    assert digest(a) == digest(b) != digest(c)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert digest(a, name) == digest(c, name)


def test_existing_directory_needs_force(tmp_path, capsys):
    write_tiny_model("llama", tmp_path / "m")
    assert main(["--arch", "llama", "--out", str(tmp_path / "m")]) == 2
    assert "exists: pass force=True (--force)" in capsys.readouterr().out
    assert main(["--arch", "qwen3", "--out", str(tmp_path / "m"), "--force", "--seed", "5"]) == 0
    assert "wrote tiny qwen3 model" in capsys.readouterr().out
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "qwen3"
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no staging or old copy left behind


def test_unknown_arch():
    with pytest.raises(ValueError, match="supported: llama, qwen2, qwen3, qwen3_moe, deepseek_v3"):
        tiny_hf_config("gpt2")
    with pytest.raises(ValueError, match="supported: llama"):
        write_tiny_model("gpt2", "/nonexistent/never-written")
    with pytest.raises(SystemExit):
        main(["--arch", "gpt2", "--out", "/nonexistent/never-written"])


def test_variants_change_only_their_fields():
    groups = tiny_hf_config("deepseek_v3_groups")
    assert "rope_scaling" not in groups  # None in a variant removes the field
    assert {k: v for k, v in tiny_hf_config("deepseek_v3").items() if k != "rope_scaling"} == groups | dict(
        n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
        qk_nope_head_dim=32, v_head_dim=32,
    )
    assert tiny_hf_config("qwen3_moe_unnormed") == tiny_hf_config("qwen3_moe") | dict(norm_topk_prob=False)
    assert tiny_hf_config("qwen3_moe_dense") == tiny_hf_config("qwen3_moe") | dict(mlp_only_layers=[0])
