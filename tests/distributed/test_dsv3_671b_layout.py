"""DeepSeek-V3 671B in the layout of configs/dsv3_671b_grpo.yaml, built shard by shard on the meta device.

The recipe (TP8 · PP4 · EP32 · ETP1, last stage 13 layers, 16 nodes × 8 GPUs = 128 ranks) is loaded
and validated against the real config.json (tests/fixtures/deepseek_v3_671b, no weights). Then a
few ranks of the 128-rank world are built, one after the other, in a spawned process (Megatron's
parallel state is process-global and is torn down between ranks): torch.distributed's "fake"
backend gives the process its place in the world without any peer, Megatron's process groups are
created for the layout, and the GPTModel is built under `torch.device("meta")`, so no memory is
allocated for the 671B parameters.

Checked:
  (a) the whole model, deduplicated from one rank per pipeline stage (TP-sharded tensors × TP,
      expert tensors × EP·ETP, TP-replicated norms/router once, DP replicas once), minus Megatron's
      vocabulary padding, plus the router's expert-bias buffers (a checkpoint tensor, a buffer in
      Megatron), is exactly the hand count 671,026,419,200: DeepSeek-V3's published "671B" for the
      main model (the MTP module is not part of it);
  (b) every built rank's shard sizes, per kind of tensor, equal the hand arithmetic below;
  (c) `mrl plan`'s parameter list and weight, gradient-buffer and optimizer bytes of every built
      rank equal what Megatron's own DDP and distributed optimizer make of it (on meta too).
"""

from __future__ import annotations

import multiprocessing
from collections import Counter
from pathlib import Path

import pytest

from mrl.layout import LayoutError, ModelDims, ParallelLayout

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "dsv3_671b_grpo.yaml"
FIXTURE = ROOT / "tests" / "fixtures" / "deepseek_v3_671b"
BUILD_TIMEOUT_S = 240

# ---------------------------------------------------------------------------------------------
# Hand arithmetic from the DeepSeek-V3 architecture (config.json values), not from the model.
H, VOCAB, FFN, MOE_FFN, EXPERTS = 7168, 129280, 18432, 2048, 256
HEADS, QK_NOPE, QK_ROPE, V_HEAD, Q_RANK, KV_RANK = 128, 128, 64, 128, 1536, 512
LAYERS, DENSE_LAYERS = 61, 3
TP, PP, EP, ETP, DP, WORLD = 8, 4, 32, 1, 4, 128
PADDED_VOCAB = 130048  # Megatron pads to a multiple of 128·TP = 1024: 127 · 1024 ≥ 129280

