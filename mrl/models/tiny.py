"""Tiny random HuggingFace models of every supported architecture (a few MB each).

`mrl tiny-model --arch deepseek_v3 --out DIR` writes config.json, model.safetensors (hub-style
per-tensor and per-expert keys), generation_config.json and a tokenizer trained locally with
`tokenizers`: a complete model directory that transformers and vLLM load, with no download.
Weights are random and seeded; the same seed writes the same bytes. config.json is written in the
spelling of hub checkpoints, not transformers 5's (`tiny_hf_config`), and the sizes are ones vLLM's
CPU kernels accept (TINY_CONFIGS). `--fp8` writes the model's FP8 twin instead, in DeepSeek-V3's
release format (`write_fp8_twin`, mrl/quant/fp8.py).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mrl.atomic import open_modes

if TYPE_CHECKING:  # torch is imported where a model is written, so `mrl tiny-model --help` stays quick
    import torch
    from tokenizers import Tokenizer

TINY_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")

# Special tokens take the first ids, so config/generation ids below are fixed: <pad>=0, <s>=1, </s>=2.
_SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
_PAD_ID, _BOS_ID, _EOS_ID = 0, 1, 2
_TOKENIZER_VOCAB = 512

_COMMON: dict[str, Any] = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, intermediate_size=128,
    max_position_embeddings=2048, rms_norm_eps=1e-6, vocab_size=1000, tie_word_embeddings=False,
    hidden_act="silu", bos_token_id=_BOS_ID, eos_token_id=_EOS_ID, pad_token_id=_PAD_ID,
    # float32 on disk and in config: parity tests compare frameworks exactly, without a bf16 cast.
    torch_dtype="float32",
)
# Per architecture: only what differs from _COMMON. head_dim is explicit (and 32) wherever the
# architecture has one, because vLLM's CPU attention accepts only head sizes 32, 64, 80, 96, …;
# for MLA vLLM's CPU kernels accept kv_lora_rank=512 with qk_rope_head_dim=64 (deepseek_v3 below).
# vocab_size 1000 is no multiple of 128 and 896 no multiple of 128·TP=2, so padding is exercised.
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", head_dim=32, tie_word_embeddings=True,
        rms_norm_eps=1e-5, rope_theta=500000.0, attention_bias=False, mlp_bias=False,
        # Must exceed the Llama-3 scaling's original 8192, or transformers warns on every load.
        max_position_embeddings=16384,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
    ),
    "qwen2": dict(
        # One KV head: fewer KV heads than TP=2 ranks. Qwen2 always has q/k/v biases.
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=128, head_dim=32,
        num_key_value_heads=1, intermediate_size=256, rope_theta=1000000.0, vocab_size=896,
        use_sliding_window=False,
    ),
    "qwen3": dict(
        # head_dim·heads = 128 ≠ hidden_size 64: catches code that assumes hidden_size // heads.
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32, rope_theta=1000000.0,
        attention_bias=False, use_sliding_window=False,
    ),
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=32, rope_theta=1000000.0,
        attention_bias=False, use_sliding_window=False, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    ),
    "deepseek_v3": dict(
        # MLA: num_key_value_heads = heads as on the hub; no head_dim (transformers derives it).
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        first_k_dense_replace=1, moe_layer_freq=1,  # vLLM reads moe_layer_freq (default 1); pinned
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        scoring_func="sigmoid", topk_method="noaux_tc",  # else vLLM drops e_score_correction_bias
        rope_interleave=True,  # the released checkpoints' layout (transformers' default, pinned)
        num_nextn_predict_layers=0, attention_bias=False, rope_theta=10000.0,
        # yarn factor 4 = max_position_embeddings 2048 / original 512, as transformers checks.
        rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=512, beta_fast=32,
                          beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    ),
}
# Variants: an architecture's tiny config with fields changed (None removes a field). Each covers a
# semantic the five defaults leave out, so the parity suite catches a silent difference from HF there.
TINY_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # Group-limited routing where num_experts_per_tok / topk_group != 2 (HF scores a group by its top
    # 2 experts, Megatron by its top topk/topk_group), two shared experts, qk_nope/v head dims that
    # differ from each other and from the base, plain RoPE in MLA (no YaRN).
    "deepseek_v3_groups": ("deepseek_v3", dict(
        n_routed_experts=12, n_group=4, topk_group=2, num_experts_per_tok=3, n_shared_experts=2,
        qk_nope_head_dim=24, v_head_dim=40, rope_scaling=None,
    )),
    # Qwen3-MoE without renormalised top-k weights: softmax over all experts, top-k taken as is.
    "qwen3_moe_unnormed": ("qwen3_moe", dict(norm_topk_prob=False)),
    # Qwen3-MoE whose first layer is a dense MLP (mlp_only_layers): a model mixing dense and MoE layers.
    "qwen3_moe_dense": ("qwen3_moe", dict(mlp_only_layers=[0])),
}
TINY_MODELS = TINY_ARCHS + tuple(TINY_VARIANTS)
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Matrices N(0, 0.05²): a little wider than the usual 0.02 so a 64-wide model's logits spread
# (std ≈ 0.5), which keeps greedy choices away from near-ties when frameworks are compared.
_WEIGHT_STD, _NORM_NOISE, _ROUTER_BIAS_STD = 0.05, 0.1, 0.1


def tiny_hf_config(arch: str) -> dict[str, Any]:
    """The config.json contents of the tiny model of `arch`, an architecture or a variant (a fresh copy each call).

    Written to config.json exactly as returned, in the spelling of hub checkpoints (`rope_theta` +
    `rope_scaling`, Qwen3-MoE `num_experts`), not the one transformers 5 would re-serialise
    (`rope_parameters`, `num_local_experts`), so downstream readers meet what they will meet on the hub."""
    base, changes = TINY_VARIANTS.get(arch, (arch, {}))
    if base not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny architecture {arch!r}; supported: {', '.join(TINY_MODELS)}")
    config = _COMMON | TINY_CONFIGS[base] | changes
    # Deep copy: transformers edits nested dicts (rope_scaling) it is given.
    return copy.deepcopy({k: v for k, v in config.items() if not (k in changes and v is None)})


def _corpus() -> list[str]:
    """A small deterministic corpus of plain English and arithmetic, enough for a 512-token BPE."""
    sentences = [
        "the quick brown fox jumps over the lazy dog.",
        "what is the answer to this question? the answer is a number.",
        "we compute the sum of two numbers and write the result.",
        "a model reads the prompt and then writes one token at a time.",
        "please add these numbers together and show your work step by step.",
        "the result of the addition is shown after the equals sign.",
        "every answer should be checked twice before it is written down.",
        "hello world, this is a tiny model with a tiny vocabulary.",
        "numbers can be added, subtracted, multiplied or divided.",
        "the user asks a question and the assistant gives an answer.",
        "small language models learn simple patterns from short examples.",
        "training with rewards teaches the policy which answers are correct.",
        "if the final answer matches the reference, the reward is one; otherwise it is zero.",
        "think carefully, then give the final answer inside a box.",
    ]
    lines = [f"{a}+{b}={a + b}" for a in range(30) for b in range(0, 30, 3)]
    lines += [f"{a}-{b}={a - b}" for a in range(30) for b in range(0, a + 1, 4)]
    lines += [f"{a}*{b}={a * b}" for a in range(10) for b in range(10)]
    lines += [f"what is {a} plus {b}? the answer is {a + b}." for a in range(10) for b in range(10)]
    return lines + sentences * 3


def build_tokenizer(vocab_size: int = _TOKENIZER_VOCAB) -> Tokenizer:
    """A byte-level BPE (`tokenizers.Tokenizer`) trained in-process on `_corpus()`; deterministic.

    The pipeline is Qwen2's (NFC; split into letter runs, single digits, punctuation runs; byte-level)
    for every architecture: transformers 5 forces its Qwen2Tokenizer on model_type "qwen2", which
    rebuilds exactly this pipeline whatever tokenizer.json says. Using it everywhere keeps
    tokenizer.json, AutoTokenizer and vLLM tokenising identically for all five architectures.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(models.BPE())  # byte-level: every input is covered, no unknown token needed
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    return tokenizer


