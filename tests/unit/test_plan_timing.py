"""mrl plan's step-time estimate (mrl/plan/timing.py): the roofline and the waves on hand-computed
cases, the crowding warning, the search's ranking by estimated step time. Pure arithmetic."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from mrl.cli.plan import main as plan_main
from mrl.config import load_config
from mrl.plan import PlanError, Run, model_shape, plan
from mrl.plan.report import render
from mrl.plan.search import _engine_choice, search
from mrl.plan.timing import (EngineLoad, Gpu, Lengths, active_parameters, decode_seconds, engine_load, lengths_of,
                             prefill_seconds, rollout_time, step_time, touched_fraction)

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "configs" / "dsv3_671b_grpo.yaml")
FIXTURE = str(ROOT / "tests" / "fixtures" / "deepseek_v3_671b")
TINY = str(ROOT / "configs" / "tiny_cpu_grpo.yaml")
GB = 10**9
# An engine of 2 GPUs, each holding 10 GB of weights of which 8 GB are the routed experts (2 of 8 per token).
LOAD = EngineLoad(tp=2, weights=10 * GB, routed=8 * GB, experts=8, topk=2, kv_per_token=1000,
                  flops_per_token=2e9, flops_per_pair=1e6)
GPU = Gpu(bandwidth=1e12, flops=1e15, efficiency=0.5)
LENGTHS = Lengths(prompt=100, response=10)


def test_decode_roofline_by_hand():
    """Two sequences, ten steps: each step reads the dense 2 GB and the share of the experts two
    tokens touch, 1 - (6/8)^2 = 0.4375; the KV of contexts 100..109 twice; all at 1 TB/s."""
    assert touched_fraction(2, 8, 2) == 0.4375 and touched_fraction(5, 0, 0) == 1.0
    weights = 10 * (2 * GB + 0.4375 * 8 * GB)
    kv = 2 * 1000 * sum(100 + t for t in range(10))
    assert decode_seconds(LOAD, 2, LENGTHS, GPU) == pytest.approx((weights + kv) / 1e12, rel=1e-12)
    assert decode_seconds(LOAD, 2, LENGTHS, GPU) == pytest.approx(0.05500209, rel=1e-9)
    # 1000 sequences of a model of 1e11 active parameters: the matmuls (10 steps × 1000 tokens ×
    # 2e11 FLOPs over 2 GPUs at half of 1e15: 2 s) outweigh the reads (about 0.1 s)
    heavy = replace(LOAD, flops_per_token=2e11)
    assert decode_seconds(heavy, 1000, LENGTHS, GPU) == pytest.approx(10 * 1000 * 2e11 / (2 * 0.5e15))


def test_prefill_by_hand():
    """100 tokens × 2e9 FLOPs, plus 100·101/2 attention pairs × 1e6, over 2 GPUs at half of 1e15."""
    assert prefill_seconds(LOAD, 100, GPU) == pytest.approx((100 * 2e9 + 5050 * 1e6) / 1e15, rel=1e-12)


def test_waves():
    """Ten sequences, four at once: two full waves and one of two; every prompt prefilled once."""
    r = rollout_time(LOAD, 10, 4, LENGTHS, GPU)
    assert (r.sequences, r.concurrency, r.waves) == (10, 4, 3)
    assert r.decode_s == pytest.approx(2 * decode_seconds(LOAD, 4, LENGTHS, GPU) + decode_seconds(LOAD, 2, LENGTHS, GPU))
    assert r.prefill_s == pytest.approx(10 * prefill_seconds(LOAD, 100, GPU))
    assert r.seconds == r.prefill_s + r.decode_s and not r.crowded  # 4 of 10: not under a quarter
    assert rollout_time(LOAD, 10, 2, LENGTHS, GPU).crowded  # 2 of 10: five waves
    one = rollout_time(LOAD, 3, 100, LENGTHS, GPU)  # more room than sequences: one wave of all three
    assert (one.concurrency, one.waves) == (3, 1)
    assert rollout_time(LOAD, 10, 0, LENGTHS, GPU) is None


def test_lengths():
    assert lengths_of(34816, 32768) == Lengths(2048, 32768)  # the longest the recipe allows
    assert lengths_of(64, 100) == Lengths(1, 63)
    assert lengths_of(4096, 1024, 500, 2000) == Lengths(500, 2000)
    with pytest.raises(PlanError, match="exceed rollout.max_model_len 4096"):
        lengths_of(4096, 1024, 3000, 2000)
    with pytest.raises(PlanError, match=">= 1 token"):
        lengths_of(4096, 1024, 0, 2000)


def _dsv3(*overrides):
    cfg = load_config(RECIPE, [f"model.path={FIXTURE}", *overrides], check_files=False)
    shape = model_shape(cfg.model.path)
    return cfg, shape, plan(shape, Run.of(cfg, shape), 80 * GB)


def test_671b_engine_load():
    """DeepSeek-V3: 37.6B active parameters (DeepSeek's "37B activated"): the main model less 248
    of the 256 routed experts in each of the 58 MoE layers; a TP32 GPU holds 1/32 of the experts."""
    _, shape, p = _dsv3()
    routed = 58 * 256 * 3 * 7168 * 2048
    assert active_parameters(shape) == 671_026_419_200 - routed * 248 / 256
    load = engine_load(shape, p.engine, "bfloat16", None)
    assert (load.routed, load.weights, load.kv_per_token) == (routed // 32 * 2, p.engine.weights, 61 * 576 * 2)


def test_crowded_engines_warn_with_the_fixes(capsys):
    """The recipe as first shipped (34,816-token sequences): four TP32 engines each hold 4 of their
    256 sequences, 64 waves, hours; the warning names the fixes."""
    _, _, before = _dsv3("rollout.max_model_len=34816", "rollout.max_new_tokens=32768",
                         "optim.max_tokens_per_micro_batch=34816")
    gpu = Gpu(3350 * GB, 989e12, 0.4)
    lengths = lengths_of(34816, 32768)
    step = step_time(before, lengths, gpu)
    assert (step.rollout.concurrency, step.rollout.sequences, step.rollout.waves) == (4, 256, 64)
    assert step.rollout.seconds > 2 * 3600 and step.rollout.crowded
    text = render(before, step, lengths, gpu)
    assert "each engine holds 4 of the 256 sequences" in text and "64 waves" in text
    for fix in ("rollout.tensor_parallel_size", "rollout.gpu_memory_utilization", "FP8 KV cache", "rollout.max_model_len"):
        assert fix in text, fix
    # typical lengths (512 + 4096 tokens): 37 at once, still under a quarter of 256
    assert plan_main([RECIPE, f"model.path={FIXTURE}", "--response-tokens", "4096", "--prompt-tokens", "512"]) == 0
    assert "37 at once: 7 waves" in capsys.readouterr().out
    assert plan_main([TINY, "--gpus", "8", "--gpu-memory-gb", "24"]) == 0  # the tiny recipe: one wave, no warning
    out = capsys.readouterr().out
    assert "64 at once: 1 wave," in out and "warning" not in out


def test_search_ranks_by_estimated_step_time():
    cfg = load_config(TINY, ["launch.gpus_per_node=8"], check_files=False)
    shape = model_shape("", "deepseek_v3")
    result = search(cfg, shape, 8, int(0.06 * GB), GPU)
    assert result.fits and len(result.times) == len(result.fits)
    keys = [(t.seconds, -p.run.dp, -p.margin) for p, t in zip(result.fits, result.times)]
    assert keys == sorted(keys)
    rollouts = {t.rollout for t in result.times}  # the engines are chosen first: one rollout for every layout
    assert len(rollouts) == 1 and all(t.seconds == t.rollout.seconds + t.update_s for t in result.times)
    assert result.engine.count * result.engine_tp == 8  # as many engines as fill the GPUs


def test_search_chooses_the_fastest_engines():
    """Not the smallest TP that fits: on 8 GPUs of 20 MB, eight TP1 engines of the tiny DeepSeek-V3
    hold 6 sequences each (2 waves), four TP2 engines 10 each, sooner. DeepSeek-V3 in bf16 fits no
    engine within a node; of TP32, TP64 and TP128 (4, 2 and 1 engines) TP32 is the fastest."""
    tiny = load_config(TINY, ["launch.gpus_per_node=8"], check_files=False)
    h100 = Gpu(3350 * GB, 989e12)
    chosen, tried = _engine_choice(tiny, model_shape("", "deepseek_v3"), 8, int(0.02 * GB), 8, lengths_of(64, 8), h100)
    one, two = tried[0], tried[1]
    assert (one.engine.tp, one.count, one.rollout.concurrency, two.engine.tp, two.rollout.concurrency) == (1, 8, 6, 2, 10)
    assert chosen is two and two.rollout.seconds < one.rollout.seconds
    cfg, shape, _ = _dsv3()
    chosen, tried = _engine_choice(cfg, shape, 128, 80 * GB, 8, lengths_of(18432, 16384), h100)
    fitting = [o for o in tried if o.rollout]
    assert [(o.engine.tp, o.count) for o in fitting] == [(32, 4), (64, 2), (128, 1)]
    assert chosen.engine.tp == 32 and chosen.rollout.seconds == min(o.rollout.seconds for o in fitting)
