"""What the fork server of `run_local` imports once, so that every rank it forks has it: torch,
Megatron-core and transformers (a spawned rank imported them itself: ~4 s of CPU each, torch 1.0,
megatron.core 2.4, transformers 0.8; four ranks on two cores ~11 s before the first line of its
function). Third-party modules only, after quieting their known warnings: mrl's Megatron patches
are applied in each rank (initialize_layout), after its environment is set."""

from mrl.megatron.parallel import quiet_known_warnings

quiet_known_warnings()

import megatron.core  # noqa: E402,F401
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401
import safetensors.torch  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401
import transformers  # noqa: E402,F401
