"""The PPO critic (build_model(value_head=True)) on 2 gloo processes.

A tied (llama) and an untied (qwen3, whose lm_head the critic must skip) tiny model are loaded as
critics in TP2 (the value head gathers the sequence-parallel hidden states) and PP2 (the head on
the last stage only, embeddings untied across stages). Two critic steps toward fixed returns:
the first values are exactly 0 (zero-initialised head), the first step's clip is inactive, the
loss falls, and both layouts compute the same values, losses and gradient norms — which a wrong
gradient through the sequence gather (e.g. summed instead of split over TP ranks) would break.
"""

from __future__ import annotations

import pytest
import torch

from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import run_local
from mrl.megatron.parallel import from_last_stage

TIMEOUT_S = 240
LAYOUTS = {"TP2": ParallelLayout(tp=2), "PP2": ParallelLayout(pp=2)}


def _batch(vocab: int) -> dict:
    """4 sequences of 4 prompt tokens and 5..11 response tokens; returns drawn at random."""
    generator = torch.Generator().manual_seed(0)
    lengths, prompt, width = [5, 11, 7, 9], 4, 16
    tokens = torch.zeros(len(lengths), width + 1, dtype=torch.long)
    mask = torch.zeros(len(lengths), width)
    for row, length in enumerate(lengths):
        tokens[row, : prompt + length] = torch.randint(3, vocab, (prompt + length,), generator=generator)
        mask[row, prompt - 1 : prompt - 1 + length] = 1.0
    returns = (torch.rand(len(lengths), width, generator=generator) + 0.5) * mask
    return {"tokens": tokens, "response_mask": mask, "returns": returns}


def _critic_steps(rank: int, world_size: int, dirs: dict) -> dict:
    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import destroy_layout, initialize_layout
    from mrl.megatron.policy import compute_values, update_critic
    from mrl.megatron.training import OptimConfig, make_trainable
    from mrl.models.registry import model_spec_from_hf

    results = {}
    for arch, hf_dir in dirs.items():
        for name, layout in LAYOUTS.items():
            coords = initialize_layout(layout)
            spec = model_spec_from_hf(hf_dir)
            built = build_model(spec, layout, value_head=True)
            load_hf_weights(built, coords, hf_dir)
            trainable = make_trainable(built, OptimConfig(lr=1e-2))
            batch = _batch(spec.vocab_size)
            steps = []
            for _ in range(3):
                values = from_last_stage(compute_values(trainable, batch, micro_batch_size=2))
                metrics = update_critic(trainable, {**batch, **values}, cliprange=0.5, aggregation="token-mean",
                                        micro_batch_size=2)
                steps.append({"values": values["values"], "metrics": metrics})
            results[f"{arch} {name}"] = steps
            destroy_layout()
    return results


def test_critic_learns_the_same_in_tp2_and_pp2(tiny_model_dir):
    dirs = {arch: str(tiny_model_dir(arch)) for arch in ("llama", "qwen3")}
    per_rank = run_local(_critic_steps, 2, dirs, timeout_s=TIMEOUT_S)
    mask = _batch(1000)["response_mask"].bool()
    for arch in dirs:
        for name in LAYOUTS:
            steps = per_rank[0][f"{arch} {name}"]
            assert [s["metrics"] for s in steps] == [s["metrics"] for s in per_rank[1][f"{arch} {name}"]], name
            first, last = steps[0]["metrics"], steps[-1]["metrics"]
            assert torch.equal(steps[0]["values"], torch.zeros_like(steps[0]["values"])), f"{arch} {name}"
            assert first["critic/vf_clipfrac"] == 0.0 and first["critic/vpred_mean"] == 0.0, first
            assert first["critic/grad_norm"] > 0 and last["critic/vf_loss"] < first["critic/vf_loss"], steps
            assert steps[-1]["values"][mask].abs().min() > 0, f"{arch} {name}: values did not move"
        tp2, pp2 = per_rank[0][f"{arch} TP2"], per_rank[0][f"{arch} PP2"]
        for step, (a, b) in enumerate(zip(tp2, pp2)):
            torch.testing.assert_close(a["values"], b["values"], atol=1e-5, rtol=1e-4)
            for key in ("critic/vf_loss", "critic/grad_norm", "critic/vpred_mean"):
                assert a["metrics"][key] == pytest.approx(b["metrics"][key], rel=1e-4, abs=1e-6), (arch, step, key)


