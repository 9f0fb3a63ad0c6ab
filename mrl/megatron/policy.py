"""The Megatron side of the RL updates: micro-batching of rollout batches, the forward-only
log-prob and value passes (vocab-parallel math: mrl/megatron/vocab_parallel.py), the
policy-gradient step and (PPO) the critic's value-regression step.

A rollout batch is a dict of CPU tensors, [B, L] per token ([B, L+1] tokens); `micro_batches` cuts
it into micro-batches of one shape [b, s], as Megatron's pipeline schedules require. The shape
legend and the batch's keys are the comment above PER_TOKEN_KEYS.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable

import torch

from mrl.megatron.context_parallel import gather_outputs, local_positions, release_mask, split_micro_batch
from mrl.megatron.model import BuiltModel
from mrl.megatron.parallel import from_last_stage
from mrl.megatron.router_replay import RoutePass, RoutePlan, fit_routes, route_pass
from mrl.megatron.training import LossFn, Trainable, attention_mask, lm_loss, train_step
from mrl.megatron.vocab_parallel import vocab_parallel_entropy, vocab_parallel_logprobs

# Shape legend:
#   B    sequences in the rollout batch (this data-parallel rank's share)
#   L    label positions of the rollout batch: tokens are [B, L+1], labels = tokens[:, 1:]
#   Lt   label positions kept after trimming the trailing columns that hold no response label
#   s    micro-batch sequence length: Lt right-padded to a multiple of TP (sequence parallelism)
#   b    micro-batch size (sequences per micro-batch; every micro-batch has the same [b, s])
#   V/tp this TP rank's slice of the padded vocabulary (Megatron's vocab-parallel logits [b, s, V/tp])
#
# A rollout batch is a dict of CPU tensors:
#   tokens        long  [B, L+1]  prompt + response ids, right-padded with 0
#   response_mask float [B, L]    1.0 where labels[:, t] = tokens[:, t+1] is a response token
#   advantages    float [B, L]    (RL)
#   old_logprobs  float [B, L]    (RL; from compute_logprobs)
#   rollout_logprobs float [B, L] (RL with algo.rollout_correction or decoupled_ppo: the engine's)
#   ref_logprobs  float [B, L]    (optional; the KL-in-the-loss term)
#   values        float [B, L]    (critic update; from compute_values)
#   returns       float [B, L]    (critic update; the GAE targets)
#   segments      float [B, L]    (packed SFT rows; the sequence of each input position, 0: padding)
#   routes        [B, L, M, K]    (MoE routing replay: ids per input position and MoE layer; routes_len [B]
#                                 positions with a route; micro-batches get long [b, s, M, K], -1: none)
#   loss_totals   dict            (optional; from data_parallel_rows) the whole batch's response tokens
#                                 and sequences over the DP size: what the loss means divide by
# A micro-batch (see micro_batches) holds the same per-token keys at [b, s], plus "tokens" (the model
# input, tokens[:, :-1]), "labels", "loss_mask" (the same tensor as "response_mask", under the name
# training.lm_loss reads, so SFT and RL share one micro-batching), "index" (original rows, -1 for
# filler rows), "label_columns" (Lt) and the loss weights of the micro-batch (see _loss_weights).
#
# Per-token keys of a rollout batch, all [B, L]; "tokens" [B, L+1] is handled apart.
PER_TOKEN_KEYS = ("response_mask", "advantages", "old_logprobs", "rollout_logprobs", "ref_logprobs", "values",
                  "returns", "segments")


# ---------------------------------------------------------------------------------------------
# Micro-batching
# ---------------------------------------------------------------------------------------------


def micro_batches(
    batch: dict, tp: int, micro_batch_size: int, max_tokens_per_micro_batch: int | None = None
) -> list[dict]:
    """Split a rollout batch into equal-shaped micro-batches [b, s] (the legend above PER_TOKEN_KEYS); `tp`:
    the multiple s is padded to (BuiltModel.sequence_multiple: TP, more with FP8).

    Columns after the batch's last response label are trimmed first: they carry no loss and, as
    attention is causal, do not change earlier positions, so short batches run short. With a token
    budget, b = budget // s (capped at B), otherwise b = micro_batch_size. When b does not divide B
    the last micro-batch is filled with all-padding rows (index -1, mask 0) so every shape is equal,
    as Megatron's pipeline schedules require.
    """
    tokens, mask = _check_batch(batch)
    count = tokens.shape[0]
    kept = _kept_label_columns(mask)
    seq = -(-kept // tp) * tp
    size = _micro_batch_size(count, seq, micro_batch_size, max_tokens_per_micro_batch)
    rows = -(-count // size) * size

    def fit(t: torch.Tensor, columns: int) -> torch.Tensor:
        """t[:, :columns] zero-padded to [rows, seq]."""
        t = t[:, :columns]
        return torch.nn.functional.pad(t, (0, seq - t.shape[1], 0, rows - count))

    full = {
        "tokens": fit(tokens[:, :-1], kept),
        "labels": fit(tokens[:, 1:], kept),
        "index": torch.nn.functional.pad(torch.arange(count), (0, rows - count), value=-1),
    }
    for key in PER_TOKEN_KEYS:
        if key in batch:
            full[key] = fit(batch[key].float(), kept)
    full["loss_mask"] = full["response_mask"]
    if "routes" in batch:  # mrl.megatron.router_replay
        full["routes"] = fit_routes(batch["routes"], batch["routes_len"], rows, seq)
    totals = batch.get("loss_totals") or _loss_totals(full["response_mask"])
    result = []
    for start in range(0, rows, size):
        micro = {key: value[start : start + size] for key, value in full.items()}
        micro.update(_loss_weights(micro["response_mask"], totals, rows // size))
        micro["label_columns"] = kept  # the real (untrimmed, unpadded) columns, for restore_order
        result.append(micro)
    return result


def data_parallel_rows(batch: dict, dp_rank: int, dp_size: int) -> dict:
    """DP rank `dp_rank`'s equal share of the rows of a whole batch, with the whole batch's loss
    totals per rank ("loss_totals"): a token-mean is then over the global batch's tokens, not over
    this rank's (DDP averages gradients over DP, so each rank divides by the global count / DP).
    With unequal token counts per rank, a rank-local mean would weigh short answers' tokens more."""
    rows = batch["tokens"].shape[0]
    if rows % dp_size:
        raise ValueError(f"a batch of {rows} sequences does not split over {dp_size} data-parallel ranks: "
                         "make data.batch_size × rollout.n_samples_per_prompt a multiple of DP")
    size = rows // dp_size
    mine = {key: value[dp_rank * size : (dp_rank + 1) * size] for key, value in batch.items()
            if isinstance(value, torch.Tensor)}
    mine["loss_totals"] = {k: v / dp_size for k, v in _loss_totals(batch["response_mask"]).items()}
    return mine


