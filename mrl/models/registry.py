"""Translate a HuggingFace config.json into the Megatron TransformerConfig and GPTModel arguments.

One function per architecture, each listing only what differs from the Llama-style base. No
megatron import here: the result is plain data (kwargs), so configs validate before any worker
starts and the same description drives model building, weight mapping and layout checks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from mrl.layout import ModelDims

if TYPE_CHECKING:
    from mrl.routes import RouteShape


def moe_layer_pattern(freq: int | list[int], layers: int) -> list[int]:
    """1 for each MoE layer, 0 for a dense one, from Megatron's moe_layer_freq (every freq-th layer,
    or a list of 0/1 a layer) as its block spec reads it."""
    return [1 if i % freq == 0 else 0 for i in range(layers)] if isinstance(freq, int) else list(freq)


class UnsupportedModelError(ValueError):
    """A config.json this registry cannot translate; the message names the field and the fix."""


@dataclass
class ModelSpec:
    """Everything needed to build a Megatron GPTModel equivalent to an HF checkpoint.

    arch: short name ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3").
    config: TransformerConfig (or MLATransformerConfig when mla) keyword arguments.
    vocab_size: the HF vocabulary size (Megatron pads it per layout; exports strip the padding).
    """

    arch: str
    hf_config: dict[str, Any]
    config: dict[str, Any]
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    mla: bool = False
    rope: dict[str, Any] = field(default_factory=dict)  # GPTModel rotary arguments

    @property
    def num_experts(self) -> int | None:
        return self.config.get("num_moe_experts")

    @property
    def route_shape(self) -> RouteShape | None:
        """What a sample's MoE routes hold per token (mrl.routes): MoE layers (moe_layer_freq, as
        Megatron's block spec reads it), top-k, experts; None for a dense model."""
        from mrl.routes import RouteShape  # here: mrl.routes imports torch, which `mrl <command> --help` must not

        if not self.num_experts:
            return None
        pattern = moe_layer_pattern(self.config.get("moe_layer_freq", 1), self.config["num_layers"])
        return RouteShape(sum(pattern), self.config["moe_router_topk"], self.num_experts)

    @property
    def dims(self) -> ModelDims:
        c = self.config
        return ModelDims(
            num_layers=c["num_layers"],
            num_attention_heads=c["num_attention_heads"],
            num_query_groups=c.get("num_query_groups") or c["num_attention_heads"],
            ffn_hidden_size=c["ffn_hidden_size"],
            num_experts=c.get("num_moe_experts"),
            moe_ffn_hidden_size=c.get("moe_ffn_hidden_size"),
        )


def _base(hf: dict) -> dict[str, Any]:
    """Llama-style decoder: RMSNorm, SwiGLU, RoPE, no linear biases."""
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise UnsupportedModelError(
                f"{flag}=true is not supported (it adds biases Megatron's layers here do not have); "
                "use a checkpoint without it."
            )
    _refuse_other_attention_and_activation(hf)
    heads = hf["num_attention_heads"]
    return dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden_size=hf["intermediate_size"],
        normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func="silu",
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Fusions are CUDA kernels; the plain paths are numerically the reference anyway.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def _refuse_other_attention_and_activation(hf: dict) -> None:
    """Settings transformers honours that the Megatron layers built here would silently ignore."""
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(
            f"hidden_act={hf['hidden_act']!r} is not supported: the MLPs here are SwiGLU (silu); "
            "use a checkpoint with hidden_act='silu'."
        )
    sliding = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
    # transformers drops the window when sliding_window is null (4096 when left out).
    if (hf.get("use_sliding_window") and hf.get("sliding_window", 4096) is not None) or sliding:
        raise UnsupportedModelError(
            "sliding-window attention (use_sliding_window=true or sliding layer_types) is not supported: "
            "Megatron attends over the full context here. Set use_sliding_window=false if the model was "
            "trained without it."
        )


