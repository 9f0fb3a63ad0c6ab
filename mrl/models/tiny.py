"""Tiny random HuggingFace models of every supported architecture (a few MB each).

`mrl tiny-model --arch deepseek_v3 --out DIR` writes config.json, model.safetensors (hub-style
per-tensor and per-expert keys), generation_config.json and a tokenizer trained locally with
`tokenizers`: a complete model directory that transformers and vLLM load, with no download.
Weights are random and seeded; the same seed writes the same bytes.

Sizes respect what vLLM's CPU kernels accept: attention head sizes of 32/64/…, and for MLA
kv_lora_rank=512 with qk_rope_head_dim=64.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

TINY_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")

_COMMON = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=4,
    intermediate_size=128, max_position_embeddings=2048, rms_norm_eps=1e-6, vocab_size=1000,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="float32",
)
# Per architecture: only what differs from _COMMON. Vocab sizes are not multiples of 128·TP, so
# vocab padding is exercised; qwen2 has one KV head, fewer than TP=2 ranks.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=True, rope_theta=500000.0,
        max_position_embeddings=16384,  # above the Llama-3 scaling's original 8192
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=128, num_key_value_heads=1,
        intermediate_size=256, rope_theta=1000000.0, vocab_size=896,
    ),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", rope_theta=1000000.0),
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    ),
    "deepseek_v3": dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_key_value_heads=4,
        first_k_dense_replace=1, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        scoring_func="sigmoid", topk_method="noaux_tc",  # vLLM needs noaux_tc for DeepSeek-V3
        q_lora_rank=32, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        rope_interleave=True, num_nextn_predict_layers=0,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=512, beta_fast=32,
                          beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    ),
}
_SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_hf_config(arch: str) -> dict[str, Any]:
    """The config.json contents of the tiny model of `arch`."""
    if arch not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny architecture {arch!r}; supported: {', '.join(TINY_ARCHS)}")
    config = _COMMON | TINY_CONFIGS[arch]
    if arch == "deepseek_v3":
        config.pop("head_dim")  # MLA head dims come from qk_*_head_dim and v_head_dim
    return config


def _corpus() -> list[str]:
    """A small deterministic corpus: arithmetic and a few English words, enough for a BPE."""
    words = "the answer is what plus minus times equals number question compute sum result".split()
    lines = [f"{a}+{b}={a + b}" for a in range(40) for b in range(0, 40, 3)]
    lines += [f"what is {a} plus {b}? the answer is {a + b}." for a in range(20) for b in range(20)]
    lines += [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    return lines


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE trained in-process, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        chat_template=_CHAT_TEMPLATE,
    )


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights: matrices N(0, 0.05²), norms 1 + N(0, 0.1²), router bias N(0, 0.1²) in fp32."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(noise * 0.05 if param.dim() > 1 else 1 + 0.1 * noise)
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))


def write_tiny_model(arch: str, out_dir: str | Path, seed: int = 0, force: bool = False) -> Path:
    """Write the tiny `arch` model to out_dir (atomically: a temporary directory, then a rename)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config_dict = tiny_hf_config(arch)
    out = Path(out_dir)
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists: pass force=True (--force) to replace it.")
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = {k: v for k, v in config_dict.items() if k != "model_type"}
    config = AutoConfig.for_model(config_dict["model_type"], **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(staging)
        GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, do_sample=False).save_pretrained(staging)
        build_tokenizer().save_pretrained(staging)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mrl tiny-model", description="Write a tiny random HF model.")
    parser.add_argument("--arch", required=True, choices=TINY_ARCHS)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    args = parser.parse_args(argv)
    try:
        path = write_tiny_model(args.arch, args.out, args.seed, args.force)
    except FileExistsError as err:
        print(f"mrl tiny-model: {err}")
        return 2
    size = sum(f.stat().st_size for f in path.iterdir()) / 1e6
    print(f"wrote tiny {args.arch} model to {path} ({size:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