def _write_tokenizer(directory: Path, model_max_length: int) -> None:
    """tokenizer.json plus a hub-style tokenizer_config.json (special tokens, chat template)."""
    build_tokenizer().save(str(directory / "tokenizer.json"))
    tokenizer_config = dict(
        # The class name every transformers version knows (v5 aliases it to TokenizersBackend).
        tokenizer_class="PreTrainedTokenizerFast",
        bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        add_bos_token=False, add_eos_token=False, clean_up_tokenization_spaces=False,
        model_max_length=model_max_length, chat_template=_CHAT_TEMPLATE,
    )
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights: matrices and biases N(0, std²), norms 1 + N(0, 0.1²), router bias N(0, 0.1²).

    Norm weights are not exactly 1 so that a misplaced or missing norm shows up in parity tests;
    DeepSeek-V3's e_score_correction_bias (an fp32 buffer) is non-zero so biased routing is tested.
    Parameters are visited in name order, so the draw does not depend on module registration order.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            module = name.rsplit(".", 2)[-2]  # "input_layernorm", "q_norm", "norm", "q_proj", …
            param.copy_(1 + _NORM_NOISE * noise if "norm" in module else _WEIGHT_STD * noise)
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(_ROUTER_BIAS_STD * torch.randn(buffer.shape, generator=generator))


