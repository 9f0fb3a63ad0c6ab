"""Checkpoints written the way Megatron-LM writes them (tests/fixtures/megatron_lm.py) → mrl-merge →
HF, bitwise, for dense and MoE models in TP2, PP2, EP2 and PP2×VPP2, torch_dist and the legacy
per-rank torch format, with and without optimizer state; the checkpoint's dtype kept; every bad
input one line naming the tensor or setting and the fix; `mrl verify --checkpoint` loads one into
another layout as RL does.

All checkpoints are written in ONE 2-process gloo world (the layouts in turn), so the module pays
process start-up once; merges run in this process (no process group).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checkpoints_tools import merge as merge_mod
from checkpoints_tools.errors import CheckpointError
from fixtures.megatron_lm import ITERATION, TRACKER, write_checkpoint
from mrl.cli.merge import main as merge_main
from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local

WORLD = 2
TP2, PP2, EP2, VPP2 = (ParallelLayout(tp=2), ParallelLayout(pp=2), ParallelLayout(ep=2),
                       ParallelLayout(pp=2, vpp=2))
# name → (tiny model, layout, format, optimizer state saved, parameter dtype)
CASES = {
    "llama-TP2": ("llama", TP2, "torch_dist", True, torch.float32),
    "llama-PP2": ("llama", PP2, "torch_dist", False, torch.float32),
    "llama-VPP2": ("llama", VPP2, "torch_dist", True, torch.float32),
    "qwen3_moe-TP2": ("qwen3_moe", TP2, "torch_dist", False, torch.float32),
    "qwen3_moe-PP2": ("qwen3_moe", PP2, "torch_dist", False, torch.float32),
    "qwen3_moe-EP2": ("qwen3_moe", EP2, "torch_dist", True, torch.float32),
    "qwen3_moe-VPP2": ("qwen3_moe", VPP2, "torch_dist", False, torch.float32),
    "deepseek_v3-EP2": ("deepseek_v3", EP2, "torch_dist", True, torch.float32),
    "qwen3-TP2-bf16": ("qwen3", TP2, "torch_dist", False, torch.bfloat16),  # a --bf16 run
    "legacy-llama-TP2": ("llama", TP2, "torch", True, torch.float32),
    "legacy-llama-VPP2": ("llama", VPP2, "torch", False, torch.float32),
    "legacy-qwen3_moe-TP2": ("qwen3_moe", TP2, "torch", False, torch.float32),
    "legacy-qwen3_moe-EP2": ("qwen3_moe", EP2, "torch", True, torch.float32),
    "legacy-deepseek_v3-PP2": ("deepseek_v3", PP2, "torch", False, torch.float32),
}
BITWISE = [name for name, case in CASES.items() if case[4] is torch.float32]


def _write_all(rank: int, world: int, jobs: list[tuple]) -> int:
    for hf, layout, root, fmt, optimizer, dtype in jobs:
        write_checkpoint(hf, layout, root, fmt=fmt, optimizer=optimizer, params_dtype=dtype)
    return len(jobs)


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """Case name → checkpoint root (tracker file + iter_0000100/), all written in one world."""
    base = tmp_path_factory.mktemp("megatron-lm")
    roots = {name: base / name for name in CASES}
    jobs = [(str(tiny_model_dir(arch)), layout, str(roots[name]), fmt, optimizer, dtype)
            for name, (arch, layout, fmt, optimizer, dtype) in CASES.items()]
    run_local(_write_all, WORLD, jobs, timeout_s=900)
    return roots


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _hf(name: str, tiny_model_dir) -> Path:
    return tiny_model_dir(CASES[name][0])


@pytest.mark.parametrize("name", BITWISE)
def test_merge_is_bitwise(name, checkpoints, tiny_model_dir, tmp_path):
    hf = _hf(name, tiny_model_dir)
    summary = merge_mod.merge(checkpoints[name], tmp_path / "hf", hf_config=hf, progress=False)
    original, merged = _tensors(hf), _tensors(tmp_path / "hf")
    assert sorted(merged) == sorted(original)
    for tensor_name, tensor in original.items():
        assert merged[tensor_name].dtype == torch.float32 and torch.equal(merged[tensor_name], tensor), tensor_name
    assert summary["format"] == "Megatron-LM" and summary["step"] == ITERATION and summary["dtype"] == "fp32"
    for file in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (tmp_path / "hf" / file).is_file(), file  # config and tokenizer come from --hf-config


def test_a_bf16_checkpoint_merges_as_bf16(checkpoints, tiny_model_dir, tmp_path):
    hf = _hf("qwen3-TP2-bf16", tiny_model_dir)
    summary = merge_mod.merge(checkpoints["qwen3-TP2-bf16"], tmp_path / "hf", hf_config=hf, progress=False)
    merged = _tensors(tmp_path / "hf")
    assert summary["dtype"] == "bf16"
    for name, tensor in _tensors(hf).items():
        assert merged[name].dtype == torch.bfloat16 and torch.equal(merged[name], tensor.to(torch.bfloat16)), name


def test_cli_iteration_dir_and_the_config_flag(checkpoints, tiny_model_dir, tmp_path, capsys):
    iteration = checkpoints["qwen3_moe-EP2"] / f"iter_{ITERATION:07d}"
    assert merge_main([str(iteration), "--out", str(tmp_path / "a"), "--hf-config", str(_hf("qwen3_moe-EP2", tiny_model_dir)),
                       "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["checkpoint"] == str(iteration) and summary["dtype"] == "fp32"
    # --dtype narrows; the router's expert bias of DeepSeek-V3 stays fp32 (its HF dtype).
    assert merge_main([str(checkpoints["deepseek_v3-EP2"]), "--out", str(tmp_path / "b"), "--dtype", "bf16",
                       "--config", str(_hf("deepseek_v3-EP2", tiny_model_dir)), "--no-progress"]) == 0
    merged = _tensors(tmp_path / "b")
    for name, tensor in _tensors(_hf("deepseek_v3-EP2", tiny_model_dir)).items():
        want = tensor.float() if name.endswith("e_score_correction_bias") else tensor.to(torch.bfloat16)
        assert merged[name].dtype == want.dtype and torch.equal(merged[name], want), name


def test_verify_after_merge(checkpoints, tiny_model_dir, tmp_path, capsys):
    rc = merge_main([str(checkpoints["qwen3_moe-VPP2"]), "--out", str(tmp_path / "hf"), "--verify", "--no-progress",
                     "--hf-config", str(_hf("qwen3_moe-VPP2", tiny_model_dir))])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0 and summary["verify"]["ok"] and summary["verify"]["max_abs_diff"] <= 1e-4, summary


def test_mrl_verify_loads_it_into_another_layout(checkpoints, tiny_model_dir, capsys):
    """RL's loader (load_policy_weights) reads a PP2×VPP2 Megatron-LM checkpoint into TP2: logits as
    transformers' on the merged model, and every exported tensor bitwise the merged file's."""
    from mrl.cli.verify import main as verify_main

    rc = verify_main(["--checkpoint", str(checkpoints["llama-VPP2"]), "--hf", str(_hf("llama-VPP2", tiny_model_dir)),
                      "--tp", "2", "--transformer-impl", "local"])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0 and summary["ok"], summary
    assert summary["export"]["tensors_compared"] > 0 and not summary["export"]["mismatches"]


# ------------------------------------------------------------------------------------- bad input
def _fails(capsys, argv: list[str], match: str) -> str:
    rc = merge_main(argv + ["--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and match in err, err
    return err


def _config(tiny_model_dir, tmp_path: Path, arch: str, **changes) -> Path:
    """A copy of a tiny model's HF directory (config and tokenizer, no weights) with config changes."""
    out = tmp_path / f"{arch}-changed"
    shutil.copytree(tiny_model_dir(arch), out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | changes))
    return out


