"""DeepSeek-V3 FP8 checkpoints into Megatron (issue 16, item 4).

The tiny zoo's FP8 twin (mrl/models/tiny.py, widths below 128: partial blocks everywhere) loads
into Megatron with the same logits, bitwise, as its dequantised twin (both hold the same
dequantised values), in float32 and in bf16 parameters and in layouts that cut the FP8 weights'
blocks across ranks; in float32 they also match transformers on the dequantised twin. `mrl verify`
and `mrl convert hf-to-mcore` accept the FP8 directory.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from checkpoints_tools.merge import merge
from mrl.bridge.dequantize import write_dequantized
from mrl.bridge.verify import probe_tokens, reference_logits
from mrl.cli.convert import main as convert_main
from mrl.cli.verify import main as verify_main
from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local
from mrl.models.tiny import write_fp8_twin

WORLD = 4
# name → (layout, parameter dtype); TP2 splits kv_b_proj's 256 rows and o_proj's 128 columns
# mid-block, EP2 hands each rank half the experts, PP2 each stage half the layers.
CASES = {
    "TP2xEP2-fp32": (ParallelLayout(tp=2, ep=2), torch.float32),
    "PP2xTP2-bf16": (ParallelLayout(pp=2, tp=2), torch.bfloat16),
}


@pytest.fixture(scope="module")
def twins(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    """The FP8 twin of the tiny DeepSeek-V3 and its dequantised twins in float32 and bf16."""
    root = tmp_path_factory.mktemp("fp8-import")
    fp8 = write_fp8_twin(tiny_model_dir("deepseek_v3"), root / "fp8")
    dirs = {"fp8": str(fp8)}
    for dtype in (torch.float32, torch.bfloat16):
        dirs[str(dtype)] = write_dequantized(fp8, root / str(dtype).removeprefix("torch."), dtype)["out"]
    return dirs


def _logits(rank: int, world: int, dirs: dict[str, str], cases: dict) -> dict:
    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.forward import forward_logits
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import destroy_layout, initialize_layout
    from mrl.models.registry import model_spec_from_hf

    spec = model_spec_from_hf(dirs["fp8"])
    results = {}
    for name, (layout, dtype) in cases.items():
        coords = initialize_layout(layout)
        for source in ("fp8", str(dtype)):
            built = build_model(spec, layout, params_dtype=dtype)
            load_hf_weights(built, coords, dirs[source])
            logits = forward_logits(built, probe_tokens(spec.vocab_size))
            if logits is not None and coords.tp == 0 and coords.dp == 0:
                results[name, source] = logits
        destroy_layout()
    return results


def test_fp8_import_gives_the_dequantised_twins_logits_bitwise(twins):
    per_rank = run_local(_logits, WORLD, twins, CASES, timeout_s=600)
    results = {k: v for r in per_rank for k, v in r.items()}
    reference = reference_logits(twins[str(torch.float32)], probe_tokens(1000))
    for name, (_, dtype) in CASES.items():
        fp8, twin = results[name, "fp8"], results[name, str(dtype)]
        assert fp8.dtype == twin.dtype and torch.equal(fp8, twin), f"{name}: max |diff| {(fp8 - twin).abs().max():.3g}"
        if dtype == torch.float32:
            assert (fp8 - reference).abs().max() <= 1e-4, name


def test_verify_accepts_an_fp8_checkpoint(twins, capsys):
    assert verify_main(["--hf", twins["fp8"], "--tp", "2", "--ep", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["logits"]["max_abs_diff"] <= 1e-4
    # Every tensor but the scales, compared bitwise with its dequantised value in the file.
    assert summary["export"]["mismatches"] == [] and summary["export"]["missing"] == []
    assert summary["export"]["tensors_compared"] == len(load_file(twins[str(torch.float32)] + "/model.safetensors"))


def test_convert_fp8_then_merge_gives_the_dequantised_twin(twins, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    assert convert_main(["hf-to-mcore", "--hf", twins["fp8"], "--out", str(ckpt), "--tp", "2"]) == 0
    capsys.readouterr()
    # The checkpoint's HF metadata no longer claims FP8: what it holds (and merges into) is not.
    assert "quantization_config" not in json.loads((ckpt / "iter_0000000" / "hf" / "config.json").read_text())
    merge(ckpt, tmp_path / "hf", dtype="fp32", progress=False)
    merged, twin = load_file(tmp_path / "hf" / "model.safetensors"), load_file(twins[str(torch.float32)] + "/model.safetensors")
    assert sorted(merged) == sorted(twin)
    assert all(torch.equal(merged[n], t) for n, t in twin.items())
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())