def write_tiny_model(arch: str, out_dir: str | Path, seed: int = 0, force: bool = False) -> Path:
    """Write the tiny `arch` model directory to out_dir and return its path.

    The directory is assembled in a temporary sibling and renamed into place, so readers never see
    a partial model. An existing out_dir is an error unless force=True, which replaces it.
    Files: config.json, model.safetensors (fp32, hub-style per-expert keys), generation_config.json,
    tokenizer.json, tokenizer_config.json.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config_dict = tiny_hf_config(arch)
    out = Path(out_dir)
    fields = {k: v for k, v in tiny_hf_config(arch).items() if k != "model_type"}
    config = AutoConfig.for_model(config_dict["model_type"], **fields)
    # from_config's own init draws from the global RNG; fork it so callers' RNG state is untouched
    # (every value is overwritten by _randomize anyway).
    with torch.random.fork_rng():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    with _staged(out, force) as staging:
        # transformers 5 holds MoE experts fused in memory (experts.gate_up_proj [E, 2I, H]) but
        # save_pretrained converts back to the hub's per-expert keys (experts.E.gate_proj.weight).
        model.save_pretrained(staging)
        # save_pretrained re-serialises config.json in transformers-5 spelling; write the hub one.
        (staging / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
        GenerationConfig(
            bos_token_id=_BOS_ID, eos_token_id=_EOS_ID, pad_token_id=_PAD_ID, do_sample=False
        ).save_pretrained(staging)
        _write_tokenizer(staging, config_dict["max_position_embeddings"])
    return out


def write_fp8_twin(src_dir: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    """Write the FP8 twin of the unquantised HF directory src_dir to out_dir and return its path:
    the decoder layers' linear weights as float8_e4m3fn with 128×128-block `*_scale_inv` scales,
    everything else as it was, and `quantization_config` in config.json. The tiny hidden sizes are
    below 128, so most blocks are partial edge blocks.

    For the tiny zoo: holds the model in memory and writes one model.safetensors. Non-weight files
    are copied; config.json gains DeepSeek-V3's `quantization_config`. (`mrl convert hf-to-fp8`,
    mrl.bridge.dequantize.write_quantized, does the same shard by shard for any checkpoint; the zoo
    sits below mrl.bridge, so it keeps this small copy.)
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mrl.checkpoint_dir import copy_hf_metadata
    from mrl.quant.fp8 import QUANTIZATION_CONFIG, quantize_pairs

    src, out = Path(src_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(f"{src} is already quantised (config.json has quantization_config): pass an unquantised model.")
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            tensors.update(quantize_pairs((name, f.get_tensor(name)) for name in f.keys()))
    with _staged(out, force) as staging:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        copy_hf_metadata(src, staging)
        config["quantization_config"] = dict(QUANTIZATION_CONFIG)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


@contextlib.contextmanager
def _staged(out: Path, force: bool):
    """A staging directory beside `out` that replaces it, readable by all, when the block succeeds
    (and is removed when it fails): a model directory is never seen half written."""
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists: pass force=True (--force) to replace it.")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield staging
        # mkdtemp makes the directory 0700 and transformers writes the safetensors 0600; a model
        # directory should be readable by others (a vLLM server under another user, a container).
        open_modes(staging)
        _replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _replace_dir(new: Path, out: Path) -> None:
    """Rename `new` to `out`; an existing `out` is moved aside first and deleted after."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
        out.rename(old / out.name)
    new.rename(out)
    if old is not None:
        shutil.rmtree(old)


def main(argv: list[str] | None = None) -> int:
    """`mrl tiny-model --arch ARCH --out DIR [--seed N] [--force] [--fp8]`; returns the exit status."""
    parser = argparse.ArgumentParser(prog="mrl tiny-model", description="Write a tiny random HF model.")
    # Help lists the five architectures; the variants (TINY_VARIANTS) serve the parity tests and are
    # accepted by name without being offered.
    parser.add_argument("--arch", required=True, metavar="ARCH", help=f"one of {', '.join(TINY_ARCHS)}")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="replace an existing output directory")
    parser.add_argument("--fp8", action="store_true",
                        help="write the model's FP8 twin (DeepSeek-V3's block-scaled release format)")
    args = parser.parse_args(argv)
    if args.arch not in TINY_MODELS:
        parser.error(f"--arch {args.arch!r} is not a tiny architecture; choose one of {', '.join(TINY_ARCHS)}")
    try:
        if args.fp8:
            with tempfile.TemporaryDirectory() as tmp:
                path = write_fp8_twin(write_tiny_model(args.arch, Path(tmp) / "model", args.seed), args.out, args.force)
        else:
            path = write_tiny_model(args.arch, args.out, args.seed, args.force)
    except FileExistsError as err:
        print(f"mrl tiny-model: {err}")
        return 2
    size = sum(f.stat().st_size for f in path.iterdir()) / 1e6
    print(f"wrote tiny {args.arch}{' FP8' if args.fp8 else ''} model to {path} ({size:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