def test_without_hf_config(checkpoints, tmp_path, capsys):
    _fails(capsys, [str(checkpoints["llama-TP2"]), "--out", str(tmp_path / "o")],
           "is a Megatron-LM checkpoint, which holds no HF config: pass --hf-config")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["qwen3_moe-TP2", "legacy-qwen3_moe-TP2"])
def test_wrong_architecture_names_the_tensor(name, checkpoints, tiny_model_dir, tmp_path, capsys):
    _fails(capsys, [str(checkpoints[name]), "--out", str(tmp_path / "o"), "--hf-config", str(tiny_model_dir("llama"))],
           "no llama mapping for Megatron tensor 'decoder.layers.0.self_attention.q_layernorm.weight'")
    assert not list(tmp_path.glob("o*"))


@pytest.mark.parametrize("changes,match", [
    ({"intermediate_size": 96}, "checkpoint tensor 'decoder.layers.0.mlp.linear_fc1.weight' of shape [256, 64] makes "
                                "model.layers.0.mlp.gate_proj.weight of shape [128, 64], but the HF config in"),
    ({"num_hidden_layers": 2}, "checkpoint tensor 'decoder.layers.2.self_attention.linear_qkv.layer_norm_weight' makes "
                               "HF tensor 'model.layers.2.input_layernorm.weight', which the llama model of"),
    ({"num_hidden_layers": 6}, "no checkpoint tensor makes model.layers.4."),
    ({"vocab_size": 2000}, "checkpoint tensor 'embedding.word_embeddings.weight' has 1024 vocabulary rows, fewer than "
                           "vocab_size 2000"),
    ({"rope_theta": 10000.0}, "was trained with rotary_base=500000 (its args) but the HF config in"),
])
def test_layout_mismatch_names_the_tensor_or_setting(changes, match, checkpoints, tiny_model_dir, tmp_path, capsys):
    config = _config(tiny_model_dir, tmp_path, "llama", **changes)
    err = _fails(capsys, [str(checkpoints["llama-TP2"]), "--out", str(tmp_path / "o"), "--hf-config", str(config)], match)
    assert "pass the HF config of the model that was trained" in err
    assert not list(tmp_path.glob("o*"))


