"""The parity gate: after each sync, the engine and the trainer must score a probe batch alike.

Both sides give the log-probability of every probe token given its prefix (the engine through
prompt logprobs, Megatron through its forward). The gap is logged every step as
`rollout/logprob_abs_diff_mean` and `_max`; above the threshold training stops, and the message
says whether a tensor arrived different from what was sent (checksums), an engine parameter was
not reached by the sync, or the weights are intact and the gap is numerical (dtype, kernels).
For an MoE model whose engines return routes the gate also compares routing: the experts the
engine chose for every probe token against the trainer's own top-k (`rollout/probe_routing_*`,
mrl/launch/route_probe.py).
"""

from __future__ import annotations

import torch

from mrl.sync.wire import WeightUpdateReport

PROBE_SEED = 4321


class ParityError(RuntimeError):
    """The engine does not hold the policy the trainer just produced."""


def probe_sequences(vocab_size: int, count: int = 4, length: int = 24, seed: int = PROBE_SEED) -> list[list[int]]:
    """Fixed random token ids: any model works, with or without a tokenizer."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, length), generator=generator).tolist()


def logprob_gap(engine: list[list[float]], trainer: list[list[float]]) -> dict[str, float]:
    """Mean and max |engine − trainer| over every scored token."""
    a, b = torch.tensor(engine, dtype=torch.float64), torch.tensor(trainer, dtype=torch.float64)
    if a.shape != b.shape:
        raise ValueError(f"engine scored {tuple(a.shape)} tokens, trainer {tuple(b.shape)}: probe batches differ")
    diff = (a - b).abs()
    return {"rollout/logprob_abs_diff_mean": diff.mean().item(), "rollout/logprob_abs_diff_max": diff.max().item()}


def check_parity(gap: dict[str, float], threshold: float, report: WeightUpdateReport, step: int) -> None:
    """Raise ParityError naming the likely cause when the max gap exceeds `threshold`."""
    worst = gap["rollout/logprob_abs_diff_max"]
    if worst <= threshold:
        return
    head = (f"step {step}: vLLM and Megatron disagree after the weight sync: max |Δ logprob| = {worst:.3g} "
            f"(mean {gap['rollout/logprob_abs_diff_mean']:.3g}) > threshold {threshold:g}.")
    if "rollout/probe_routing_agreement" in gap:  # a flipped expert choice explains a large gap by itself
        head += (f" Routing on the probe: {gap['rollout/probe_routing_agreement']:.4f} of the expert choices agree "
                 f"(worst MoE layer {gap['rollout/probe_routing_agreement_min_layer']:.4f}).")
    if report.mismatched:
        cause = (f"The first tensor that arrived different from what was sent is {report.mismatched[0]!r} "
                 f"({len(report.mismatched)} in all): the transport corrupted or lost data.")
    elif report.misapplied:
        cause = (f"Engine parameter region {report.misapplied[0]} does not hold what the sync plan copied "
                 f"there ({len(report.misapplied)} in all): a plan entry writes over another's region "
                 "(mrl/sync/plan.py), or the copy missed the live parameter.")
    elif report.not_updated:
        cause = (f"The sync never reached engine parameter {report.not_updated[0]!r} "
                 f"({len(report.not_updated)} in all): a mapping-table row is missing for this architecture.")
    else:
        cause = (f"All {report.tensors} tensors arrived intact and every engine parameter was updated: the gap "
                 "is either numerical (compare dtypes, e.g. a bf16 engine against an fp32 trainer, and the "
                 "threshold) or state the engine derives from its weights was left stale by its reload "
                 "(pre-packed GEMMs, tied heads, MLA matrices: the post-apply hooks in mrl/rollout/vllm_weights.py, "
                 "the CPU re-packing in mrl/rollout/vllm_cpu.py).")
    raise ParityError(f"{head} {cause}")
