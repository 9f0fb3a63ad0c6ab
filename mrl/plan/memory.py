"""A run's memory per GPU: every pipeline stage of the actor (and critic), and the rollout engine,
in the two phases a colocated GPU goes through, with a verdict against the GPU's memory.

Phases: "train" — the actor's update (its weights, gradient buffers and optimizer state, the
critic's and the KL reference's if the run has them, and the update's activations; a colocated
engine sleeps, level 1, holding neither weights nor KV cache); "generate" — a colocated engine
awake on the same GPU with its whole gpu_memory_utilization budget while the actor (and critic)
keep their state — or, with trainer.offload_actor_during_rollout, only the actor's weights, which
the weight push reads after the engine woke and which leave the GPU after it (gradients, optimizer
state, the KL reference and a critic leave before; mrl/launch/cluster.py). Not counted: the CUDA context, NCCL buffers and
allocator fragmentation (give --gpu-memory-gb what is left for tensors), vLLM's profiled
activations and CUDA graphs (they come out of its budget, shrinking the KV cache), the backward
pass's transient gradient tensors, the weight sync's buckets (one bucket plus the largest tensor
on a sending rank; about two buckets on the leader's GPU with CUDA IPC, docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from mrl.config.derived import epochs_of, layout_of, recompute_of
from mrl.config.schema import Recompute, RunConfig
from mrl.layout import LayoutError, ModelDims, ParallelLayout
from mrl.plan.activations import F32, MicroBatch, stage_activations
from mrl.plan.ddp import DTYPE_BYTES, StaticBytes, rank_static
from mrl.plan.params import chunk_params, padded_vocab
from mrl.plan.rollout import WEIGHT_DTYPES, engine_weight_bytes, kv_bytes_per_token
from mrl.plan.shapes import ModelShape, PlanError, stage_chunks

@dataclass(frozen=True)
class Run:
    """What the plan reads from a RunConfig, resolved for a cluster of `gpus` GPUs."""

    layout: ParallelLayout
    world: int  # actor ranks
    gpus: int
    dtype: str  # model dtype: "bf16", "fp16" or "fp32"
    distributed_optimizer: bool
    micro: MicroBatch
    micro_batches: int  # per DP rank and optimizer step
    critic: bool
    reference: bool  # a frozen copy of the initial weights for the KL term
    colocated: bool
    engine_tp: int
    engine_dtype: str
    quantization: str | None
    gpu_memory_utilization: float
    max_model_len: int
    sequences: int  # per step, over all engines
    transformer_impl: str  # the model's layer spec ("auto" takes Transformer Engine where installed)
    # What makes the update refuse the recipe's batch: rows that do not split over DP (depends on
    # the layout), a token budget below the longest sequence (does not).
    split_problems: tuple[str, ...] = ()
    budget_problems: tuple[str, ...] = ()
    optimizer_on_gpu: float = 1.0  # 1 - optim.offload_fraction: the rest is in host memory
    recompute: Recompute = Recompute()
    offload_actor: bool = False  # trainer.offload_actor_during_rollout
    engines: int = 1  # rollout.num_engines, each engine_tp GPUs (a GPU is in one engine at most)
    max_new_tokens: int = 1024  # rollout.max_new_tokens: the longest response (mrl.plan.timing)
    ppo_epochs: int = 1  # the update's passes over the batch (trainer.ppo_epochs)
    critic_epochs: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel ranks that split the batch (CP ranks share their sequences)."""
        return self.layout.data_parallel_size(self.world)

    @property
    def expert_dp(self) -> int:
        return self.world // (self.layout.expert_tp * self.layout.ep * self.layout.pp)

    @classmethod
    def of(cls, cfg: RunConfig, shape: ModelShape, gpus: int | None = None) -> "Run":
        launch, p = cfg.launch, cfg.parallel
        gpus = gpus or launch.num_nodes * launch.gpus_per_node
        if gpus < 1:
            raise PlanError("the recipe is a CPU run (launch.gpus_per_node 0): give the cluster's size with --gpus N.")
        layout = layout_of(cfg)
        separate = launch.placement == "separate"
        world = p.world_size or gpus - (launch.rollout_gpus if separate else 0)
        try:
            layout.validate(shape_dims(shape), world)
        except LayoutError as exc:
            # ParallelLayout names command-line flags (--tp); a recipe's keys are parallel.tp.
            raise PlanError(f"layout {layout.describe()} on {world} actor GPUs: "
                            + str(exc).replace("--", "parallel.")) from None
        r = cfg.rollout
        sequences = cfg.data.batch_size * r.n_samples_per_prompt
        dp = layout.data_parallel_size(world)
        split = () if sequences % dp == 0 else (
            f"data.batch_size × rollout.n_samples_per_prompt = {sequences} sequences do not split over DP {dp}: "
            "the update refuses the batch.",)
        micro, count, budget = _micro_batching(cfg, layout.sequence_multiple, sequences // dp or 1)
        return cls(
            layout=layout, world=world, gpus=gpus, dtype=WEIGHT_DTYPES[cfg.model.dtype],
            # None means "on with CUDA" (mrl.megatron.training.make_trainable): a GPU plan has CUDA.
            distributed_optimizer=cfg.optim.use_distributed_optimizer is not False,
            micro=micro, micro_batches=count, critic=cfg.algo.advantage_estimator == "gae",
            reference=cfg.algo.kl_coef > 0, colocated=not separate, engine_tp=r.tensor_parallel_size,
            engine_dtype=r.dtype, quantization=r.quantization,
            gpu_memory_utilization=r.gpu_memory_utilization, max_model_len=r.max_model_len, sequences=sequences,
            transformer_impl=cfg.model.transformer_impl, split_problems=split, budget_problems=tuple(budget),
            optimizer_on_gpu=1.0 - cfg.optim.offload_fraction, recompute=recompute_of(cfg),
            offload_actor=cfg.trainer.offload_actor_during_rollout and not separate, engines=r.num_engines,
            max_new_tokens=r.max_new_tokens, ppo_epochs=epochs_of(cfg, "actor"), critic_epochs=epochs_of(cfg, "critic"),
        )

    @property
    def problems(self) -> tuple[str, ...]:
        return self.split_problems + self.budget_problems


def shape_dims(shape: ModelShape) -> ModelDims:
    moe = shape.moe
    return ModelDims(shape.layers, shape.heads, shape.groups, shape.ffn,
                     moe.experts if moe else None, moe.ffn if moe else None)


def _micro_batching(cfg: RunConfig, multiple: int, rows: int) -> tuple[MicroBatch, int, list[str]]:
    """The update's largest micro-batch (mrl.megatron.policy.micro_batches): sequences as long as
    rollout.max_model_len allows, padded to a multiple of TP·2CP (ParallelLayout.sequence_multiple);
    b sequences by the token budget or optim.micro_batch_size; and the micro-batch count per DP rank.
    The budget counts the whole sequence's tokens (each CP rank holds 1/CP of them)."""
    seq = -(-(cfg.rollout.max_model_len - 1) // multiple) * multiple
    budget, problems = cfg.optim.max_tokens_per_micro_batch, []
    if budget is None:
        size = min(cfg.optim.micro_batch_size, rows)
    elif budget < seq:
        problems.append(f"optim.max_tokens_per_micro_batch {budget} is below one sequence of up to {seq} tokens "
                        f"(rollout.max_model_len {cfg.rollout.max_model_len}): the update raises on such a batch. "
                        f"Planned with one sequence per micro-batch.")
        size = 1
    else:
        size = min(budget // seq, rows)
    return MicroBatch(seq, size), -(-rows // size), problems


@dataclass
class StagePlan:
    """One pipeline stage's GPUs (every rank of a stage holds equal shapes), in bytes per GPU."""

    stage: int
    layers: list[int]  # global layer indices, 0-based
    ranks: int
    in_flight: int  # micro-batches whose activations the stage holds at its peak
    state: dict[str, int]  # held through both phases: weights, gradient buffers, optimizer state
    update: dict[str, int]  # the update's activations and working set
    engine: int  # a colocated engine's budget while it generates (0: none)
    host: int = 0  # host memory per GPU's rank: offloaded optimizer state, the actor's offloaded copies
    # state items that stay on the GPU while the engine is awake (None: all of them)
    kept_while_generating: tuple[str, ...] | None = None

    @property
    def train_bytes(self) -> int:
        return sum(self.state.values()) + sum(self.update.values())

    @property
    def generating_state(self) -> int:
        """The state on the GPU beside the awake engine (with the actor offload: its weights, which
        the weight push reads before they leave)."""
        kept = self.state if self.kept_while_generating is None else {
            k: v for k, v in self.state.items() if k in self.kept_while_generating}
        return sum(kept.values())

    @property
    def generate_bytes(self) -> int:
        return (self.generating_state + self.engine) if self.engine else 0

    @property
    def peak(self) -> int:
        return max(self.train_bytes, self.generate_bytes)


@dataclass
class EnginePlan:
    tp: int
    weights: int
    kv_per_token: int
    budget: int  # gpu_memory_utilization × GPU
    max_model_len: int
    sequences: int

    @property
    def kv_space(self) -> int:
        return self.budget - self.weights

    @property
    def concurrent_sequences(self) -> int:
        """Full-length sequences whose KV cache fits at once (an upper bound: vLLM's activations
        and CUDA graphs come out of the same budget)."""
        return self.concurrency(self.max_model_len)

    def concurrency(self, tokens: int) -> int:
        """Sequences of `tokens` tokens whose KV cache fits at once."""
        return max(0, self.kv_space // (self.kv_per_token * tokens))

    @property
    def fits(self) -> bool:
        return self.concurrent_sequences >= 1  # vLLM refuses to start without room for one


@dataclass
class Plan:
    run: Run
    shape: ModelShape
    gpu_bytes: int
    stages: list[StagePlan]
    engine: EnginePlan

    @property
    def fits(self) -> bool:
        return self.engine.fits and all(s.peak <= self.gpu_bytes for s in self.stages)

    @property
    def margin(self) -> int:
        """The tightest GPU's free bytes (negative: the shortfall)."""
        return min(self.gpu_bytes - s.peak for s in self.stages)


def engine_plan(shape: ModelShape, cfg: RunConfig, tp: int, gpu_bytes: int) -> EnginePlan:
    """The rollout engine of `cfg` at tensor-parallel size `tp` (rollout.quantization fp8: FP8 weights)."""
    r = cfg.rollout
    return _engine(shape, tp, r.dtype, r.quantization, r.gpu_memory_utilization, r.max_model_len,
                   cfg.data.batch_size * r.n_samples_per_prompt, gpu_bytes)


def _engine(shape: ModelShape, tp: int, dtype: str, quantization: str | None, utilization: float,
            max_model_len: int, sequences: int, gpu_bytes: int) -> EnginePlan:
    return EnginePlan(tp, engine_weight_bytes(shape, tp, dtype, quantization), kv_bytes_per_token(shape, tp, dtype),
                      int(utilization * gpu_bytes), max_model_len, sequences)


def plan(shape: ModelShape, run: Run, gpu_bytes: int) -> Plan:
    engine = _engine(shape, run.engine_tp, run.engine_dtype, run.quantization, run.gpu_memory_utilization,
                     run.max_model_len, run.sequences, gpu_bytes)
    stages = [_stage(shape, run, stage, engine) for stage in range(run.layout.pp)]
    return Plan(run, shape, gpu_bytes, stages, engine)


def _stage(shape: ModelShape, run: Run, stage: int, engine: EnginePlan) -> StagePlan:
    layout, e = run.layout, DTYPE_BYTES[run.dtype]
    chunks = stage_chunks(shape.layers, layout, stage)

    def static(value_head: bool) -> StaticBytes:
        return rank_static(shape, layout, run.world, stage, run.dtype, run.distributed_optimizer,
                           value_head=value_head, optimizer_on_gpu=run.optimizer_on_gpu)

    def activations(value_head: bool):
        return stage_activations(shape, layout, chunks, run.micro, e, run.micro_batches, "flash", value_head,
                                 run.recompute)

    actor, acts = static(False), activations(False)
    state = {"actor weights": actor.weights, "actor grads": actor.grads, "actor optimizer": actor.optimizer}
    update = {"activations": acts.total}
    host = actor.host
    if run.critic:
        critic = static(True)
        host += critic.host
        state |= {"critic weights": critic.weights, "critic grads": critic.grads, "critic optimizer": critic.optimizer}
        update["activations"] = max(acts.total, activations(True).total)  # the critic updates apart
    if run.reference:
        state["KL reference"] = sum(p.numel * DTYPE_BYTES[p.dtype] for c in chunks
                                    for p in chunk_params(shape, layout, c, run.dtype))
    if chunks[-1].head:
        update["loss working set"] = _loss_working_set(shape, run)
    layers = [layer for c in chunks for layer in c.layers]
    kept = None
    if run.offload_actor:  # every other state item gets a host copy (pinned, kept between steps)
        kept = ("actor weights",)
        host += sum(v for k, v in state.items() if k not in kept) + state["actor weights"]
    return StagePlan(stage, layers, run.world // layout.pp, acts.in_flight, state, update,
                     engine.budget if run.colocated else 0, host, kept)


def _loss_working_set(shape: ModelShape, run: Run) -> int:
    """The last stage's transient while the policy loss runs (mrl.megatron.policy.policy_loss_fn),
    read off the code, not measured: the logits [b, s/CP, V/TP] in the model dtype and, for the
    reported entropy (computed without gradient, vocab_parallel_entropy), an fp32 copy, its
    shifted values, exp() of those and their product alive together, plus the masked copy on the
    TP rank that holds padded vocabulary rows. The cross-entropy's fp32 softmax is a saved activation."""
    padded = padded_vocab(shape.vocab, run.layout.tp)
    per_element = DTYPE_BYTES[run.dtype] + 4 * F32 + (F32 if padded > shape.vocab else 0)
    return run.micro.seq // run.layout.cp * run.micro.size * padded // run.layout.tp * per_element