def restore_order(per_micro_batch: list[torch.Tensor], micro: list[dict], count: int, length: int) -> torch.Tensor:
    """Put per-micro-batch results [b, s] back in the batch's row order: [count, length].

    Filler rows (index -1) are dropped; trimmed and TP-padding columns come back as 0. The result
    is in host memory, as a rollout batch is.
    """
    values = torch.cat(per_micro_batch)[:, : micro[0]["label_columns"]].cpu()
    values = torch.nn.functional.pad(values, (0, length - values.shape[1]))
    index = torch.cat([m["index"] for m in micro])
    real = index >= 0
    out = values.new_zeros(count, length)
    out[index[real]] = values[real]
    return out


def _check_batch(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, mask = batch.get("tokens"), batch.get("response_mask")
    if tokens is None or mask is None:
        raise ValueError(f"a rollout batch needs 'tokens' and 'response_mask'; it has {sorted(batch)}")
    if tokens.dim() != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be [B, L+1] with L >= 1, got {tuple(tokens.shape)}")
    expected = (tokens.shape[0], tokens.shape[1] - 1)
    for key in PER_TOKEN_KEYS:
        if key in batch and tuple(batch[key].shape) != expected:
            raise ValueError(f"batch[{key!r}] is {tuple(batch[key].shape)}, expected [B, L] = {expected} "
                             "(aligned to labels = tokens[:, 1:])")
    return tokens, mask


def _kept_label_columns(mask: torch.Tensor) -> int:
    """Label columns up to the batch's last response label (at least 1)."""
    used = (mask != 0).any(dim=0).nonzero()
    return int(used[-1]) + 1 if used.numel() else 1


def _micro_batch_size(count: int, seq: int, micro_batch_size: int, budget: int | None) -> int:
    if budget is None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        return min(micro_batch_size, count)
    if budget < seq:
        raise ValueError(f"max_tokens_per_micro_batch={budget} is below one sequence of {seq} tokens: "
                         f"raise it to at least {seq}")
    return min(budget // seq, count)


def _loss_totals(mask: torch.Tensor) -> dict[str, float]:
    return {"tokens": float((mask != 0).sum()), "sequences": float((mask != 0).any(dim=-1).sum())}


def _loss_weights(mask: torch.Tensor, totals: dict[str, float], count: int) -> dict[str, float]:
    """Weights that turn per-micro-batch means into means over the whole batch.

    The pipeline schedule averages micro-batch losses (divides each by the micro-batch count).
    Micro-batches hold unequal numbers of response tokens, so a token-mean loss is scaled by
    count·tokens_mb/tokens_batch (and a sequence mean by its sequence share): the summed gradient
    is then the gradient of the mean over the whole batch, whatever the micro-batching. `totals`
    are the global batch's counts over DP (see data_parallel_rows), or this batch's own.
    """
    here = _loss_totals(mask)
    return {
        f"loss_scale_{kind}": count * here[kind] / totals[kind] if totals[kind] else 0.0 for kind in here
    }


# What each aggregation averages over, hence how a micro-batch's share of the batch is counted.
_AGGREGATION_UNITS = {"token-mean": "tokens", "seq-mean-token-mean": "sequences", "seq-mean-token-sum": "sequences"}


def _loss_scale(micro: dict, aggregation: str) -> float:
    """The micro-batch's weight for an aggregation (token-mean: tokens; seq-mean-*: sequences)."""
    if aggregation not in _AGGREGATION_UNITS:
        raise ValueError(f"aggregation {aggregation!r} has no micro-batch weighting: add it to "
                         f"mrl.megatron.policy._AGGREGATION_UNITS (known: {sorted(_AGGREGATION_UNITS)})")
    return micro[f"loss_scale_{_AGGREGATION_UNITS[aggregation]}"]


_FAIL_EARLY = {"loss_scale_tokens": 1.0, "loss_scale_sequences": 1.0}  # a micro-batch's weights, to check a setting


def _metric_scale(micro: dict, aggregation: str) -> float:
    """The weight of a loss metric (actor/pg_loss, critic/vf_loss, sft/loss) so that it is the
    batch's loss: the loss weight, times CP (train_step averages metrics over the CP ranks, and
    the batch's loss is their sum)."""
    return _loss_scale(micro, aggregation) * micro.get("cp_size", 1)


# ---------------------------------------------------------------------------------------------
# Forward-only log-probs
# ---------------------------------------------------------------------------------------------


def compute_logprobs(
    built_or_trainable: BuiltModel | Trainable,
    batch: dict,
    tp: int,
    micro_batch_size: int,
    with_entropy: bool = False,
    max_tokens: int | None = None,
    routes: RoutePlan | None = None,
) -> dict | None:
    """{"logprobs": [B, L], "entropy": [B, L] if with_entropy} on the last pipeline stage, else None.
    `routes` (MoE): replay the batch's routes and/or record the router's own, returned as
    "own_routes" [B, L, M, K] (mrl.megatron.router_replay).

    Forward only, through Megatron's pipeline schedule. Call it with the batch and micro-batching
    (micro_batch_size, max_tokens: the token budget) the update will use: the log-probs are then
    bitwise the ones the first training forward computes, so the first step's ratio is exactly 1
    and ppo_kl exactly 0. Positions after the batch's last response label are 0.
    """
    built = _built(built_or_trainable)
    if tp != built.layout.tp:
        raise ValueError(f"compute_logprobs got tp={tp} but the model is built for TP={built.layout.tp}")
    micro = micro_batches(batch, built.sequence_multiple, micro_batch_size, max_tokens)

    def score(logits: torch.Tensor, mb: dict) -> tuple:
        logprobs = vocab_parallel_logprobs(logits, mb["labels"], built.spec.vocab_size)
        return logprobs, vocab_parallel_entropy(logits, built.spec.vocab_size) if with_entropy else None

    count, length = batch["tokens"].shape[0], batch["tokens"].shape[1] - 1
    with route_pass(built, routes) as replay:
        outputs = _forward_only(built, micro, score, replay)
        own = replay.own_routes(micro, count, length) if replay and replay.plan.record else None  # collective
    if outputs is None:
        return None
    result = {"logprobs": restore_order([o[0] for o in outputs], micro, count, length)}
    if own is not None:
        result["own_routes"] = own
    if with_entropy:
        result["entropy"] = restore_order([o[1] for o in outputs], micro, count, length)
    return result


def compute_values(
    built_or_trainable: BuiltModel | Trainable, batch: dict, micro_batch_size: int, max_tokens: int | None = None
) -> dict | None:
    """{"values": [B, L]} of a critic (build_model(value_head=True)) on the last pipeline stage.

    values[:, t] is the critic's estimate for the state tokens[:, :t+1], the one in which the label
    tokens[:, t+1] is generated: aligned to response_mask, as GAE wants. Use the update's
    micro-batching, so the first critic epoch starts from exactly these values (vf_clipfrac 0).
    """
    built = _built(built_or_trainable)
    if not built.value_head:
        raise ValueError("compute_values needs a critic: build the model with value_head=True")
    micro = micro_batches(batch, built.sequence_multiple, micro_batch_size, max_tokens)
    outputs = _forward_only(built, micro, lambda values, mb: values[..., 0].float())
    if outputs is None:
        return None
    return {"values": restore_order(outputs, micro, batch["tokens"].shape[0], batch["tokens"].shape[1] - 1)}


def _built(built_or_trainable: BuiltModel | Trainable) -> BuiltModel:
    return built_or_trainable.built if isinstance(built_or_trainable, Trainable) else built_or_trainable


def _forward_only(built: BuiltModel, micro: list[dict], score: Callable[[torch.Tensor, dict], Any],
                  replay: RoutePass | None = None) -> list | None:
    """score(model output, micro-batch) of every micro-batch through Megatron's pipeline schedule,
    without gradients: the list on the last pipeline stage, None on the others."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    size, seq = micro[0]["tokens"].shape
    positions = local_positions(seq).unsqueeze(0).to(built.device)

    def forward_step(data_iterator, model):
        whole = next(data_iterator)
        mb = split_micro_batch(whole, built.device)  # CP: this rank's part of each sequence
        if replay:
            replay.before(model, mb)
        output = model(mb["tokens"], positions, attention_mask(whole, built.use_te, built.device))
        if replay:
            replay.after(model)
        return output, lambda out, non_loss_data=True: gather_outputs(score(out, mb))

    chunks = built.chunks
    # Train mode, as in train_step. Measured on CPU (tiny qwen3 TP2, qwen3_moe EP2 and TP2): train
    # and eval mode, with and without no_grad, all give log-probs bitwise equal to the training
    # forward's, since every registry spec sets dropout 0. Train mode keeps it so should a config
    # turn on a train-only branch (router jitter, ...). What does change the bits is the
    # micro-batching: MoE log-probs move by ~1e-6 between micro_batch_size 1 and 2 (expert GEMM
    # shapes), so compute_logprobs and update_actor must get the same micro-batch arguments.
    for chunk in chunks:
        chunk.train()
    iterators = [iter(micro) for _ in chunks]  # every virtual chunk walks the micro-batches
    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(micro), seq_length=seq, micro_batch_size=size,
            forward_only=True, collect_non_loss_data=True,
        )
    release_mask()
    return outputs if ps.is_pipeline_last_stage(ignore_virtual=True) else None


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ActorLoss:
    """The loss fields of mrl.config.schema.AlgoConfig (which policy_loss_fn also accepts)."""

    policy_loss: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float | None = None
    aggregation: str = "token-mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in_reward: bool = False
    entropy_coef: float = 0.0
    rollout_correction: str = "none"
    rollout_is_cap: float | None = None
    rollout_mis_low: float | None = None
    rollout_mis_high: float | None = None
    rollout_icepop_low: float | None = None
    rollout_icepop_high: float | None = None
    behav_imp_weight_cap: float | None = None

    def __post_init__(self) -> None:
        if self.policy_loss == "decoupled_ppo" and self.rollout_correction != "none":
            raise ValueError("decoupled_ppo already weights every token by π_old/π_rollout: "
                             f"rollout_correction must be 'none', got {self.rollout_correction!r}")

    @classmethod
    def of(cls, algo: Any) -> "ActorLoss":
        """From an ActorLoss, an AlgoConfig-like object or a dict (missing fields: defaults; a missing
        aggregation: the policy loss's own, as AlgoConfig resolves it)."""
        from mrl.algo import default_aggregation

        if isinstance(algo, cls):
            return algo
        read = algo.get if isinstance(algo, dict) else lambda name, default: getattr(algo, name, default)
        values = {f.name: read(f.name, f.default) for f in fields(cls) if f.name != "aggregation"}
        return cls(**values, aggregation=read("aggregation", None) or default_aggregation(values["policy_loss"]))

    @property
    def kl_in_loss(self) -> bool:
        return self.kl_coef > 0 and not self.kl_in_reward

    @property
    def uses_rollout_logprobs(self) -> bool:
        from mrl.algo import uses_rollout_logprobs

        return uses_rollout_logprobs(self.rollout_correction, self.policy_loss)

    def policy_loss_inputs(self, micro: dict) -> dict:
        """The policy loss's keywords beyond the clip settings: decoupled_ppo's behaviour log-probs,
        a rollout correction's per-token weights (computed per micro-batch: a micro-batch holds
        whole sequences, or under CP this rank's part of each with its sequence_parts, which MIS's
        sequence ratio needs). Nothing when neither is on."""
        from mrl.algo import BEHAVIOUR_LOSSES, correction_settings, rollout_correction

        inputs: dict = {}
        if self.policy_loss in BEHAVIOUR_LOSSES:
            inputs.update(behav_logp=micro["rollout_logprobs"], behav_weight_cap=self.behav_imp_weight_cap)
        if self.rollout_correction != "none":
            inputs["weights"] = rollout_correction(
                self.rollout_correction, micro["old_logprobs"], micro["rollout_logprobs"], micro["response_mask"],
                micro.get("sequence_parts"), **correction_settings(self.rollout_correction, self)).weights
        return inputs


def policy_loss_fn(algo: Any, vocab_size: int | None = None) -> LossFn:
    """A train_step loss: policy loss + kl_coef·KL(ref) + entropy bonus on one micro-batch.

    `algo` is an ActorLoss, an AlgoConfig or a dict of the same fields. Metrics use verl's names:
    actor/pg_loss, actor/ppo_kl, actor/pg_clipfrac, actor/ratio_mean, actor/ratio_max,
    actor/entropy, actor/kl_loss (KL in the loss only), actor/pg_clipfrac_lower (dual clip only).
    A rollout correction (algo.rollout_correction) or decoupled_ppo weights the policy-gradient term
    per token (numerator only: the normaliser is the batch's, as without them); KL and entropy terms
    are not weighted. Their rollout/is_* metrics are the trainer's, over the whole batch.
    train_step reports each as the mean over micro-batches (ratio_max included); pg_loss is
    weighted like the loss itself, so it is the batch's loss whatever the micro-batching.
    """
    from mrl.algo import KL_ESTIMATORS, aggregate, entropy_bonus, policy_loss
    from mrl.algo.aggregation import whole_mean

    config = ActorLoss.of(algo)
    _loss_scale(_FAIL_EARLY, config.aggregation)  # fail early

    def loss_fn(logits: torch.Tensor, micro: dict) -> tuple[torch.Tensor, dict]:
        mask, parts, aggregation = micro["response_mask"], micro.get("sequence_parts"), config.aggregation
        logp = vocab_parallel_logprobs(logits, micro["labels"], vocab_size)
        pg_loss, pg_metrics = policy_loss(
            config.policy_loss, logp, micro["old_logprobs"], micro["advantages"], mask,
            clip_low=config.clip_low, clip_high=config.clip_high, clip_ratio_c=config.clip_ratio_c,
            aggregation=aggregation, parts=parts, **config.policy_loss_inputs(micro),
        )
        loss = pg_loss
        # the loss: this rank's share, weighed; the other metrics are the whole sequences' already
        metrics = {"actor/pg_loss": pg_loss.detach() * _metric_scale(micro, aggregation)}
        metrics.update({f"actor/{k}": v for k, v in pg_metrics.items()})
        # Entropy is always reported; it is differentiated only when it is part of the loss.
        with torch.set_grad_enabled(torch.is_grad_enabled() and config.entropy_coef != 0):
            entropy = vocab_parallel_entropy(logits, vocab_size)
        bonus, metrics["actor/entropy"] = entropy_bonus(entropy, mask, config.entropy_coef, aggregation, parts)
        if config.entropy_coef != 0:
            loss = loss + bonus
        if config.kl_in_loss:  # the per-token estimate once, for the loss (this rank's share) and the metric
            kl = KL_ESTIMATORS.get(config.kl_estimator)(logp, micro["ref_logprobs"])
            loss = loss + config.kl_coef * aggregate(kl, mask, aggregation, parts)
            metrics["actor/kl_loss"] = whole_mean(kl.detach(), mask, aggregation, parts)
        return loss * _loss_scale(micro, aggregation), metrics

    return loss_fn


def value_loss_fn(cliprange: float, aggregation: str) -> LossFn:
    """A train_step loss for a critic: mrl.algo.clipped_value_loss of the model's values [b, s, 1].
    Metrics: critic/vf_loss, critic/vf_clipfrac, critic/vpred_mean."""
    from mrl.algo import clipped_value_loss
    from mrl.algo.aggregation import whole_mean

    _loss_scale(_FAIL_EARLY, aggregation)  # fail early

    def loss_fn(output: torch.Tensor, micro: dict) -> tuple[torch.Tensor, dict]:
        values, mask = output[..., 0].float(), micro["response_mask"]
        loss, metrics = clipped_value_loss(values, micro["values"], micro["returns"], mask, cliprange, aggregation,
                                           micro.get("sequence_parts"))
        return loss * _loss_scale(micro, aggregation), {
            "critic/vf_loss": loss.detach() * _metric_scale(micro, aggregation), "critic/vf_clipfrac": metrics["vf_clipfrac"],
            "critic/vpred_mean": whole_mean(values, mask, parts=micro.get("sequence_parts"))}

    return loss_fn


def sft_loss_fn() -> LossFn:
    """Masked next-token loss on response tokens: training.lm_loss over micro["loss_mask"] (the
    response mask), weighted like the RL loss so the mean is over the whole batch's tokens."""

    def loss_fn(logits: torch.Tensor, micro: dict) -> tuple[torch.Tensor, dict]:
        loss, _ = lm_loss(logits, micro)
        return loss * micro["loss_scale_tokens"], {"sft/loss": loss.detach() * _metric_scale(micro, "token-mean")}

    return loss_fn


# ---------------------------------------------------------------------------------------------
# Updates
# ---------------------------------------------------------------------------------------------


def update_actor(
    trainable: Trainable, batch: dict, algo: Any, micro_batch_size: int, max_tokens: int | None = None,
    routes: RoutePlan | None = None,
) -> dict:
    """One optimizer step of the policy loss over a rollout batch; metrics on every rank.

    Returns the loss metrics (means over micro-batches) plus actor/grad_norm, actor/lr and
    actor/skipped. Use the same micro_batch_size / max_tokens as compute_logprobs did. `routes`:
    replay the batch's MoE routes in every micro-batch (mrl.megatron.router_replay).
    """
    config = ActorLoss.of(algo)
    needed = (["advantages", "old_logprobs"] + (["ref_logprobs"] if config.kl_in_loss else [])
              + (["rollout_logprobs"] if config.uses_rollout_logprobs else []))
    missing = [key for key in needed if key not in batch]
    if missing:
        raise ValueError(f"update_actor needs batch keys {missing}"
                         + (" (kl_coef > 0 puts the KL in the loss)" if "ref_logprobs" in missing else "")
                         + (" (the engine's log-probs: algo.rollout_correction or decoupled_ppo)"
                            if "rollout_logprobs" in missing else ""))
    loss_fn = policy_loss_fn(config, trainable.built.spec.vocab_size)
    return _update(trainable, batch, loss_fn, micro_batch_size, max_tokens, prefix="actor", routes=routes)


def update_critic(trainable: Trainable, batch: dict, cliprange: float, aggregation: str, micro_batch_size: int,
                  max_tokens: int | None = None) -> dict:
    """One optimizer step of the clipped value loss over a batch with "values" (from compute_values,
    same micro-batching) and "returns"; metrics (critic/*) on every rank."""
    missing = [key for key in ("values", "returns") if key not in batch]
    if missing:
        raise ValueError(f"update_critic needs batch keys {missing}")
    return _update(trainable, batch, value_loss_fn(cliprange, aggregation), micro_batch_size, max_tokens,
                   prefix="critic")


def update_sft(trainable: Trainable, batch: dict, micro_batch_size: int, max_tokens: int | None = None) -> dict:
    """One optimizer step of sft_loss_fn over a batch of tokens + response_mask; metrics on every rank."""
    return _update(trainable, batch, sft_loss_fn(), micro_batch_size, max_tokens, prefix="sft")


def _update(trainable: Trainable, batch: dict, loss_fn: LossFn, micro_batch_size: int,
            max_tokens: int | None, prefix: str, routes: RoutePlan | None = None) -> dict:
    micro = micro_batches(batch, trainable.built.sequence_multiple, micro_batch_size, max_tokens)
    with route_pass(trainable.built, routes) as replay:
        result = train_step(trainable, micro, loss_fn, replay)
    metrics = dict(result.metrics)
    metrics[f"{prefix}/grad_norm"] = result.grad_norm
    metrics[f"{prefix}/lr"] = result.lr
    metrics[f"{prefix}/skipped"] = float(result.skipped)
    return from_last_stage(metrics)  # loss metrics exist only on the last stage: every rank returns them
