"""How long a step takes, estimated: the rollout from a memory-bandwidth roofline, the update from
a FLOPs proxy. Arithmetic on the plan's numbers; nothing is measured or started.

Rollout, per engine (engines generate side by side, each its share of the step's sequences): the
sequences whose KV cache fits at once run together, the rest wait for the next wave; a wave is
its prompts' prefill (compute-bound) and one decode step per response token, each reading the
engine's weights once (of the routed experts only those its tokens chose) and every running
sequence's KV cache, per GPU, at the GPU's bandwidth. The update: 6 FLOPs per active parameter
and token (8 with full recomputation), 2 per forward-only pass, at a fraction of peak, stretched
by the pipeline bubble. Every assumption, and what is left out: docs/plan.md#rollout-time.
"""

from __future__ import annotations

from dataclasses import dataclass

from mrl.plan.ddp import DTYPE_BYTES
from mrl.plan.memory import EnginePlan, Plan, Run
from mrl.plan.rollout import WEIGHT_DTYPES, engine_parameters
from mrl.plan.shapes import ModelShape, PlanError

# NVIDIA's H100 Tensor Core GPU datasheet, SXM5 80 GB: 3.35 TB/s HBM3, 989 TFLOPS dense BF16 (1,979
# with 2:4 sparsity). The H200 datasheet: 4.8 TB/s HBM3e (141 GB), the same FLOPs.
H100_BANDWIDTH_GBS = 3350.0
H100_BF16_TFLOPS = 989.0
FLOPS_EFFICIENCY = 0.4  # the fraction of peak that prefill and the update reach (a planning guess)
# vLLM 0.32's max_num_seqs for the LLM class (EngineArgs defaults): 1024 on GPUs of >= 70 GiB, else 256
VLLM_MAX_SEQS = ((70 * 2**30, 1024), (0, 256))
CROWDED = 4  # warn when an engine holds fewer than 1/CROWDED of its sequences at once


@dataclass(frozen=True)
class Gpu:
    bandwidth: float  # bytes/s
    flops: float  # peak dense BF16 FLOP/s
    efficiency: float = FLOPS_EFFICIENCY


@dataclass(frozen=True)
class Lengths:
    prompt: int  # tokens
    response: int

    @property
    def total(self) -> int:
        return self.prompt + self.response


def lengths_of(max_model_len: int, max_new_tokens: int, prompt: int | None = None,
               response: int | None = None) -> Lengths:
    """The lengths to plan with; by default the longest the recipe allows: responses of
    rollout.max_new_tokens, prompts filling the rest of rollout.max_model_len."""
    response = min(max_new_tokens, max_model_len - 1) if response is None else response
    prompt = max(1, max_model_len - response) if prompt is None else prompt
    if prompt < 1 or response < 1:
        raise PlanError(f"prompt and response lengths must be >= 1 token, got {prompt} and {response}.")
    if prompt + response > max_model_len:
        raise PlanError(f"a prompt of {prompt} and a response of {response} tokens exceed rollout.max_model_len "
                        f"{max_model_len}: give shorter lengths or raise rollout.max_model_len.")
    return Lengths(prompt, response)


@dataclass(frozen=True)
class EngineLoad:
    """What one engine's decode step reads per GPU and its FLOPs per token."""

    tp: int
    weights: int  # bytes per GPU
    routed: int  # of which the routed experts' bytes
    experts: int  # routed experts per MoE layer (0: dense)
    topk: int
    kv_per_token: int  # bytes per GPU
    flops_per_token: float  # 2 per active parameter, the whole engine
    flops_per_pair: float  # attention FLOPs per (query, earlier key) pair in prefill, the whole engine


def active_parameters(shape: ModelShape) -> float:
    """Parameters one token runs through: all but the routed experts, and top-k of those (MLA's
    second copy of its kv up-projection is not counted twice)."""
    whole = engine_parameters(shape, 1)
    routed = whole.routed * (1 - shape.moe.topk / shape.moe.experts) if shape.moe else 0
    return whole.linear + whole.other - routed


def attention_flops_per_pair(shape: ModelShape) -> float:
    """q·k and the weighted sum of v, 2 FLOPs a multiply-add, over every layer and head. MLA's
    prefill runs on the decompressed heads (qk_nope + qk_rope wide keys, v_dim wide values)."""
    if shape.mla:
        m = shape.mla
        width = m.qk_nope + m.qk_rope + m.v_dim
    else:
        width = 2 * shape.head_dim
    return 2.0 * shape.layers * shape.heads * width


def engine_load(shape: ModelShape, engine: EnginePlan, dtype: str, quantization: str | None) -> EngineLoad:
    per_gpu = engine_parameters(shape, engine.tp)
    linear = 1 if quantization == "fp8" else DTYPE_BYTES[WEIGHT_DTYPES[dtype]]
    moe = shape.moe
    return EngineLoad(engine.tp, engine.weights, per_gpu.routed * linear, moe.experts if moe else 0,
                      moe.topk if moe else 0, engine.kv_per_token, 2.0 * active_parameters(shape),
                      attention_flops_per_pair(shape))


