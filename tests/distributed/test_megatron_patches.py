"""Each patch in megatron_patches is needed: without it, the scenario it exists for fails upstream.

The parity suite (test_bridge_parity.py) shows the patches are sufficient: every architecture and
layout runs with all of them. Here each scenario runs with exactly one patch left out (through
MRL_SKIP_PATCHES, read by the workers' megatron_patches.apply()) and must fail with the upstream
error the patch's docstring describes, raised from the upstream file it names.
"""

from __future__ import annotations

import pytest

from mrl.layout import ParallelLayout
from mrl.megatron.local_launch import WorkerError, run_local


def _build_and_forward(rank: int, world_size: int, hf_dir: str, layout: ParallelLayout) -> bool:
    from mrl.bridge.hf_import import load_hf_weights
    from mrl.megatron.forward import forward_logits
    from mrl.megatron.model import build_model
    from mrl.megatron.parallel import initialize_layout
    from mrl.models.registry import model_spec_from_hf
    from mrl.verify import probe_tokens

    coords = initialize_layout(layout)
    spec = model_spec_from_hf(hf_dir)
    built = build_model(spec, layout)
    load_hf_weights(built, coords, hf_dir)
    forward_logits(built, probe_tokens(spec.vocab_size))
    return True


# patch → (architecture, layout, upstream error text, upstream file it comes from)
SCENARIOS = {
    "cpu_rng_tracker": ("llama", ParallelLayout(), "Torch not compiled with CUDA enabled", "tensor_parallel/random.py"),
    "cuda_calls_on_cpu": ("llama", ParallelLayout(), "Torch not compiled with CUDA enabled", "pipeline_parallel/schedules.py"),
    "tensor_cuda_method": ("llama", ParallelLayout(pp=2), "Torch not compiled with CUDA enabled", "weight.data.cuda()"),
    "torch_norm_sequence_parallel": ("llama", ParallelLayout(tp=2), "sequence parallel not supported by torch LayerNorm", "torch_norm.py"),
    "te_general_gemm_undefined": ("qwen3_moe", ParallelLayout(), "name 'te_general_gemm' is not defined", "moe_utils.py"),
    "all_to_all_split_sizes": ("qwen3_moe", ParallelLayout(ep=2), "incompatible function arguments", "mappings.py"),
    "uneven_sequence_collectives": ("qwen3_moe", ParallelLayout(ep=2, tp=2), "invalid tensor size", "mappings.py"),
    "te_placeholders": ("deepseek_v3", ParallelLayout(), "isinstance() arg 2 must be a type", "multi_latent_attention.py"),
}


@pytest.mark.parametrize("patch", list(SCENARIOS))
def test_patch_is_needed(patch, tiny_model_dir, monkeypatch):
    arch, layout, error, where = SCENARIOS[patch]
    monkeypatch.setenv("MRL_SKIP_PATCHES", patch)
    with pytest.raises(WorkerError) as failure:
        run_local(_build_and_forward, layout.min_world_size(), str(tiny_model_dir(arch)), layout, timeout_s=120)
    assert error in str(failure.value) and where in str(failure.value), str(failure.value)[-2000:]


def _build_mla_with(rank: int, world_size: int, hf_dir: str, core_attention: str) -> bool:
    """Build DeepSeek-V3 with the local spec and the given core attention module."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_patches.sdpa_attention import SDPACoreAttention
    from mrl.megatron.model import layer_specs, transformer_config
    from mrl.megatron.parallel import initialize_layout
    from mrl.models.registry import model_spec_from_hf

    layout = ParallelLayout()
    initialize_layout(layout)
    spec = model_spec_from_hf(hf_dir)
    config = transformer_config(spec, layout, params_dtype=__import__("torch").float32)
    block = layer_specs(config, use_te=False, vp_stage=None)
    module = {"sdpa": SDPACoreAttention, "megatron": DotProductAttention}[core_attention]
    for layer in block.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = module
    GPTModel(config, block, vocab_size=1024, max_sequence_length=64, **spec.rope)
    return True


def test_sdpa_core_attention_is_what_lets_mla_build_without_te(tiny_model_dir):
    hf_dir = str(tiny_model_dir("deepseek_v3"))
    assert run_local(_build_mla_with, 1, hf_dir, "sdpa") == [True]
    with pytest.raises(WorkerError, match="k_channels"):
        run_local(_build_mla_with, 1, hf_dir, "megatron")
