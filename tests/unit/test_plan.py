"""mrl plan's rules, each against a hand-derived case; the CLI's verdicts, JSON and errors.

The exact agreement with what Megatron allocates is in tests/distributed/test_plan_static.py (meta
builds) and test_dsv3_671b_layout.py; the activations are checked against measured CPU runs in
tests/distributed/test_plan_activations.py.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from mrl.cli.plan import main as plan_main
from mrl.config import load_config
from mrl.layout import ParallelLayout
from mrl.plan import PlanError, Run, model_shape, plan
from mrl.plan.activations import MicroBatch, in_flight, layer_rows, tokens
from mrl.plan.report import render
from mrl.plan.ddp import _layout, buffers, dense_group, rank_static, static_bytes
from mrl.plan.params import ParamTensor, chunk_params
from mrl.plan.rollout import engine_parameters, engine_weight_bytes, kv_bytes_per_token
from mrl.plan.search import search
from mrl.plan.shapes import stage_chunks, stage_layer_counts
from mrl.plan.timing import Gpu

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "configs" / "dsv3_671b_grpo.yaml")
FIXTURE = str(ROOT / "tests" / "fixtures" / "deepseek_v3_671b")
TINY = str(ROOT / "configs" / "tiny_cpu_grpo.yaml")
GB = 10**9
H100 = Gpu(3350 * GB, 989e12)
# The recipe as first written (no recomputation or offload, one TP16 engine, a 16k token budget, 32k
# responses): the hand-derived cases below; test_the_671b_recipe_fits checks the recipe as shipped.
AS_WRITTEN = ["model.recompute=none", "optim.offload_fraction=0.0", "trainer.offload_actor_during_rollout=false",
              "optim.max_tokens_per_micro_batch=16384", "rollout.tensor_parallel_size=16", "rollout.num_engines=1",
              "rollout.nodes_per_engine=2", "rollout.max_model_len=34816", "rollout.max_new_tokens=32768"]


@pytest.fixture(scope="module")
def dsv3():
    cfg = load_config(RECIPE, [f"model.path={FIXTURE}", *AS_WRITTEN], check_files=False)
    return cfg, model_shape(cfg.model.path)


def test_buffer_pads_like_megatron():
    """Reverse order; starts at multiples of 64; a shared embedding closes a bucket ending at a
    multiple of lcm(DP, 128); DP rank r owns the r-th half of each bucket."""
    params = [ParamTensor("p0", 100, "bf16"), ParamTensor("p1", 30, "bf16", shared_embedding=True)]
    b = _layout(params, "bf16", "fp32", False, 2, distributed=True)
    assert b.ranges == ((0, 30), (128, 228)) and b.buckets == ((0, 128), (128, 256))
    assert (b.numel, b.owned(0), b.owned(1)) == (256, 30 + 64, 36)
    plain = _layout(params, "bf16", "fp32", False, 2, distributed=False)
    assert (plain.numel, plain.owned(0), plain.owned(1)) == (130, 130, 130)  # every rank keeps all


def test_dp_ranks_own_every_element_once():
    rng = random.Random(0)
    for dp in (1, 3, 4, 8):
        params = [ParamTensor(str(i), rng.randint(1, 5000), rng.choice(["bf16", "fp32"]),
                              shared_embedding=i in (0, 40)) for i in range(60)]
        for b in buffers(params, dp, 1, distributed=True):
            assert sum(b.owned(r) for r in range(dp)) == b.param_numel
            assert b.numel % dp == 0 and b.max_owned() <= b.numel // dp


def test_static_bytes_per_element():
    bf16 = _layout([ParamTensor("w", 1024, "bf16")], "bf16", "fp32", False, 4, distributed=True)
    fp32 = _layout([ParamTensor("n", 128, "fp32")], "fp32", "fp32", False, 4, distributed=True)
    # bf16: 2 B weight, 4 B fp32 grad, owned quarter × (fp32 main 4 + Adam 8); fp32: no main copy.
    assert static_bytes([bf16, fp32]) == type(static_bytes([bf16]))(1024 * 2 + 128 * 4, (1024 + 128) * 4,
                                                                    256 * 12 + 32 * 8)
    assert static_bytes([bf16], optimizer_on_gpu=0.25).optimizer == 256 * 12 // 4
    # the other 3/4 of the owned elements in host memory: fp32 copy, two moments, fp32 grad copy
    assert static_bytes([bf16], optimizer_on_gpu=0.25).host == 192 * 16
    assert static_bytes([bf16]).host == 0


def test_offload_and_recompute_in_the_671b_plan(dsv3):
    """optim.offload_fraction moves the optimizer row to host memory; recompute shrinks activations
    (full: the block inputs plus one layer again; selective core_attn: less than none)."""
    cfg, shape = dsv3
    base = plan(shape, Run.of(cfg, shape), 80 * GB)

    def with_(*overrides):
        return plan(shape, Run.of(load_config(RECIPE, [f"model.path={FIXTURE}", *AS_WRITTEN, *overrides], check_files=False),
                                  shape), 80 * GB)

    half = with_("optim.offload_fraction=0.5")
    for before, after in zip(base.stages, half.stages):
        assert abs(after.state["actor optimizer"] - before.state["actor optimizer"] / 2) <= 1
        # 12 B per bf16 element on the GPU → 16 B in host memory (the few fp32 norm weights: 8 → 16)
        assert abs(after.host / (before.state["actor optimizer"] / 2 * 16 / 12) - 1) < 1e-5
        assert before.host == 0 and after.state["actor weights"] == before.state["actor weights"]
    full, selective = with_("model.recompute=full"), with_("model.recompute=selective")
    for b, f, s in zip(base.stages, full.stages, selective.stages):
        assert f.update["activations"] < s.update["activations"] < b.update["activations"]
        assert f.state == b.state
    assert "full recompute" in render(full) and "offloaded to host memory" in render(half)


def test_pipeline_chunks():
    assert stage_layer_counts(61, ParallelLayout(pp=4, last_stage_layers=13)) == [16, 16, 16, 13]
    assert stage_layer_counts(10, ParallelLayout(pp=3, first_stage_layers=2)) == [2, 4, 4]
    interleaved = ParallelLayout(pp=2, vpp=2)
    assert [c.layers for c in stage_chunks(8, interleaved, 0)] == [(0, 1), (4, 5)]
    first, last = stage_chunks(8, interleaved, 0), stage_chunks(8, interleaved, 1)
    assert [(c.embedding, c.head) for c in first + last] == [(True, False), (False, False), (False, False), (False, True)]


def test_micro_batches_in_flight():
    pp4 = ParallelLayout(pp=4)
    assert [len(in_flight(pp4, s, 8)) for s in range(4)] == [4, 3, 2, 1]
    assert len(in_flight(pp4, 0, 2)) == 2  # fewer micro-batches than stages
    # Interleaved PP2×VPP2, 4 micro-batches: stage 0 warms up 2·1 + 1·2 = 4 forwards, then a 5th,
    # in the schedule table's order (two micro-batches of chunk 0, two of chunk 1, ...).
    assert in_flight(ParallelLayout(pp=2, vpp=2), 0, 4) == [0, 0, 1, 1, 0]
    assert in_flight(ParallelLayout(), 0, 8) == [0]


def test_671b_stage_parameters(dsv3):
    """Per-rank parameter counts of the recipe's stages: the hand arithmetic of
    tests/distributed/test_dsv3_671b_layout.py (RANK_PARAMS, RANK_EXPERT_PARAMS)."""
    cfg, shape = dsv3
    layout = Run.of(cfg, shape).layout
    expected = {0: (5_315_231_744, 13), 1: (6_129_057_792, 16), 2: (6_129_057_792, 16), 3: (5_096_389_632, 13)}
    for stage, (params, moe_layers) in expected.items():
        (chunk,) = stage_chunks(shape.layers, layout, stage)
        tensors = chunk_params(shape, layout, chunk, "bf16")
        assert sum(t.numel for t in tensors) == params, stage
        assert sum(t.numel for t in tensors if t.expert) == moe_layers * 352_321_536, stage


def test_671b_engine(dsv3):
    _, shape = dsv3
    one = engine_parameters(shape, 1)
    # TP1 holds the whole main model (the vocabulary 129,280 needs no padding to 64) plus MLA's
    # bf16 copy of each kv up-projection.
    assert one.linear + one.other == 671_026_419_200
    assert one.mla_copy == 61 * 512 * 128 * (128 + 128)
    assert kv_bytes_per_token(shape, 16, "bfloat16") == 61 * (512 + 64) * 2
    bf16, fp8 = (engine_weight_bytes(shape, 16, "bfloat16", q) for q in (None, "fp8"))
    assert 1.3e12 / 16 < bf16 < 1.4e12 / 16 and 0.66e12 / 16 < fp8 < 0.7e12 / 16
    with pytest.raises(PlanError, match="rollout.quantization 'int4'"):
        engine_weight_bytes(shape, 16, "bfloat16", "int4")


def test_671b_recipe_does_not_fit(dsv3):
    cfg, shape = dsv3
    p = plan(shape, Run.of(cfg, shape), 80 * GB)
    assert not p.fits and not p.engine.fits
    middle = p.stages[1]
    # docs/dsv3.md's arithmetic, 6·N + 12·(N_dense/4 + N_expert), give or take Megatron's padding.
    assert abs(sum(middle.state.values()) - 105.9e9) < 0.1e9
    assert middle.in_flight == 3 and p.stages[0].in_flight == 4 and p.stages[3].in_flight == 1
    assert "loss working set" in p.stages[3].update and "loss working set" not in middle.update
    assert any("max_tokens_per_micro_batch 16384" in problem for problem in p.run.problems)
    fixed = Run.of(load_config(RECIPE, [f"model.path={FIXTURE}", *AS_WRITTEN, "optim.max_tokens_per_micro_batch=34816"],
                               check_files=False), shape)
    assert fixed.problems == () and fixed.micro.size == 1


def test_plan_refuses_bad_input(dsv3):
    cfg, shape = dsv3
    with pytest.raises(PlanError, match=r"TP8×PP8×EP16×ETP1 on 128 actor GPUs: .*leave 48 for 7 other stage"):
        Run.of(load_config(RECIPE, [f"model.path={FIXTURE}", *AS_WRITTEN, "parallel.pp=8", "parallel.ep=16"], check_files=False),
               shape)
    with pytest.raises(PlanError, match="give the cluster's size with --gpus"):
        Run.of(load_config(TINY, [], check_files=False), model_shape("", "deepseek_v3"))
    # The config's own layout is checked by load_config; the search plans layouts it did not check.
    split = Run.of(replace(cfg, data=replace(cfg.data, batch_size=3),
                           rollout=replace(cfg.rollout, n_samples_per_prompt=3)), shape)
    assert "9 sequences do not split over DP 4" in split.split_problems[0]


def test_cli(capsys, tmp_path):
    assert plan_main([RECIPE, f"model.path={FIXTURE}", *AS_WRITTEN]) == 1
    out = capsys.readouterr().out
    assert "short by" in out and "verdict: does not fit" in out and "does not fit: its weights exceed" in out
    assert plan_main([RECIPE, f"model.path={FIXTURE}", *AS_WRITTEN, "--json", "--gpu-memory-gb", "1000",
                      "optim.max_tokens_per_micro_batch=34816", "rollout.quantization=fp8"]) == 2  # in_place: refused
    assert "rollout.quantization 'fp8' needs sync.apply: load_weights" in capsys.readouterr().err
    # an FP8 engine over two nodes: routed, the only transport across nodes, needs in_place
    assert plan_main([RECIPE, f"model.path={FIXTURE}", *AS_WRITTEN, "--json", "--gpu-memory-gb", "1000",
                      "optim.max_tokens_per_micro_batch=34816", "rollout.quantization=fp8",
                      "sync.apply=load_weights"]) == 2
    assert "it needs sync.apply: in_place" in capsys.readouterr().err
    # FP8 engines within a node: the setting reaches the plan (half the bf16 weights at TP8)
    assert plan_main([RECIPE, f"model.path={FIXTURE}", *AS_WRITTEN, "--json", "--gpu-memory-gb", "1000",
                      "optim.max_tokens_per_micro_batch=34816", "rollout.quantization=fp8", "sync.apply=load_weights",
                      "rollout.tensor_parallel_size=8", "rollout.nodes_per_engine=1", "sync.transport=colocated"]) == 0
    engine = json.loads(capsys.readouterr().out)["engine"]
    assert engine["quantization"] == "fp8" and 0.66e12 / 8 < engine["weights"] < 0.7e12 / 8, engine
    assert plan_main([RECIPE, f"model.path={FIXTURE}", *AS_WRITTEN, "--json", "--gpu-memory-gb", "1000",
                      "optim.max_tokens_per_micro_batch=34816"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["fits"] and [s["stage"] for s in result["stages"]] == [0, 1, 2, 3]
    assert result["stages"][1]["peak"] == max(result["stages"][1]["train_bytes"], result["stages"][1]["generate_bytes"])
    for argv, message in (([RECIPE, f"model.path={tmp_path}"], "config.json not found"),
                          ([RECIPE, f"model.path={FIXTURE}", "--gpus", "0"], "--gpus must be >= 1"),
                          ([TINY], "--gpus N")):
        assert plan_main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_search_ranks_fitting_layouts():
    """Fitting layouts first, then the rest with the reason (the ranking: tests/unit/test_plan_timing.py)."""
    cfg = load_config(TINY, ["launch.gpus_per_node=8"], check_files=False)
    shape = model_shape("", "deepseek_v3")
    result = search(cfg, shape, 8, int(0.06 * GB), H100)
    assert result.fits and result.rejected
    assert all(s.peak <= p.gpu_bytes for p in result.fits for s in p.stages)
    memory = [r for r in result.rejected if r.shortfall is not None]
    assert memory and all(r.reason.startswith("stage ") for r in memory)
    tried = {p.run.layout for p in result.fits} | {r.layout for r in result.rejected}
    assert ParallelLayout(tp=2, ep=2, etp=1) in tried and ParallelLayout(tp=2, ep=2, etp=2) in tried


def test_actor_offload_during_rollout_in_the_671b_plan(dsv3):
    """trainer.offload_actor_during_rollout: beside the awake engine only the actor's weights stay
    (the push reads them); everything else that leaves gets a host copy; the update is unchanged."""
    cfg, shape = dsv3
    overrides = [f"model.path={FIXTURE}", "model.recompute=full", "optim.offload_fraction=1.0", "algo.kl_coef=0.001"]
    off, on = (plan(shape, Run.of(load_config(RECIPE, overrides + extra, check_files=False), shape), 80 * GB)
               for extra in (["trainer.offload_actor_during_rollout=false"], ["trainer.offload_actor_during_rollout=true"]))
    for before, after in zip(off.stages, on.stages):
        assert after.state == before.state and after.train_bytes == before.train_bytes
        assert before.generate_bytes == sum(before.state.values()) + before.engine
        assert after.generate_bytes == after.state["actor weights"] + after.engine < before.generate_bytes
        assert after.peak == max(after.train_bytes, after.generate_bytes)
        moved = after.state["actor grads"] + after.state["KL reference"] + after.state["actor weights"]
        assert after.host == before.host + moved  # the optimizer is in host memory already (offload 1.0)
    text = render(on)
    assert "host (offloaded state)" in text and "the actor's weights only" in text
    cfg_on = load_config(RECIPE, overrides + ["trainer.offload_actor_during_rollout=true"], check_files=False)
    # (the config check refuses the setting with separate placement; the plan ignores it there)
    separate = Run.of(replace(cfg_on, launch=replace(cfg_on.launch, placement="separate", rollout_gpus=16)), shape, 144)
    assert on.run.offload_actor and not separate.offload_actor


def test_the_671b_recipe_fits(capsys):
    """configs/dsv3_671b_grpo.yaml as shipped: every stage fits 80 GB in both phases, the four TP32
    engines fit their budget, the update accepts the batches (docs/dsv3.md shows this table)."""
    assert plan_main([RECIPE, f"model.path={FIXTURE}"]) == 0
    out = capsys.readouterr().out
    assert "verdict: fits" in out and "short by" not in out and "problem" not in out
    assert "rollout: 4 TP32 engines, colocated" in out
    cfg = load_config(RECIPE, [f"model.path={FIXTURE}"], check_files=False)
    shape = model_shape(cfg.model.path)
    p = plan(shape, Run.of(cfg, shape), 80 * GB)
    assert p.fits and p.margin > 10 * GB and p.run.offload_actor and p.run.problems == ()


def test_context_parallel_in_the_671b_plan(dsv3):
    """parallel.cp=2 on the same 128 GPUs: the batch splits over DP 2 (world / TP·CP·PP), dense
    gradients and Adam shard over DP·CP 4, as CP1's DP 4 did, so the state is unchanged; each rank
    holds half of every sequence, padded to a multiple of TP·2CP = 32, so the micro-batches per DP
    rank double and the activations and the loss's logits per rank shrink."""
    _, shape = dsv3

    def run(*overrides):
        return Run.of(load_config(RECIPE, [f"model.path={FIXTURE}", *AS_WRITTEN, "optim.max_tokens_per_micro_batch=34816",
                                           "rollout.max_model_len=34801", *overrides], check_files=False), shape)

    one, two = run(), run("parallel.cp=2")
    assert (one.dp, two.dp, one.expert_dp, two.expert_dp) == (4, 2, 1, 1)
    assert dense_group(two.layout, two.world) == dense_group(one.layout, one.world) == 4
    assert (one.micro, two.micro) == (MicroBatch(34800, 1), MicroBatch(34816, 1))  # TP8, TP8·2CP2 = 32
    assert two.micro_batches == 2 * one.micro_batches and two.problems == ()
    p1, p2 = plan(shape, one, 80 * GB), plan(shape, two, 80 * GB)
    for a, b in zip(p1.stages, p2.stages):
        assert a.state == b.state and b.update["activations"] < a.update["activations"]
    loss1, loss2 = (p.stages[3].update["loss working set"] for p in (p1, p2))
    assert loss1 // 34800 == loss2 // (34816 // 2)  # logits of s/CP tokens
    assert "17408 per CP rank; dense gradients and Adam over DP·CP 4" in render(p2)


