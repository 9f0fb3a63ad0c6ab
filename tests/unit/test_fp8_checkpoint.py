"""FP8 checkpoints on disk: the tiny zoo's FP8 twin, reading it as dequantised weights
(mrl/bridge/hf_checkpoint.py), its dequantised twin and an unquantised checkpoint's FP8 twin
(mrl/bridge/dequantize.py, `mrl convert fp8-to-hf` and `hf-to-fp8`, the engines' checkpoint for
rollout.quantization fp8) and the one-line errors for a checkpoint that does not follow the format."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mrl import checkpoint_dir as cd
from mrl.bridge.dequantize import write_dequantized, write_quantized
from mrl.bridge.hf_checkpoint import CheckpointError, HFCheckpoint
from mrl.bridge.mapping import Segment
from mrl.cli.convert import main as convert_main
from mrl.cli.verify import main as verify_main
from mrl.models.tiny import main as tiny_main
from mrl.models.tiny import write_fp8_twin
from mrl.quant.fp8 import QUANTIZATION_CONFIG, QUANTIZED_WEIGHT, SCALE_SUFFIX, Fp8FormatError, dequantize, quantize


@pytest.fixture(scope="module")
def fp8_twin(tiny_model_dir, tmp_path_factory):
    return write_fp8_twin(tiny_model_dir("deepseek_v3"), tmp_path_factory.mktemp("fp8") / "dsv3-fp8")


def _copy(src, dst, edit=None, config_edit=None):
    shutil.copytree(src, dst)
    if edit:
        tensors = load_file(dst / "model.safetensors")
        edit(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if config_edit:
        config = json.loads((dst / "config.json").read_text())
        config_edit(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_the_twin_quantises_linear_weights_and_keeps_the_rest(tiny_model_dir, fp8_twin):
    original, twin = load_file(tiny_model_dir("deepseek_v3") / "model.safetensors"), load_file(fp8_twin / "model.safetensors")
    quantised = {n for n in original if QUANTIZED_WEIGHT.match(n)}
    assert len(quantised) == 5 * 4 + 3 + 3 * 8 * 3 + 3 * 3  # attention ×4 layers, dense MLP, 3 MoE layers
    assert set(twin) == set(original) | {n + SCALE_SUFFIX for n in quantised}
    for name, tensor in original.items():
        if name in quantised:
            q, scale_inv = quantize(tensor)
            assert torch.equal(twin[name].view(torch.uint8), q.view(torch.uint8)) and torch.equal(twin[name + SCALE_SUFFIX], scale_inv)
        else:
            assert torch.equal(twin[name], tensor), name  # embeddings, head, norms, router, its bias
    config = json.loads((fp8_twin / "config.json").read_text())
    assert config == json.loads((tiny_model_dir("deepseek_v3") / "config.json").read_text()) | {"quantization_config": QUANTIZATION_CONFIG}
    # The tiny model's widths are below 128: most blocks are partial, kv_a's 576 rows make 5 block rows.
    assert twin["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (5, 1)


def test_tiny_model_cli_writes_the_fp8_twin(tmp_path, capsys):
    assert tiny_main(["--arch", "qwen3", "--out", str(tmp_path / "q"), "--fp8"]) == 0
    assert "wrote tiny qwen3 FP8 model" in capsys.readouterr().out
    assert HFCheckpoint(tmp_path / "q").scales  # and it reads as FP8
    assert tiny_main(["--arch", "qwen3", "--out", str(tmp_path / "q"), "--fp8"]) == 2


def test_fp8_weights_read_as_their_dequantised_values(fp8_twin):
    ckpt = HFCheckpoint(fp8_twin)
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert name in ckpt.names() and name + SCALE_SUFFIX not in ckpt.names()
    assert ckpt.shape(name) == (576, 64)
    with safe_open(fp8_twin / "model.safetensors", framework="pt") as f:
        whole = dequantize(f.get_tensor(name), f.get_tensor(name + SCALE_SUFFIX))
    assert torch.equal(ckpt.read(name), whole)
    assert torch.equal(ckpt.read(name, torch.bfloat16), whole.to(torch.bfloat16))
    # Rows across a block boundary, and a column window (a ROW split) of another weight.
    assert torch.equal(ckpt.read_segment(Segment(name, 100, 300), (64,), torch.float32), whole[100:300])
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(ckpt.read_segment(Segment(o_proj, 0, 64, (64, 128)), (128,), torch.float32), ckpt.read(o_proj)[:, 64:128])
    norm = "model.layers.0.input_layernorm.weight"
    assert ckpt.read(norm).dtype == torch.float32 and norm in ckpt.names()


def _wrong_grid(tensors):
    tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"] = torch.ones(4, 1)


def _drop_scale(tensors):
    tensors.pop("model.layers.2.mlp.experts.3.down_proj.weight_scale_inv")


def _bf16_scale(tensors):
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    tensors[name] = tensors[name].to(torch.bfloat16)


@pytest.mark.parametrize("edit, config_edit, message", [
    (_wrong_grid, None, "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv has shape [4, 1] but weight "
                        "'model.layers.0.self_attn.kv_a_proj_with_mqa.weight' [576, 64] in [128, 128] blocks needs [5, 1]"),
    (_drop_scale, None, "'model.layers.2.mlp.experts.3.down_proj.weight' is stored as F8_E4M3 but the checkpoint has no "
                        "model.layers.2.mlp.experts.3.down_proj.weight_scale_inv"),
    (_bf16_scale, None, "model.layers.0.self_attn.o_proj.weight_scale_inv (BF16) scales"),
    (None, lambda c: c.pop("quantization_config"), "is stored as F8_E4M3 but config.json has no quantization_config"),
], ids=["grid", "no-scale", "scale-dtype", "no-config"])
def test_malformed_fp8_checkpoints_are_named(fp8_twin, tmp_path, edit, config_edit, message):
    ckpt = HFCheckpoint(_copy(fp8_twin, tmp_path / "bad", edit, config_edit))
    with pytest.raises((CheckpointError, Fp8FormatError)) as err:
        ckpt.check_quantized()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_an_unsupported_quantization_method_is_refused_on_open(fp8_twin, tmp_path):
    bad = _copy(fp8_twin, tmp_path / "awq", config_edit=lambda c: c.update(quantization_config={"quant_method": "awq"}))
    with pytest.raises(Fp8FormatError, match="quant_method='awq'"):
        HFCheckpoint(bad)


def _sharded(tensors: dict, directory, like):
    """`like`'s metadata and `tensors` in two files with an index."""
    src = _copy(like, directory)
    (src / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2], "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, src / file, metadata={"format": "pt"})
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: f for f, p in halves.items() for n in p}}))
    return src, halves