def test_legacy_missing_rank_and_torch_dist_missing_file(checkpoints, tiny_model_dir, tmp_path, capsys):
    legacy = tmp_path / "legacy"
    shutil.copytree(checkpoints["legacy-llama-TP2"], legacy)
    shutil.rmtree(legacy / f"iter_{ITERATION:07d}" / "mp_rank_01")
    hf = str(tiny_model_dir("llama"))
    _fails(capsys, [str(legacy), "--out", str(tmp_path / "o"), "--hf-config", hf],
           "lacks the files of TP rank 1, PP rank 0, EP rank 0 (its args say TP2 PP1 EP1)")
    dist = tmp_path / "dist"
    shutil.copytree(checkpoints["llama-TP2"], dist)
    distcp = sorted((dist / f"iter_{ITERATION:07d}").glob("*.distcp"))[-1]
    distcp.write_bytes(distcp.read_bytes()[:100])
    _fails(capsys, [str(dist), "--out", str(tmp_path / "o"), "--hf-config", hf], f"{distcp.name} is truncated or damaged")
    distcp.unlink()
    _fails(capsys, [str(dist), "--out", str(tmp_path / "o"), "--hf-config", hf], f"{distcp.name} is missing")
    (dist / TRACKER).write_text("300")
    _fails(capsys, [str(dist), "--out", str(tmp_path / "o"), "--hf-config", hf],
           "latest_checkpointed_iteration.txt names iter_0000300, but")
    assert not list(tmp_path.glob("o*"))


def test_verify_refuses_the_legacy_format_before_merging(checkpoints, tiny_model_dir, tmp_path, capsys):
    _fails(capsys, [str(checkpoints["legacy-llama-TP2"]), "--out", str(tmp_path / "o"), "--verify",
                    "--hf-config", str(tiny_model_dir("llama"))], "reads torch_dist only")
    assert not (tmp_path / "o").exists()


def test_rl_start_is_checked_before_workers_start(checkpoints, tiny_model_dir, tmp_path):
    """mrl train checkpoint.resume=<Megatron-LM checkpoint>: the driver's check (no worker yet)."""
    from mrl.config import ConfigError, load_config
    from mrl.run import check_start_checkpoint

    recipe = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu_grpo.yaml"

    def check(case: str, arch: str) -> None:
        model = tiny_model_dir(arch)
        cfg = load_config(recipe, [f"checkpoint.resume={checkpoints[case]}", f"model.path={model}", "model.tiny=null",
                                   "parallel.tp=1", "parallel.ep=1", f"checkpoint.dir={tmp_path / 'ckpt'}",
                                   f"trainer.output_dir={tmp_path / 'run'}"])
        check_start_checkpoint(cfg, str(model))

    check("deepseek_v3-EP2", "deepseek_v3")
    with pytest.raises(ConfigError, match="checkpoint.resume: no qwen3_moe mapping for Megatron tensor"):
        check("deepseek_v3-EP2", "qwen3_moe")
    with pytest.raises(ConfigError, match="legacy .* Megatron-LM checkpoint, which only mrl-merge reads"):
        check("legacy-llama-TP2", "llama")
