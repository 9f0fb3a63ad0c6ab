"""Build the Megatron GPTModel chunks of this rank for a ModelSpec and ParallelLayout.

Transformer Engine is an optional accelerator: `transformer_impl="auto"` picks its layer spec when
it imports and the local spec (with mrl's SDPA core attention) otherwise; "transformer_engine"
demands it and fails clearly when it is missing.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mrl.config.schema import RECOMPUTE_MODULES, Recompute
from mrl.layout import ParallelLayout
from mrl.models.registry import ModelSpec

_log = logging.getLogger(__name__)
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}
TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")


@dataclass
class BuiltModel:
    """This rank's model chunks (one per virtual pipeline stage) and what was chosen to build them."""

    chunks: list[torch.nn.Module]
    spec: ModelSpec
    layout: ParallelLayout
    padded_vocab_size: int
    use_te: bool
    value_head: bool = False  # a critic: the output layer is mrl.megatron.value_head.ValueHead
    fp8: str | None = None  # model.fp8: Transformer Engine's FP8 recipe (None: none)

    @property
    def device(self) -> torch.device:
        """Where this rank's weights live (its micro-batches go there)."""
        return next(self.chunks[0].parameters()).device

    @property
    def sequence_multiple(self) -> int:
        """What a micro-batch's sequence length is padded to: TP (sequence parallelism splits it)
        × 2·CP (context parallelism: two chunks a CP rank), and with FP8 that × 16 (× 32 for
        MXFP8), so each rank's token rows suit Transformer Engine's FP8 GEMMs, which refuse
        matrices whose dimensions are not multiples of 16 (MXFP8: 32)."""
        return self.layout.sequence_multiple * (FP8_TOKEN_MULTIPLE.get(self.fp8, 1) if self.fp8 else 1)


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def resolve_transformer_impl(impl: str) -> bool:
    """Return whether to use Transformer Engine for `impl` ("auto", "local", "transformer_engine")."""
    if impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl {impl!r} is not one of {TRANSFORMER_IMPLS}.")
    if impl == "transformer_engine" and not transformer_engine_available():
        raise RuntimeError(
            "transformer_impl='transformer_engine' but Transformer Engine is not installed. "
            "Install the GPU extra (pip install -e '.[gpu]') or set transformer_impl to 'auto' or 'local'."
        )
    use_te = impl == "transformer_engine" or (impl == "auto" and transformer_engine_available())
    if impl == "auto" and not use_te:
        _log.info("Transformer Engine not installed: using Megatron's local layer spec with torch SDPA attention.")
    return use_te


def padded_vocab_size(vocab_size: int, tp: int, divisor: int = 128) -> int:
    """Megatron-LM's padding: a multiple of divisor·TP so every TP rank holds equal rows."""
    multiple = divisor * tp
    return math.ceil(vocab_size / multiple) * multiple


def recompute_options(recompute: Recompute) -> dict[str, Any]:
    """TransformerConfig fields for `recompute`: Megatron's recompute_granularity and, for "full",
    the uniform method over blocks of recompute.num_layers layers (each block keeps its input)."""
    if recompute.granularity == "none":
        return {}
    if recompute.granularity == "selective":
        unknown = set(recompute.modules or ()) - set(RECOMPUTE_MODULES)
        if unknown:
            raise ValueError(f"model.recompute_modules {sorted(unknown)} are not among {RECOMPUTE_MODULES}")
        modules = None if recompute.modules is None else list(recompute.modules)
        return dict(recompute_granularity="selective", recompute_modules=modules)
    if recompute.granularity == "full":
        if recompute.num_layers < 1:
            raise ValueError(f"model.recompute_num_layers must be >= 1, got {recompute.num_layers}")
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=recompute.num_layers)
    raise ValueError(f"model.recompute {recompute.granularity!r} is not one of none, selective, full")


# model.fp8 → megatron-core TransformerConfig (fp8 is the format, fp8_recipe the scaling). Delayed and
# tensorwise scaling use E4M3 forward, E5M2 for gradients ("hybrid"); Transformer Engine's block
# scaling (DeepSeek-V3's 1×128/128×128 recipe) and MXFP8 take E4M3 throughout.
FP8_RECIPES: dict[str, dict[str, Any]] = {
    "delayed": dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=1024, fp8_amax_compute_algo="max"),
    "tensorwise": dict(fp8="hybrid", fp8_recipe="tensorwise"),
    "blockwise": dict(fp8="e4m3", fp8_recipe="blockwise"),
    "mxfp8": dict(fp8="e4m3", fp8_recipe="mxfp8"),
}


