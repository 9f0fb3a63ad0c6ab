"""Every tiny model generates in real vLLM (CPU) and agrees with transformers' greedy tokens.

vLLM runs one engine per process, so each architecture gets its own subprocess.
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
SCRIPT = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="float32", gpu_memory_utilization=0.2, max_model_len=256,
              enforce_eager=True, seed=0)
    out = llm.generate([sys.argv[2]], SamplingParams(max_tokens=int(sys.argv[3]), temperature=0))
    print("RESULT " + json.dumps(list(out[0].outputs[0].token_ids)))
"""


def _transformers_greedy(path: Path) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_generates_in_vllm_like_transformers(arch, tiny_model_dir, tmp_path):
    path = tiny_model_dir(arch)
    script = tmp_path / "generate.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(path), PROMPT, str(NEW_TOKENS)],
        capture_output=True, text=True, timeout=300, env=os.environ | {"TOKENIZERS_PARALLELISM": "false"},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    vllm_tokens = json.loads(lines[-1][len("RESULT "):])
    assert len(vllm_tokens) == NEW_TOKENS
    assert vllm_tokens == _transformers_greedy(path)
