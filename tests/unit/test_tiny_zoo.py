"""The tiny model zoo: complete HF directories that transformers loads, written deterministically."""

import hashlib

import pytest
import torch

from mrl.models.tiny import TINY_ARCHS, main, tiny_hf_config, write_tiny_model


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_loads_in_transformers_and_tokenizes(arch, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_dir(arch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("12+7=19", return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == "12+7=19"
    assert len(tokenizer) <= model.config.vocab_size
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all() and logits.std() > 0.1  # random, not degenerate
    size = sum(f.stat().st_size for f in path.iterdir())
    assert 0.5e6 < size < 10e6


def test_moe_checkpoints_use_per_expert_hub_keys(tiny_model_dir):
    from safetensors import safe_open

    with safe_open(tiny_model_dir("deepseek_v3") / "model.safetensors", "pt") as f:
        names = set(f.keys())
        bias = f.get_tensor("model.layers.1.mlp.gate.e_score_correction_bias")
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names
    assert not any("gate_up_proj" in n for n in names)  # no fused expert slabs
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    digest = lambda p: hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()  # noqa: E731
    a = write_tiny_model("qwen3", tmp_path / "a", seed=3)
    b = write_tiny_model("qwen3", tmp_path / "b", seed=3)
    c = write_tiny_model("qwen3", tmp_path / "c", seed=4)
    assert digest(a) == digest(b) != digest(c)


def test_existing_directory_needs_force(tmp_path, capsys):
    write_tiny_model("llama", tmp_path / "m")
    assert main(["--arch", "llama", "--out", str(tmp_path / "m")]) == 2
    assert "exists: pass force=True (--force)" in capsys.readouterr().out
    assert main(["--arch", "llama", "--out", str(tmp_path / "m"), "--force"]) == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_unknown_arch():
    with pytest.raises(ValueError, match="supported: llama, qwen2"):
        tiny_hf_config("gpt2")
