"""Every tiny model generates in real vLLM (CPU, float32) and agrees with transformers' greedy tokens.

vLLM runs one engine per process (a second engine in the same process fails), so each
architecture gets its own subprocess; each takes ~15-20 s on 2 cores, mostly engine start-up.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mrl.models.tiny import TINY_ARCHS

PROMPT, NEW_TOKENS = "12+7=", 8
# Run as a script: argv = model directory, prompt, number of tokens, extra LLM arguments (JSON: the
# attention backend mrl's engine picks on CPU, mrl.rollout.vllm_engine.cpu_attention). ignore_eos
# makes the length fixed and the choice a pure argmax, like the transformers loop below.
# kv_cache_memory_bytes sizes the cache directly (on CPU, gpu_memory_utilization would be a
# fraction of host RAM).
SCRIPT = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20,
              enforce_eager=True, seed=0, **json.loads(sys.argv[4]))
    params = SamplingParams(max_tokens=int(sys.argv[3]), temperature=0.0, ignore_eos=True, logprobs=0)
    out = llm.generate([sys.argv[2]], params)[0]
    tokens = list(out.outputs[0].token_ids)
    logprobs = [step[t].logprob for t, step in zip(tokens, out.outputs[0].logprobs)]
    dtype = str(llm.llm_engine.model_config.dtype)
    print("RESULT " + json.dumps(dict(prompt=out.prompt_token_ids, tokens=tokens, logprobs=logprobs, dtype=dtype)))
"""


def _transformers_greedy(path: Path, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
    """Plain argmax decoding (no generation config: EOS, min length); tokens and their logprobs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids, logprobs = torch.tensor([prompt_ids]), []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            step = model(ids).logits[0, -1].log_softmax(-1)
            ids = torch.cat([ids, step.argmax().view(1, 1)], dim=1)
            logprobs.append(step.max().item())
    return ids[0, len(prompt_ids):].tolist(), logprobs


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_generates_in_vllm_like_transformers(arch, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from mrl.rollout.vllm_engine import cpu_attention

    path = tiny_model_dir(arch)
    script = tmp_path / "generate.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(path), PROMPT, str(NEW_TOKENS), json.dumps(cpu_attention(str(path)))],
        capture_output=True, text=True, timeout=300, env=os.environ | {"TOKENIZERS_PARALLELISM": "false"},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["prompt"] == AutoTokenizer.from_pretrained(path)(PROMPT).input_ids  # same tokenizer
    assert result["dtype"] == "torch.float32" and len(result["tokens"]) == NEW_TOKENS
    tokens, logprobs = _transformers_greedy(path, result["prompt"])
    assert result["tokens"] == tokens
    # Same numbers too, not just the same argmax: fp32 in both, so differences are rounding only.
    # Measured: at most 1e-6 on every architecture.
    assert result["logprobs"] == pytest.approx(logprobs, abs=1e-4)
