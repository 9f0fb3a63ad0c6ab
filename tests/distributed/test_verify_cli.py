"""`mrl verify` end to end: a passing summary, and one-line errors for bad layouts and checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from mrl.cli.verify import main as verify_main


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_weights(model_dir, edit):
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_verify_passes_and_prints_a_json_summary(tiny_model_dir, capsys):
    assert verify_main(["--hf", str(tiny_model_dir("qwen3_moe")), "--ep", "2", "--tp", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] and summary["world_size"] == 4
    assert summary["logits"]["max_abs_diff"] <= 1e-4
    assert summary["export"]["tensors_compared"] > 100 and summary["export"]["mismatches"] == []


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tp", "3"], "4 attention heads are not divisible by --tp 3"),
        (["--ep", "3"], "8 routed experts are not divisible by --ep 3"),
        (["--pp", "3"], "4 layers cannot be split into PP×VPP = 3×1 = 3 equal pipeline chunks"),
    ],
)
def test_layout_errors_stop_before_any_worker_starts(tiny_model_dir, capsys, flags, message):
    assert verify_main(["--hf", str(tiny_model_dir("qwen3_moe")), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_unsupported_architecture(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    assert verify_main(["--hf", str(tmp_path)]) == 2
    assert "BertModel is not supported; supported: LlamaForCausalLM" in capsys.readouterr().err


def _drop(name):
    return lambda tensors: tensors.pop(name)


def _add(name):
    return lambda tensors: tensors.update({name: tensors["model.norm.weight"].clone()})


def _reshape(name):
    return lambda tensors: tensors.update({name: tensors[name][:-1].clone()})


@pytest.mark.parametrize(
    "edit, message",
    [
        (_drop("model.layers.1.mlp.gate_proj.weight"), "lacks 1 tensor(s) the llama model needs, first 'model.layers.1.mlp.gate_proj.weight'"),
        (_add("model.layers.0.extra.weight"), "has 1 tensor(s) the llama model does not use, first 'model.layers.0.extra.weight'"),
        (_reshape("model.layers.2.self_attn.k_proj.weight"), "tensor 'model.layers.2.self_attn.k_proj.weight' has shape [63, 64] but config.json implies [64, 64]"),
    ],
    ids=["missing", "unexpected", "shape"],
)
def test_checkpoint_errors_name_the_tensor(tiny_model_dir, tmp_path, capsys, edit, message):
    model = _copy(tiny_model_dir("llama"), tmp_path / "model")
    _edit_weights(model, edit)
    capsys.readouterr()  # the zoo writes its model with a progress bar on first use: not verify's output
    assert verify_main(["--hf", str(model)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err, err
    assert len(err.splitlines()) == 1


def test_sharded_bf16_checkpoint_round_trips(tiny_model_dir, tmp_path, capsys):
    """Hub checkpoints are usually bf16 and sharded with an index: both must verify."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen2"), dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="300KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert verify_main(["--hf", str(tmp_path / "sharded"), "--tp", "2", "--tol", "1e-4"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["export"]["mismatches"] == [] and summary["export"]["missing"] == []
