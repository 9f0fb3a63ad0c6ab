"""Context parallelism (parallel.cp) on 4 gloo processes: every CP layout computes what CP 1 computes.

For a dense model (tiny qwen3) and an MLA + MoE one (tiny DeepSeek-V3), each layout below is built
in turn on the same 4 ranks and must reproduce the reference layout (TP1, CP1: DP4):
- the full-vocabulary logits of two sequences (mrl.megatron.forward, as `mrl verify` uses them);
- compute_logprobs' log-probs and entropy of a ragged rollout batch (each rank scores it whole),
  and a critic's values (compute_values, the model with a value head);
- one update_actor step at lr 0 on that batch split over the layout's data-parallel ranks
  (data_parallel_rows: the global token-mean), and on qwen3 CP2 and DeepSeek-V3 TP2×CP2 one for
  each sequence-level loss of ALGOS too (a sequence mean with an entropy bonus, GSPO's and MIS's
  sequence ratios, over sequences split over the CP ranks): the global grad norm, the batch's
  pg_loss and the gradient of the final norm's weight, a replicated parameter every CP rank gets
  a share of;
- the first step's ppo_kl exactly 0 and ratio mean exactly 1 (log-probs and update agree bit for
  bit under CP too);
- the loss metrics of each data-parallel slice (entropy, clip fraction, ratio mean) equal those of
  a CP1 layout with the same data-parallel slices (CP2 against TP2): token means over whole
  sequences, not means of the CP ranks' means.
"""

from __future__ import annotations

import pytest
import torch

from fixtures.rollout import ragged_rollout_batch
from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local
from mrl.megatron.parallel import from_last_stage

TIMEOUT_S = 900
WORLD = 4

LAYOUTS = {
    "qwen3": {"CP2": ParallelLayout(cp=2), "TP2×CP2": ParallelLayout(tp=2, cp=2), "PP2×CP2": ParallelLayout(pp=2, cp=2),
              "PP2×VPP2×CP2": ParallelLayout(pp=2, vpp=2, cp=2)},
    "deepseek_v3": {"CP2": ParallelLayout(cp=2), "TP2×CP2": ParallelLayout(tp=2, cp=2),
                    "CP2×EP2": ParallelLayout(cp=2, ep=2)},
}
# `make test` keeps one layout per path (dense CP, dense CP under PP with VPP, MLA + MoE CP under TP,
# CP with EP); `make test-matrix` runs the rest.
KEPT = {"qwen3": ["CP2", "PP2×VPP2×CP2"], "deepseek_v3": ["TP2×CP2", "CP2×EP2"]}
SWEPT = {arch: [name for name in layouts if name not in KEPT[arch]] for arch, layouts in LAYOUTS.items()}
REFERENCE = ParallelLayout()
# CP2 (DP2) against a CP1 layout with the same data-parallel slices: their loss metrics must agree
SAME_DP = {"qwen3": ("CP2", "TP2", ParallelLayout(tp=2))}
# update_actor's loss settings: token-mean everywhere; the sequence-level ones (seq-mean-token-sum
# differs from seq-mean-token-mean only in its divisor: tests/unit/test_algo.py) on a dense and an
# MLA + MoE layout, against the reference. MIS gets engine log-probs that differ from the trainer's.
ALGOS = {"token-mean": {"aggregation": "token-mean"},
         "seq-mean-token-mean": {"aggregation": "seq-mean-token-mean", "entropy_coef": 0.01},
         "gspo+mis": {"policy_loss": "gspo", "clip_low": 0.5, "clip_high": 0.5, "rollout_correction": "mis",
                      "rollout_mis_low": 0.9, "rollout_mis_high": 1.1}}
SEQUENCE_LEVEL_ON = {"qwen3": {"reference", "CP2", "TP2"}, "deepseek_v3": {"reference", "TP2×CP2"}}
EXACT_METRICS = ("actor/entropy", "actor/pg_clipfrac", "actor/ratio_mean", "actor/ppo_kl")