def test_context_parallel_shards_dense_state_over_dp_cp():
    """A dense model on 4 GPUs: CP2 (DP 2) shards like DP 4 (one group of 4), not like DP 2."""
    shape = model_shape("", "llama")
    cp2, dp4, dp2 = (rank_static(shape, layout, world, 0, "bf16", True)
                     for layout, world in ((ParallelLayout(cp=2), 4), (ParallelLayout(), 4), (ParallelLayout(), 2)))
    assert cp2 == dp4 and cp2.optimizer < dp2.optimizer and cp2.weights == dp2.weights


def test_context_parallel_tokens_per_rank():
    """A CP rank's tokens: s/CP of every sequence (then /TP on the sequence-parallel slice); the
    keys and values gathered over CP are the whole sequence; the CP mask is [s/CP, s] per layer."""
    shape, layout, mb = model_shape("", "llama"), ParallelLayout(tp=2, cp=2), MicroBatch(64, 3)
    assert {scope: tokens(scope, shape, layout, mb) for scope in ("sp", "seq", "rope", "gathered", "mask")} == {
        "sp": 48, "seq": 96, "rope": 32, "gathered": 192, "mask": 32 * 64}
    rows = {r.what: r for r in layer_rows(shape, layout, 0, mb, 2, "flash")}
    # the flash kernel keeps the gathered k and v of this TP rank's heads (GQA: repeated to them)
    assert rows["attention k, v (gathered over CP)"].bytes_per_token == 4 / 2 * (32 + 32) * 2  # heads/TP · (k + v) · bf16


def test_search_keeps_the_recipes_context_parallelism():
    cfg = load_config(TINY, ["launch.gpus_per_node=8", "parallel.cp=2"], check_files=False)
    result = search(cfg, model_shape("", "deepseek_v3"), 8, int(0.06 * GB), H100)
    tried = [p.run.layout for p in result.fits] + [r.layout for r in result.rejected]
    assert tried and all(layout.cp == 2 for layout in tried)
    assert all(p.run.dp == 8 // (p.run.layout.tp * 2 * p.run.layout.pp) for p in result.fits)