# One rank's share of each tensor (numel), per layer where it is a layer's tensor.
SHARD = {
    "input_layernorm": H,  # norms: replicated over TP
    "q_layernorm": Q_RANK,
    "kv_layernorm": KV_RANK,
    "pre_mlp_layernorm": H,
    "linear_q_down_proj": Q_RANK // TP * H,  # 192 × 7168: the down projections are TP-sharded too
    "linear_q_up_proj": HEADS * (QK_NOPE + QK_ROPE) // TP * Q_RANK,  # 3072 × 1536
    "linear_kv_down_proj": (KV_RANK + QK_ROPE) // TP * H,  # 72 × 7168
    "linear_kv_up_proj": HEADS * (QK_NOPE + V_HEAD) // TP * KV_RANK,  # 4096 × 512
    "linear_proj": H * (HEADS * V_HEAD // TP),  # 7168 × 2048
    "dense_fc1": 2 * FFN // TP * H,  # gate+up: 4608 × 7168
    "dense_fc2": H * (FFN // TP),  # 7168 × 2304
    "router": EXPERTS * H,  # replicated over TP and DP
    "shared_fc1": 2 * MOE_FFN // TP * H,  # the shared expert is TP-sharded (not EP)
    "shared_fc2": H * (MOE_FFN // TP),
    "expert_fc1": EXPERTS // EP * (2 * MOE_FFN // ETP * H),  # 8 local experts × 4096 × 7168
    "expert_fc2": EXPERTS // EP * (H * (MOE_FFN // ETP)),  # 8 local experts × 7168 × 2048
    "embedding": PADDED_VOCAB // TP * H,  # 16256 × 7168
    "output_layer": PADDED_VOCAB // TP * H,
    "final_layernorm": H,
}
ATTENTION = ("input_layernorm", "q_layernorm", "kv_layernorm", "pre_mlp_layernorm", "linear_q_down_proj",
             "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")
DENSE_MLP = ("dense_fc1", "dense_fc2")
MOE_MLP = ("router", "shared_fc1", "shared_fc2", "expert_fc1", "expert_fc2")
# Stage → (dense layers, MoE layers, extra tensors). 61 layers = 16 + 16 + 16 + 13.
STAGES = {0: (3, 13, ("embedding",)), 1: (0, 16, ()), 2: (0, 16, ()), 3: (0, 13, ("output_layer", "final_layernorm"))}


def expected_shards(stage: int) -> dict[str, int]:
    dense, moe, extra = STAGES[stage]
    counts = Counter({k: (dense + moe) * SHARD[k] for k in ATTENTION})
    counts.update({k: dense * SHARD[k] for k in DENSE_MLP if dense})
    counts.update({k: moe * SHARD[k] for k in MOE_MLP})
    counts.update({k: SHARD[k] for k in extra})
    return dict(counts)


# The same sums written out, so the numbers in docs/dsv3.md can be read off here.
ATTENTION_PER_RANK = 23_404_544  # 23,388,160 TP-sharded + 16,384 norm weights
DENSE_LAYER_PER_RANK = 72_949_760  # attention + 49,545,216 MLP
MOE_LAYER_PER_RANK = 383_066_112  # attention + 1,835,008 router + 5,505,024 shared + 352,321,536 experts
RANK_PARAMS = {0: 5_315_231_744, 1: 6_129_057_792, 2: 6_129_057_792, 3: 5_096_389_632}
RANK_EXPERT_PARAMS = {0: 13 * 352_321_536, 1: 16 * 352_321_536, 2: 16 * 352_321_536, 3: 13 * 352_321_536}

# The unsharded HF model (main model, no MTP): per-layer sums of the HF tensors.
HF_ATTENTION = (H * Q_RANK + Q_RANK + Q_RANK * HEADS * (QK_NOPE + QK_ROPE) + H * (KV_RANK + QK_ROPE) + KV_RANK
                + KV_RANK * HEADS * (QK_NOPE + V_HEAD) + HEADS * V_HEAD * H + 2 * H)  # 187,121,664
HF_DENSE_MLP = 3 * H * FFN  # 396,361,728
HF_MOE_MLP = EXPERTS * 3 * H * MOE_FFN + 3 * H * MOE_FFN + EXPERTS * H + EXPERTS  # + e_score_correction_bias
HF_MAIN_MODEL = (2 * VOCAB * H + H + DENSE_LAYERS * (HF_ATTENTION + HF_DENSE_MLP)
                 + (LAYERS - DENSE_LAYERS) * (HF_ATTENTION + HF_MOE_MLP))
DSV3_MAIN_MODEL_PARAMS = 671_026_419_200

# One rank per pipeline stage (the total needs all four), plus a second rank of the last stage at
# other TP/DP/EP coordinates. Megatron's rank order is tp-cp-ep-dp-pp: stage = rank // 32,
# tp = rank % 8, dp = rank // 8 % 4, ep = rank % 32 (ETP1, so the 32 ranks of a stage are its EP group).
RANKS = (0, 45, 70, 96, 127)


def _build_ranks(ranks: tuple[int, ...], recipe: str, overrides: list[str]) -> dict[int, dict]:
    """In a fresh process, for each rank in turn: join a fake 128-rank world as that rank, build its
    shard on meta, describe it, and tear Megatron's groups and the world down again."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    warnings.simplefilter("ignore")
    import megatron_patches
    from megatron.core import parallel_state as ps

    from mrl.config import load_config
    from mrl.megatron.footprint import static_footprint
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import rank_coords
    from mrl.models.registry import model_spec_from_hf

    megatron_patches.apply()
    # The fixture is the FP8 release's config.json, which the config check refuses as a model to
    # train from (the engine would load it quantised); only its sizes matter here, and the layout is
    # validated against them below.
    cfg = load_config(recipe, overrides, check_files=False)
    p = cfg.parallel
    layout = ParallelLayout(tp=p.tp, pp=p.pp, ep=p.ep, etp=p.etp, vpp=p.vpp,
                            first_stage_layers=p.first_stage_layers, last_stage_layers=p.last_stage_layers)
    spec = model_spec_from_hf(cfg.model.path)
    world = cfg.launch.num_nodes * cfg.launch.gpus_per_node
    layout.validate(spec.dims, world)
    results = {}
    for rank in ranks:
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        # As mrl.megatron.parallel.initialize_layout, without Megatron's extra gloo groups: the fake
        # backend stands in for the default group only; gloo would wait for 127 absent peers.
        ps.initialize_model_parallel(**layout.megatron_sizes(), create_gloo_process_groups=False)
        with torch.device("meta"):
            built = build_model(spec, layout, params_dtype=torch.bfloat16, transformer_impl="local")
        (chunk,) = built.chunks
        params = []
        for name, param in chunk.named_parameters():
            expert = not getattr(param, "allreduce", True)
            sharded = bool(getattr(param, "tensor_model_parallel", False))
            params.append((name, param.numel(), "expert" if expert else "tp" if sharded else "replicated",
                           str(param.device)))
        layers = chunk.decoder.layers
        results[rank] = dict(
            coords=rank_coords().__dict__,
            world=dist.get_world_size(),
            padded_vocab=built.padded_vocab_size,
            params=params,
            layer_numbers=[layer.layer_number for layer in layers],
            expert_indices=[list(layer.mlp.local_expert_indices) for layer in layers
                            if hasattr(layer.mlp, "router")],
            expert_bias=sum(b.numel() for n, b in chunk.named_buffers() if n.endswith("router.expert_bias")),
            # Megatron's DDP buffers and distributed-optimizer shards for this rank, also on meta.
            footprint=static_footprint(built),
        )
        del built, chunk, layers
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    return results


def _kind(name: str) -> str:
    """The SHARD key of a Megatron parameter name."""
    if name.startswith("embedding."):
        return "embedding"
    if name.startswith("output_layer."):
        return "output_layer"
    if name == "decoder.final_layernorm.weight":
        return "final_layernorm"
    rest = name.split(".", 3)[3]  # drop "decoder.layers.N."
    module = rest.rsplit(".", 1)[0]
    if module.startswith("mlp.experts.local_experts."):
        return "expert_" + module.rsplit(".", 1)[1].removeprefix("linear_")
    if module.startswith("mlp.shared_experts."):
        return "shared_" + module.rsplit(".", 1)[1].removeprefix("linear_")
    if module.startswith("mlp.linear_"):
        return "dense_" + module.removeprefix("mlp.linear_")
    return {"mlp.router": "router"}.get(module, module.rsplit(".", 1)[-1])


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[int, dict]:
    data = tmp_path_factory.mktemp("dsv3") / "prompts.jsonl"
    data.write_text('{"prompt": "1+1", "label": "2"}\n')
    overrides = [f"model.path={FIXTURE}", f"data.path={data}"]
    # A fresh interpreter, so this process never holds Megatron's process-global state. One process
    # builds every rank in turn: importing megatron costs ~6 s, a meta build of one rank ~1 s.
    pool = multiprocessing.get_context("spawn").Pool(1)
    try:
        return pool.apply_async(_build_ranks, (RANKS, str(RECIPE), overrides)).get(timeout=BUILD_TIMEOUT_S)
    except multiprocessing.TimeoutError:
        pytest.fail(f"ranks {RANKS} of the 671B layout were not built within {BUILD_TIMEOUT_S}s")
    finally:
        pool.terminate()


def test_hand_table_is_consistent():
    """The written-out sums follow from the per-tensor table (guards the table against typos)."""
    attention = sum(SHARD[k] for k in ATTENTION)
    assert attention == ATTENTION_PER_RANK
    assert attention + sum(SHARD[k] for k in DENSE_MLP) == DENSE_LAYER_PER_RANK
    assert attention + sum(SHARD[k] for k in MOE_MLP) == MOE_LAYER_PER_RANK
    for stage in range(PP):
        shards = expected_shards(stage)
        assert sum(shards.values()) == RANK_PARAMS[stage]
        assert shards["expert_fc1"] + shards["expert_fc2"] == RANK_EXPERT_PARAMS[stage]
    assert HF_MAIN_MODEL == DSV3_MAIN_MODEL_PARAMS
    assert PADDED_VOCAB % (128 * TP) == 0 and 0 <= PADDED_VOCAB - VOCAB < 128 * TP
    assert TP * PP * DP == WORLD == EP * ETP * PP


def test_uneven_pipeline_is_validated():
    dims = ModelDims(LAYERS, HEADS, HEADS, FFN, EXPERTS, MOE_FFN)
    ParallelLayout(tp=TP, pp=PP, ep=EP, etp=ETP, last_stage_layers=13).validate(dims, WORLD)
    with pytest.raises(LayoutError, match="61 layers cannot be split"):
        ParallelLayout(tp=TP, pp=PP, ep=EP, etp=ETP).validate(dims, WORLD)
    with pytest.raises(LayoutError, match="leave 49 for 3 other stage"):
        ParallelLayout(tp=TP, pp=PP, ep=EP, etp=ETP, last_stage_layers=12).validate(dims, WORLD)


def test_ranks_sit_where_the_layout_says(shards):
    for rank, shard in shards.items():
        stage = rank // (TP * DP)
        assert shard["world"] == WORLD
        assert shard["coords"] == dict(rank=rank, tp=rank % TP, pp=stage, dp=rank // TP % DP,
                                       ep=rank % EP, etp=0, edp=0, cp=0), rank
        dense, moe, _ = STAGES[stage]
        first = 1 + 16 * stage  # Megatron's layer_number is global and 1-based
        assert shard["layer_numbers"] == list(range(first, first + dense + moe)), rank
        # EP rank e holds routed experts 8e … 8e+7 in every MoE layer of its stage.
        ep = rank % EP
        assert shard["expert_indices"] == [list(range(8 * ep, 8 * ep + 8))] * moe, rank
        assert {device for *_, device in shard["params"]} == {"meta"}, rank
        assert shard["padded_vocab"] == PADDED_VOCAB


def test_rank_shard_sizes_match_hand_arithmetic(shards):
    for rank, shard in shards.items():
        stage = rank // (TP * DP)
        built = Counter()
        for name, numel, _, _ in shard["params"]:
            built[_kind(name)] += numel
        assert dict(built) == expected_shards(stage), f"rank {rank} (stage {stage})"
        assert sum(built.values()) == RANK_PARAMS[stage]
        experts = sum(n for _, n, how, _ in shard["params"] if how == "expert")
        assert experts == RANK_EXPERT_PARAMS[stage], rank
    # Two ranks of the last stage at other TP/DP/EP coordinates hold shards of identical shapes.
    assert [p[:3] for p in shards[96]["params"]] == [p[:3] for p in shards[127]["params"]]


def test_whole_model_is_671b(shards):
    """Deduplicate: one rank per stage; a TP-sharded tensor counts TP times, an expert tensor EP·ETP
    times (EP·ETP ranks hold different experts/slices), a replicated one (norms, router) once; DP
    replicas are the same tensors and count once. The shards are equal-sized (asserted above)."""
    multiplicity = {"tp": TP, "expert": EP * ETP, "replicated": 1}
    per_stage = {rank // (TP * DP): shard for rank, shard in shards.items() if rank in (0, 45, 70, 127)}
    assert sorted(per_stage) == list(range(PP))
    total = sum(numel * multiplicity[how] for shard in per_stage.values() for _, numel, how, _ in shard["params"])
    padding = 2 * (PADDED_VOCAB - VOCAB) * H  # embedding and output layer rows past the vocabulary
    expert_bias = sum(shard["expert_bias"] for shard in per_stage.values())  # HF e_score_correction_bias
    assert expert_bias == (LAYERS - DENSE_LAYERS) * EXPERTS
    assert total - padding + expert_bias == DSV3_MAIN_MODEL_PARAMS
    # DeepSeek publishes "671B" for the main model (README_WEIGHTS.md; HF's 685B adds the 11.5B MTP
    # module and its copies of embedding and head). Our exact count agrees to 0.004%, well inside
    # the ±0.5B rounding of the published figure; 0.05B pins it to "671.0B".
    assert abs(DSV3_MAIN_MODEL_PARAMS - 671e9) < 0.05e9


def test_plan_static_bytes_equal_megatron(shards):
    """mrl plan's bytes per rank for the recipe: Megatron's DDP param and grad buffers (bf16, fp32,
    padded) and its distributed optimizer's fp32 main shards plus Adam's two fp32 moments."""
    from mrl.plan import model_shape
    from mrl.plan.ddp import rank_static
    from mrl.plan.params import chunk_params
    from mrl.plan.shapes import stage_chunks

    shape = model_shape(str(FIXTURE))
    layout = ParallelLayout(tp=TP, pp=PP, ep=EP, etp=ETP, last_stage_layers=13)
    for rank, shard in shards.items():
        c = shard["coords"]
        (chunk,) = stage_chunks(shape.layers, layout, c["pp"])
        assert [(t.name, t.numel) for t in chunk_params(shape, layout, chunk, "bf16")] == [
            (name, numel) for name, numel, *_ in shard["params"]], rank
        plan = rank_static(shape, layout, WORLD, c["pp"], "bf16", True, c["dp"], c["edp"])
        f = shard["footprint"]
        assert (plan.weights, plan.grads, plan.optimizer) == (f["weight_bytes"], f["grad_bytes"], f["optimizer_bytes"]), rank
    # docs/dsv3.md's middle stage: 12.3 GB weights, 24.5 GB gradients, 69.1 GB optimizer state.
    f = shards[45]["footprint"]
    assert [round(f[k] / 1e8) for k in ("weight_bytes", "grad_bytes", "optimizer_bytes")] == [123, 245, 691]