def _rollout_batch(vocab: int) -> dict:
    """8 sequences: 4-token prompts and responses of 2..19 tokens, right-padded to 24 tokens."""
    return ragged_rollout_batch(vocab, [9, 18, 3, 14, 6, 19, 2, 11])


def _run_layout(arch_dir: str, layout: ParallelLayout, algos: dict) -> dict:
    from megatron.core import parallel_state as ps

    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.forward import forward_logits
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import destroy_layout, initialize_layout
    from mrl.megatron.policy import compute_logprobs, compute_values, data_parallel_rows
    from mrl.megatron.training import OptimConfig, make_trainable
    from mrl.models.registry import model_spec_from_hf

    coords = initialize_layout(layout)
    built = build_model(model_spec_from_hf(arch_dir), layout)
    load_hf_weights(built, coords, arch_dir)
    trainable = make_trainable(built, OptimConfig(lr=0.0, clip_grad=0.0))
    batch = _rollout_batch(built.spec.vocab_size)
    logits = from_last_stage(forward_logits(built, batch["tokens"][[1, 5], :20]))
    scored = from_last_stage(compute_logprobs(trainable, batch, layout.tp, 4, with_entropy=True))
    # the engine's log-probs for MIS: the trainer's, moved by a fixed amount per token
    noise = torch.randn(batch["response_mask"].shape, generator=torch.Generator().manual_seed(1)) * 0.05
    batch["rollout_logprobs"] = (scored["logprobs"] + noise) * batch["response_mask"]
    mine = data_parallel_rows(batch, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    updates = {name: _update(trainable, built, mine, layout.tp, algo) for name, algo in algos.items()}
    critic = build_model(model_spec_from_hf(arch_dir), layout, value_head=True)  # PPO's critic: per-token values
    load_hf_weights(critic, coords, arch_dir)
    values = from_last_stage(compute_values(critic, batch, 4))
    result = {"logits": logits, "logprobs": scored["logprobs"], "entropy": scored["entropy"], "updates": updates,
              "values": values["values"], "dp_rank": ps.get_data_parallel_rank()}
    destroy_layout()
    return result


def _update(trainable, built, mine: dict, tp: int, algo: dict) -> dict:
    """update_actor's metrics and the final norm's weight gradient (every rank), from the loaded
    model: at lr 0 the weights stay, and DeepSeek-V3's expert biases, which an update moves by
    the sign of each expert's load, are put back after it."""
    from mrl.megatron.policy import compute_logprobs, update_actor

    biases = [buffer for chunk in built.chunks for name, buffer in chunk.named_buffers() if name.endswith("expert_bias")]
    kept = [bias.detach().clone() for bias in biases]
    if "old_logprobs" not in mine:  # the same for every update: the model is put back after each
        old = compute_logprobs(trainable, mine, tp, 2)  # None off the last stage
        mine["old_logprobs"] = from_last_stage(old["logprobs"] if old else None)
    metrics = update_actor(trainable, mine, algo, 2)
    norm_grad = None
    for chunk in built.chunks:
        if chunk.post_process:
            norm_grad = chunk.decoder.final_layernorm.weight.main_grad.detach().clone()
    for bias, value in zip(biases, kept):
        bias.data.copy_(value)
    return {"metrics": metrics, "norm_grad": from_last_stage(norm_grad)}


def _all_layouts(rank: int, world_size: int, dirs: dict, chosen: dict[str, list[str]]) -> dict:
    results = {}
    for arch, names in chosen.items():
        layouts = {name: LAYOUTS[arch][name] for name in names}
        extra = {SAME_DP[arch][1]: SAME_DP[arch][2]} if SAME_DP.get(arch, (None,))[0] in names else {}
        for name, layout in {"reference": REFERENCE, **layouts, **extra}.items():
            algos = ALGOS if name in SEQUENCE_LEVEL_ON[arch] else {"token-mean": ALGOS["token-mean"]}
            results[arch, name] = _run_layout(dirs[arch], layout, algos)
    return results


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("chosen", [KEPT, pytest.param(SWEPT, marks=pytest.mark.matrix)], ids=["kept", "swept"])
def test_context_parallel_matches_cp1(tiny_model_dir, chosen):
    dirs = {arch: str(tiny_model_dir(arch)) for arch in chosen}
    per_rank = run_local(_all_layouts, WORLD, dirs, chosen, timeout_s=TIMEOUT_S)
    mask = _rollout_batch(1000)["response_mask"].bool()
    for arch, layouts in chosen.items():
        ref = per_rank[0][(arch, "reference")]
        for name in layouts:
            for rank in range(WORLD):
                got, where = per_rank[rank][(arch, name)], f"{arch} {name} rank {rank}"
                assert got["logits"].shape == ref["logits"].shape, where
                assert _max_diff(got["logits"], ref["logits"]) <= 1e-4, f"{where}: logits"
                assert (got["logprobs"][mask] < 0).all(), f"{where}: log-probs"
                # every position, prompts included (the trimmed columns past the last response are 0 in both)
                assert _max_diff(got["logprobs"], ref["logprobs"]) <= 1e-5, f"{where}: log-probs"
                assert _max_diff(got["entropy"], ref["entropy"]) <= 1e-5, f"{where}: entropy"
                assert _max_diff(got["values"], ref["values"]) <= 1e-5, f"{where}: a critic's values"
                for algo in got["updates"]:
                    _check_update(got["updates"][algo], ref["updates"][algo], f"{where} {algo}")
            for algo in per_rank[0][(arch, name)]["updates"]:
                # each rank reports its DP slice's share of the batch's loss: their mean over the ranks is the batch's
                loss, ref_loss = (sum(per_rank[r][(arch, n)]["updates"][algo]["metrics"]["actor/pg_loss"]
                                      for r in range(WORLD)) / WORLD for n in (name, "reference"))
                assert loss == pytest.approx(ref_loss, rel=1e-4, abs=1e-7), (
                    f"{arch} {name} {algo}: pg_loss {loss} vs CP1 {ref_loss}")
            if SAME_DP.get(arch, (None,))[0] == name:
                _check_slice_metrics(per_rank, arch, name, SAME_DP[arch][1])


def _check_update(got: dict, ref: dict, where: str) -> None:
    metrics = got["metrics"]
    assert metrics["actor/ppo_kl"] == 0.0, f"{where}: first-step ppo_kl {metrics['actor/ppo_kl']}"
    assert metrics["actor/ratio_mean"] == 1.0, f"{where}: first-step ratio_mean {metrics['actor/ratio_mean']}"
    assert metrics["actor/grad_norm"] > 0, f"{where}: no gradient"
    assert metrics["actor/grad_norm"] == pytest.approx(ref["metrics"]["actor/grad_norm"], rel=1e-4), where
    assert _max_diff(got["norm_grad"], ref["norm_grad"]) <= 1e-5 * max(1.0, float(ref["norm_grad"].abs().max())), (
        f"{where}: final norm's gradient")


def _check_slice_metrics(per_rank: list, arch: str, name: str, same_dp: str) -> None:
    """Every rank's token-mean metrics equal those of the CP1 layout's rank with the same data-parallel slice."""
    by_slice = {per_rank[r][(arch, same_dp)]["dp_rank"]: per_rank[r][(arch, same_dp)] for r in range(WORLD)}
    for rank in range(WORLD):
        got = per_rank[rank][(arch, name)]
        want = by_slice[got["dp_rank"]]
        for algo in got["updates"]:
            for key in EXACT_METRICS:
                value, expected = got["updates"][algo]["metrics"][key], want["updates"][algo]["metrics"][key]
                assert value == pytest.approx(expected, rel=1e-5, abs=1e-7), (
                    f"{arch} {name} rank {rank} {algo}: {key} {value} vs {same_dp} {expected}")