def test_dequantised_twin_sharded_like_its_source(fp8_twin, tmp_path):
    # A two-file source with an index, a scale in a different file from its weight.
    src, halves = _sharded(load_file(fp8_twin / "model.safetensors"), tmp_path / "sharded", fp8_twin)

    ckpt = HFCheckpoint(src)
    summary = write_dequantized(src, tmp_path / "bf16")
    out = HFCheckpoint(tmp_path / "bf16")
    assert summary["dequantised"] == len(ckpt.scales) > 0
    assert sorted(out.names()) == sorted(ckpt.names()) and not out.scales
    assert sorted(p.name for p in (tmp_path / "bf16").glob("*.safetensors")) == sorted(halves)
    for name in ckpt.names():
        expected = ckpt.read(name, torch.bfloat16)  # FP8 weights dequantised to bf16, the rest as stored
        assert torch.equal(out.read(name), expected), name
    assert out.read("model.layers.0.self_attn.o_proj.weight").dtype == torch.bfloat16
    assert out.read("model.norm.weight").dtype == torch.float32
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert (tmp_path / "bf16" / "tokenizer.json").exists()


def test_quantised_twin_sharded_like_its_source(tiny_model_dir, tmp_path, capsys):
    source = tiny_model_dir("deepseek_v3")
    src, halves = _sharded(load_file(source / "model.safetensors"), tmp_path / "sharded", source)
    summary = write_quantized(src, tmp_path / "fp8")
    ckpt, out = HFCheckpoint(src), HFCheckpoint(tmp_path / "fp8")
    assert out.fp8 is not None and summary["quantised"] == len(out.scales) > 0
    assert sorted(p.name for p in (tmp_path / "fp8").glob("*.safetensors")) == sorted(halves)
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"] == QUANTIZATION_CONFIG
    stored = {}
    for file in (tmp_path / "fp8").glob("*.safetensors"):
        stored |= load_file(file)
    for name in ckpt.names():
        if QUANTIZED_WEIGHT.match(name):  # the format's bytes: e4m3 values and their float32 block scales
            q, scale = quantize(ckpt.read(name))
            assert torch.equal(stored[name].view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(stored[name + SCALE_SUFFIX], scale), name
        else:
            assert torch.equal(stored[name], ckpt.read(name)), name
    assert convert_main(["hf-to-fp8", "--hf", str(src), "--out", str(tmp_path / "cli")]) == 0
    assert json.loads(capsys.readouterr().out)["quantised"] == summary["quantised"]
    assert convert_main(["hf-to-fp8", "--hf", str(tmp_path / "fp8"), "--out", str(tmp_path / "again")]) == 2
    assert "is already FP8" in capsys.readouterr().err


def test_fp8_engines_load_the_fp8_twin_written_at_start(tiny_model_dir, fp8_twin, tmp_path):
    from mrl.config.schema import RunConfig
    from mrl.launch.cluster import engine_checkpoint

    cfg = RunConfig()
    cfg.trainer.output_dir = str(tmp_path / "run")
    source = str(tiny_model_dir("deepseek_v3"))
    assert engine_checkpoint(cfg, source) == source  # unquantised engines load the checkpoint itself
    cfg.rollout.quantization = "fp8"
    twin = engine_checkpoint(cfg, source)
    assert twin == str(tmp_path / "run" / "rollout_fp8") and HFCheckpoint(twin).fp8 is not None
    assert engine_checkpoint(cfg, source) == twin  # a restart writes it again
    assert engine_checkpoint(cfg, str(fp8_twin)) == str(fp8_twin)  # an FP8 model.path is loaded as it is


def test_convert_fp8_to_hf_command(fp8_twin, tiny_model_dir, tmp_path, capsys):
    assert convert_main(["fp8-to-hf", "--hf", str(fp8_twin), "--out", str(tmp_path / "out"), "--dtype", "fp32"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "float32"
    assert convert_main(["fp8-to-hf", "--hf", str(fp8_twin), "--out", str(tmp_path / "out")]) == 2
    assert "already exists: pass --force" in capsys.readouterr().err
    assert convert_main(["fp8-to-hf", "--hf", str(tiny_model_dir("llama")), "--out", str(tmp_path / "x")]) == 2
    assert "is not an FP8 checkpoint" in capsys.readouterr().err


def test_hf_metadata_copies_drop_the_quantization_config(fp8_twin, tmp_path):
    copied = cd.copy_hf_metadata(fp8_twin, tmp_path / "hf")
    assert sorted(copied) == ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "quantization_config" not in config
    assert config == {k: v for k, v in json.loads((fp8_twin / "config.json").read_text()).items() if k != "quantization_config"}


def test_verify_rollout_refuses_an_fp8_checkpoint_before_starting_anything(fp8_twin, capsys):
    assert verify_main(["--hf", str(fp8_twin), "--rollout", "vllm"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--rollout needs an unquantised checkpoint" in err and "mrl convert fp8-to-hf" in err and "\n" not in err