def _rope(hf: dict) -> dict[str, Any]:
    """GPTModel rotary arguments; Llama-3 scaling is the only scaling Megatron's RoPE implements."""
    rope = dict(position_embedding_type="rope", rotary_base=_rope_theta(hf))
    scaling = _rope_scaling(hf)
    partial = (scaling or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UnsupportedModelError(
            f"partial_rotary_factor={partial} is not supported: RoPE here rotates the whole head; "
            "use a checkpoint without it."
        )
    if scaling is None:
        return rope
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return rope
    # Megatron hard-codes the Llama-3.1 constants; any other values would silently change the model.
    llama3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if kind != "llama3" or any(scaling.get(k, v) != v for k, v in llama3.items()):
        raise UnsupportedModelError(
            f"rope_scaling {scaling} is not supported: Megatron RoPE implements only Llama-3 scaling "
            f"with {llama3}. Remove rope_scaling or use a checkpoint with those values."
        )
    return rope | dict(rope_scaling=True, rope_scaling_factor=float(scaling["factor"]))


def _rope_theta(hf: dict) -> float:
    return float(hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def _rope_scaling(hf: dict) -> dict | None:
    # transformers 5 folds rope_theta into rope_parameters; older configs use rope_scaling.
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    return dict(scaling) if scaling else None


def llama(hf: dict) -> dict[str, Any]:
    return _base(hf)


def qwen2(hf: dict) -> dict[str, Any]:
    # Qwen2 always has q/k/v biases (config.json does not say so).
    return _base(hf) | dict(add_qkv_bias=True)


def qwen3(hf: dict) -> dict[str, Any]:
    # Qwen3Config defaults head_dim to 128, not hidden_size // heads (Qwen3-MoE derives it).
    return _base(hf | {"head_dim": hf.get("head_dim") or 128}) | dict(qk_layernorm=True)


def _moe_common(hf: dict, experts: int, topk: int) -> dict[str, Any]:
    return dict(
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        # HF routers compute in fp32; so must we, or routing flips between frameworks.
        moe_router_dtype="fp32",
    )


def qwen3_moe(hf: dict) -> dict[str, Any]:
    layers = hf["num_hidden_layers"]
    dense_layers = set(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step", 1)
    pattern = [0 if (i in dense_layers or (i + 1) % step) else 1 for i in range(layers)]
    return (
        _base(hf)
        | dict(qk_layernorm=True)
        # Hub configs say num_experts; transformers 5 writes num_local_experts.
        | _moe_common(hf, hf.get("num_experts") or hf["num_local_experts"], hf["num_experts_per_tok"])
        # softmax over the top-k logits == softmax over all then renormalised (norm_topk_prob).
        | dict(moe_router_pre_softmax=not hf.get("norm_topk_prob", False), moe_layer_freq=pattern)
    )


# transformers' DeepseekV3Config defaults for the fields read below with a default: a config.json
# that leaves one out means this value to transformers and vLLM (which reads the same config class).
DEEPSEEK_V3_DEFAULTS: dict[str, Any] = dict(
    n_group=8, topk_group=4, routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=3,
    q_lora_rank=1536, norm_topk_prob=True, rope_interleave=True,
)


def deepseek_v3(hf: dict) -> dict[str, Any]:
    hf = DEEPSEEK_V3_DEFAULTS | hf
    _refuse_other_deepseek_v3_routing(hf)
    if not hf["rope_interleave"]:
        raise UnsupportedModelError(
            "DeepSeek-V3 with rope_interleave=false is not supported: Megatron's MLA expects the "
            "interleaved rotary layout of the released checkpoints."
        )
    layers = hf["num_hidden_layers"]
    first_dense = hf["first_k_dense_replace"]
    config = _base(hf) | _moe_common(hf, hf["n_routed_experts"], hf["num_experts_per_tok"])
    config.pop("add_qkv_bias")
    config |= dict(
        num_query_groups=hf["num_attention_heads"],
        kv_channels=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
        multi_latent_attention=True,
        qk_layernorm=True,  # the local spec builds q_a/kv_a layernorms only with this flag
        q_lora_rank=hf["q_lora_rank"],
        kv_lora_rank=hf["kv_lora_rank"],
        qk_head_dim=hf["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        rotary_base=_rope_theta(hf),
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=hf["routed_scaling_factor"],
        # Groups are ranked by their top-2 experts, as in HF: megatron_patches/group_routing_top2.py.
        moe_router_num_groups=hf["n_group"],
        moe_router_group_topk=hf["topk_group"],
        moe_shared_expert_intermediate_size=hf["moe_intermediate_size"] * hf["n_shared_experts"] or None,
        moe_layer_freq=[0] * first_dense + [1] * (layers - first_dense),
    )
    return config | _mla_rope(hf)


def _refuse_other_deepseek_v3_routing(hf: dict) -> None:
    """Routing settings whose HF meaning Megatron's sigmoid router (or vLLM) would not reproduce."""
    for key, value, why in (
        ("scoring_func", "sigmoid", "transformers always uses sigmoid, vLLM defaults to softmax"),
        ("topk_method", "noaux_tc", "transformers always adds e_score_correction_bias, vLLM only then"),
    ):
        if hf.get(key) != value:
            raise UnsupportedModelError(
                f"DeepSeek-V3 {key}={hf.get(key)!r} is not supported ({why}); "
                f"use a checkpoint whose config.json says {key}={value!r}."
            )
    topk = hf["num_experts_per_tok"]
    if not hf["norm_topk_prob"] or topk == 1:
        raise UnsupportedModelError(
            f"DeepSeek-V3 with norm_topk_prob={str(hf['norm_topk_prob']).lower()} and num_experts_per_tok="
            f"{topk} is not supported: Megatron's sigmoid router normalises the top-k weights exactly "
            "when topk > 1. Use a checkpoint with norm_topk_prob=true and num_experts_per_tok > 1."
        )
    experts, groups, top_groups = hf["n_routed_experts"], hf["n_group"], hf["topk_group"]
    fields = (
        f"n_routed_experts={experts}, n_group={groups}, topk_group={top_groups}, num_experts_per_tok={topk}"
    )
    if not groups or not top_groups or experts % groups or experts // groups < 2:
        raise UnsupportedModelError(
            f"DeepSeek-V3 group-limited routing with {fields} is not supported: n_group must divide "
            "n_routed_experts into groups of at least 2 experts (a group is scored by its top 2)."
        )
    if top_groups > groups or topk > top_groups * (experts // groups):
        raise UnsupportedModelError(
            f"DeepSeek-V3 routing with {fields} is inconsistent: topk_group must be at most n_group and "
            "num_experts_per_tok at most topk_group × (n_routed_experts / n_group)."
        )


def _mla_rope(hf: dict) -> dict[str, Any]:
    """MLA rotary settings: plain RoPE, or YaRN with HF's attention factor (mscale) rule."""
    scaling = _rope_scaling(hf) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        # MLA computes its softmax scale from these even without YaRN; factor 1 makes it 1/sqrt(d).
        return dict(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    if kind != "yarn":
        raise UnsupportedModelError(f"DeepSeek-V3 rope_scaling {scaling}: only YaRN is supported.")
    _refuse_other_yarn(scaling)
    return dict(
        rope_type="yarn",
        rotary_scaling_factor=float(scaling["factor"]),
        original_max_position_embeddings=scaling.get(
            "original_max_position_embeddings", hf.get("max_position_embeddings", 4096)
        ),
        # transformers: `get("beta_fast") or 32`, so an explicit 0 or null also means the default.
        beta_fast=float(scaling.get("beta_fast") or 32),
        beta_slow=float(scaling.get("beta_slow") or 1),
        mscale=float(scaling.get("mscale", 1.0)),
        mscale_all_dim=float(scaling.get("mscale_all_dim", 0.0)),
    )


def _refuse_other_yarn(scaling: dict) -> None:
    """YaRN settings Megatron's YarnRotaryEmbedding would compute differently from transformers.

    transformers scales cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim) only when
    both are non-zero, else by mscale(factor, 1); Megatron always uses the ratio (mscale defaulting
    to 1, mscale_all_dim to 0). They agree when both are set, or when mscale_all_dim is unset or 0
    and mscale is unset or 1.
    """
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    problems = []
    if scaling.get("factor") is None:
        problems.append("it has no factor")
    if scaling.get("attention_factor") is not None:
        problems.append("attention_factor is set (Megatron derives it from mscale)")
    if not scaling.get("truncate", True):
        problems.append("truncate=false (Megatron always rounds the correction range)")
    if not (mscale and mscale_all_dim) and (mscale_all_dim or mscale not in (None, 1, 1.0)):
        problems.append(f"mscale={mscale} with mscale_all_dim={mscale_all_dim} (set both, or neither)")
    if problems:
        raise UnsupportedModelError(f"DeepSeek-V3 YaRN rope_scaling {scaling} is not supported: {'; '.join(problems)}.")


# HF `architectures[0]` → (short name, translator). Adding a model means adding one row here and
# its mapping table in mrl/bridge/mapping.py.
ARCHITECTURES: dict[str, tuple[str, Callable[[dict], dict[str, Any]]]] = {
    "LlamaForCausalLM": ("llama", llama),
    "Qwen2ForCausalLM": ("qwen2", qwen2),
    "Qwen3ForCausalLM": ("qwen3", qwen3),
    "Qwen3MoeForCausalLM": ("qwen3_moe", qwen3_moe),
    "DeepseekV3ForCausalLM": ("deepseek_v3", deepseek_v3),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def model_spec_from_hf(hf: dict[str, Any] | str | Path) -> ModelSpec:
    """Build the ModelSpec for an HF config (a dict, a config.json path or a model directory)."""
    if not isinstance(hf, dict):
        path = Path(hf)
        path = path / "config.json" if path.is_dir() else path
        if not path.exists():
            raise UnsupportedModelError(f"{path} not found: pass an HF model directory containing config.json.")
        hf = json.loads(path.read_text())
    names = hf.get("architectures") or []
    if not names or names[0] not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {names[0] if names else '(none in config.json)'} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    arch, translate = ARCHITECTURES[names[0]]
    try:
        config = translate(hf)
    except KeyError as missing:
        raise UnsupportedModelError(f"config.json for {names[0]} lacks field {missing}.") from None
    mla = bool(config.get("multi_latent_attention"))
    return ModelSpec(
        arch=arch,
        hf_config=hf,
        config=config,
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        mla=mla,
        rope=dict(position_embedding_type="rope") if mla else _rope(hf),
    )