def touched_fraction(batch: int, experts: int, topk: int) -> float:
    """The expected share of a layer's routed experts that `batch` tokens choose, each picking topk
    of `experts` uniformly and independently (balanced routing; DeepSeek-V3's group-limited routing
    would touch fewer). 1 for a dense model."""
    if not experts:
        return 1.0
    return 1.0 - (1.0 - topk / experts) ** batch


def decode_seconds(load: EngineLoad, batch: int, lengths: Lengths, gpu: Gpu) -> float:
    """One wave of `batch` sequences generating lengths.response tokens each: per step, the weights
    read (dense ones whole, the routed experts' touched share) and each sequence's KV cache of its
    context so far (prompt + t at step t), per GPU at the GPU's bandwidth; or, when larger, the
    step's matmuls at the FLOPs the engine's GPUs reach (large batches of small models)."""
    steps, p = lengths.response, lengths.prompt
    weights = load.weights - load.routed + load.routed * touched_fraction(batch, load.experts, load.topk)
    context = steps * p + steps * (steps - 1) / 2  # sum over steps of prompt + t
    memory = (steps * weights + batch * load.kv_per_token * context) / gpu.bandwidth
    compute = steps * batch * load.flops_per_token / (load.tp * gpu.flops * gpu.efficiency)
    return max(memory, compute)


def prefill_seconds(load: EngineLoad, prompt: int, gpu: Gpu) -> float:
    """One prompt's prefill on its engine: the matmuls of every token and the causal attention's
    prompt·(prompt+1)/2 pairs, at the FLOPs the engine's GPUs reach. Every sample's prompt is
    counted (vLLM's prefix cache would share a prompt between its samples: an overestimate)."""
    flops = prompt * load.flops_per_token + prompt * (prompt + 1) / 2 * load.flops_per_pair
    return flops / (load.tp * gpu.flops * gpu.efficiency)


def max_num_seqs(gpu_bytes: int) -> int:
    return next(seqs for memory, seqs in VLLM_MAX_SEQS if gpu_bytes >= memory)


@dataclass(frozen=True)
class RolloutTime:
    sequences: int  # per engine
    concurrency: int  # at once per engine
    waves: int
    prefill_s: float
    decode_s: float

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def crowded(self) -> bool:
        return self.concurrency * CROWDED < self.sequences


def rollout_time(load: EngineLoad, sequences: int, concurrency: int, lengths: Lengths, gpu: Gpu) -> RolloutTime | None:
    """Full waves of `concurrency` sequences, then one of the rest (None: not one fits)."""
    if concurrency < 1:
        return None
    concurrency = min(concurrency, sequences)
    waves = -(-sequences // concurrency)
    last = sequences - (waves - 1) * concurrency
    decode = (waves - 1) * decode_seconds(load, concurrency, lengths, gpu) + decode_seconds(load, last, lengths, gpu)
    return RolloutTime(sequences, concurrency, waves, sequences * prefill_seconds(load, lengths.prompt, gpu), decode)


def engine_rollout(shape: ModelShape, engine: EnginePlan, dtype: str, quantization: str | None, engines: int,
                   lengths: Lengths, gpu: Gpu, gpu_bytes: int) -> RolloutTime | None:
    """The step's rollout on `engines` engines like `engine`, each its share of engine.sequences;
    at once as many as their KV cache holds at the planned length, at most vLLM's max_num_seqs."""
    load = engine_load(shape, engine, dtype, quantization)
    concurrency = min(engine.concurrency(lengths.total), max_num_seqs(gpu_bytes))
    return rollout_time(load, -(-engine.sequences // engines), concurrency, lengths, gpu)


def pipeline_bubble(pp: int, micro_batches: int) -> float:
    """The idle share of a 1F1B step (Narayanan et al. 2021): (PP-1)/(M+PP-1)."""
    return (pp - 1) / (micro_batches + pp - 1)


def update_seconds(shape: ModelShape, run: Run, lengths: Lengths, gpu: Gpu) -> float:
    """The step's training side, a proxy: the old log-probs' forward (and the KL reference's, and
    a critic's values), then each epoch's forward and backward (6 FLOPs per active parameter and
    token, 8 with full recomputation), over the actor's GPUs at the FLOPs fraction, divided by
    1 - the pipeline bubble. Communication (TP, EP's all-to-all, DP's reduce) is not counted."""
    update = 8 if run.recompute.granularity == "full" else 6
    per_token = 2 + 2 * run.reference + run.ppo_epochs * update
    if run.critic:
        per_token += 2 + run.critic_epochs * update
    flops = per_token * active_parameters(shape) * run.sequences * lengths.total
    busy = 1 - pipeline_bubble(run.layout.pp, run.micro_batches)
    return flops / (run.world * gpu.flops * gpu.efficiency) / busy


@dataclass(frozen=True)
class StepTime:
    rollout: RolloutTime | None  # None: the engine holds no sequence
    update_s: float

    @property
    def seconds(self) -> float:
        return (self.rollout.seconds if self.rollout else float("inf")) + self.update_s


def step_time(plan: Plan, lengths: Lengths, gpu: Gpu) -> StepTime:
    """The rollout and the update one after the other (a sync step; the async modes overlap them)."""
    run = plan.run
    return StepTime(engine_rollout(plan.shape, plan.engine, run.engine_dtype, run.quantization, run.engines, lengths,
                                   gpu, plan.gpu_bytes),
                    update_seconds(plan.shape, run, lengths, gpu))