def _named_params(built):
    """(chunk:name, parameter) of every chunk, without DDP's `module.` prefix."""
    for i, chunk in enumerate(built.chunks):
        for name, param in chunk.named_parameters():
            yield f"{i}:{name.removeprefix('module.')}", param


def _params(built) -> dict:
    return {name: param.detach().clone() for name, param in _named_params(built)}


def _start_from_policy(rank: int, world_size: int, hf_dir: str, root: str, layout: ParallelLayout) -> dict:
    """A policy moved away from the HF weights is saved; a reference and a critic built from the
    HF weights then load it (load_policy_weights). What each holds is returned for comparison."""
    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.checkpoint import CheckpointMismatchError, load_policy_weights, save_checkpoint
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import destroy_layout, initialize_layout
    from mrl.megatron.policy import compute_values, update_critic
    from mrl.megatron.training import OptimConfig, make_trainable
    from mrl.models.registry import model_spec_from_hf

    coords = initialize_layout(layout)
    spec = model_spec_from_hf(hf_dir)

    def loaded(**kwargs):
        built = build_model(spec, layout, **kwargs)
        load_hf_weights(built, coords, hf_dir)
        return built

    policy = make_trainable(loaded(), OptimConfig(lr=1e-3))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # as an SFT would: every weight moves away from the HF one
        for _, param in sorted(_named_params(policy.built), key=lambda item: item[0]):
            param.add_(0.01 * torch.randn(param.shape, generator=generator))
    save_checkpoint(root, policy, step=5, data_state={"rl_step": 0})
    reference = loaded()
    hf_reference = _params(reference)
    load_policy_weights(root, reference)
    critic = make_trainable(loaded(value_head=True), OptimConfig(lr=1e-2))
    load_policy_weights(root, critic.built)
    critic.optimizer.reload_model_params()
    critic_params = _params(critic.built)
    batch = _batch(spec.vocab_size)
    values = from_last_stage(compute_values(critic, batch, micro_batch_size=2))
    metrics = update_critic(critic, {**batch, **values}, cliprange=0.5, aggregation="token-mean", micro_batch_size=2)
    try:
        load_policy_weights(str(root) + "-missing", reference)
        refused = None
    except (CheckpointMismatchError, FileNotFoundError, ValueError) as err:
        refused = str(err)
    destroy_layout()
    return {"policy": _params(policy.built), "hf": hf_reference, "reference": _params(reference),
            "critic": critic_params, "values": values, "metrics": metrics, "refused": refused}


@pytest.mark.parametrize("layout", ["TP2", "PP2"])
def test_reference_and_critic_start_from_a_policy_checkpoint(tiny_model_dir, tmp_path, layout):
    """After an SFT the RL reference and a fresh critic must hold the SFT'd policy, not the HF weights."""
    hf_dir = str(tiny_model_dir("qwen3"))  # untied: the policy checkpoint has an lm_head the critic skips
    for rank in run_local(_start_from_policy, 2, hf_dir, str(tmp_path / "ckpt"), LAYOUTS[layout], timeout_s=TIMEOUT_S):
        policy, reference, critic = rank["policy"], rank["reference"], rank["critic"]
        assert reference.keys() == policy.keys()
        for name, tensor in policy.items():
            assert torch.equal(reference[name], tensor), name
            assert not torch.equal(rank["hf"][name], tensor), f"{name}: the policy was not moved off the HF weights"
        head = {name for name in critic if "output_layer" in name}
        assert len(head) in (0, 2), head  # only the last stage holds the value head
        for name in head:
            assert torch.equal(critic[name], torch.zeros_like(critic[name])), f"{name} is not the fresh value head"
        trunk = critic.keys() - head
        assert trunk and trunk <= policy.keys(), trunk - policy.keys()
        for name in trunk:
            assert torch.equal(critic[name], policy[name]), name
        if rank["values"] is not None:
            assert torch.equal(rank["values"]["values"], torch.zeros_like(rank["values"]["values"]))
        assert rank["metrics"]["critic/grad_norm"] > 0
        assert rank["refused"] is not None