FP8_TOKEN_MULTIPLE = {"delayed": 16, "tensorwise": 16, "blockwise": 16, "mxfp8": 32}


def fp8_options(fp8: str | None) -> dict[str, Any]:
    """TransformerConfig fields for model.fp8 (None: none, the model trains in its dtype)."""
    if fp8 is None:
        return {}
    if fp8 not in FP8_RECIPES:
        raise ValueError(f"model.fp8 {fp8!r} is not one of {', '.join(FP8_RECIPES)} (or null)")
    return dict(FP8_RECIPES[fp8])


def check_fp8(fp8: str | None, use_te: bool, cuda: bool) -> None:
    """FP8 GEMMs are Transformer Engine's, on CUDA: refuse them on the local spec or without a GPU
    (the config check says so first; this guards a rank built another way)."""
    if fp8 is None:
        return
    if not use_te:
        raise RuntimeError(f"model.fp8 {fp8!r} needs Transformer Engine's layers, but this rank builds Megatron's "
                           "local spec (transformer_impl local, or Transformer Engine not installed): install it "
                           "(pip install -e '.[gpu]') and use transformer_impl auto, or set model.fp8: null.")
    if not cuda:
        raise RuntimeError(f"model.fp8 {fp8!r} needs a CUDA GPU (Transformer Engine's FP8 GEMMs); this rank has "
                           "none: set model.fp8: null.")


def transformer_config(spec: ModelSpec, layout: ParallelLayout, params_dtype: torch.dtype,
                       recompute: Recompute = Recompute(), fp8: str | None = None) -> Any:
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    kwargs = dict(spec.config)
    kwargs["activation_func"] = ACTIVATIONS[kwargs["activation_func"]]
    kwargs.update(
        **layout.megatron_sizes(),
        **layout.pipeline_split(),
        # Megatron requires sequence parallelism for MoE with TP; dense models gain from it too.
        sequence_parallel=layout.tp > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=True,
        **recompute_options(recompute),
        **fp8_options(fp8),
    )
    if spec.num_experts:  # every router gets a RouterReplay; idle (upstream routing) until a pass sets it
        kwargs["moe_enable_routing_replay"] = True  # mrl.megatron.router_replay
    return (MLATransformerConfig if spec.mla else TransformerConfig)(**kwargs)


def layer_specs(config: Any, use_te: bool, vp_stage: int | None) -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage)
    if not use_te:
        from megatron_patches.sdpa_attention import SDPACoreAttention

        for layer in block.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return block


def build_model(
    spec: ModelSpec,
    layout: ParallelLayout,
    *,
    params_dtype: torch.dtype = torch.float32,
    vocab_divisor: int = 128,
    transformer_impl: str = "auto",
    value_head: bool = False,
    recompute: Recompute = Recompute(),
    fp8: str | None = None,
) -> BuiltModel:
    """Build this rank's chunks; Megatron's process groups must already exist (initialize_layout).

    value_head=True builds a PPO critic: untied embeddings (Megatron would otherwise tie the first
    stage's embedding to the last stage's output weight) and a ValueHead for the output layer.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    use_te = resolve_transformer_impl(transformer_impl)
    check_fp8(fp8, use_te, torch.cuda.is_available())
    config = transformer_config(spec, layout, params_dtype, recompute, fp8)
    vocab = padded_vocab_size(spec.vocab_size, layout.tp, vocab_divisor)
    vpp = layout.virtual_stages
    chunks = []
    for stage in range(vpp or 1):
        vp_stage = stage if vpp else None
        chunks.append(
            GPTModel(
                config,
                layer_specs(config, use_te, vp_stage),
                vocab_size=vocab,
                max_sequence_length=spec.max_position_embeddings,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=spec.tie_word_embeddings and not value_head,
                vp_stage=vp_stage,
                **spec.rope,
            )
        )
    for chunk in chunks:  # Megatron's uniform method would index past a chunk's last layer
        layers = len(chunk.decoder.layers)
        if recompute.granularity == "full" and layers % recompute.num_layers:
            raise ValueError(f"model.recompute_num_layers {recompute.num_layers} does not divide the {layers} layers of "
                             "a model chunk: pick a divisor of every pipeline stage's layer count")
    if value_head:
        from mrl.megatron.value_head import ValueHead

        for chunk in chunks:
            if chunk.post_process:
                chunk.output_layer = ValueHead(config.hidden_size, config.sequence_parallel, params_dtype)
    if torch.cuda.is_available():  # initialised on the CPU (the same values in every layout), trained on the GPU
        for chunk in chunks:
            chunk.cuda(torch.cuda.current_device())
    return BuiltModel(chunks, spec, layout, vocab, use_te, value_head, fp8)
