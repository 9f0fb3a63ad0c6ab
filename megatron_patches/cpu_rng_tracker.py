"""Keep Megatron's tensor-parallel RNG tracker on the CPU generator.

Upstream (megatron-core 0.16.1, `tensor_parallel/random.py`): `CudaRNGStatesTracker.add` and
`fork` read and write `torch.cuda` RNG states, so `model_parallel_cuda_manual_seed` raises
"Torch not compiled with CUDA enabled" on a CPU build, and dropout inside tensor-parallel regions
cannot fork a per-rank stream.

Patch: the tracker stores CPU generator states (`torch.get_rng_state`) under the same names and
forks them the same way, so per-TP-rank seeding keeps upstream semantics on CPU.

Drop when: megatron-core gains a device-agnostic RNG tracker (not the case up to 0.16.1).
"""

from __future__ import annotations

import contextlib

import torch

CPU_ONLY = True


def _add(self, name: str, seed: int) -> None:
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    original = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(original)


@contextlib.contextmanager
def _fork(self, name: str = "model-parallel-rng"):
    if name not in self.states_:
        raise Exception(f"rng state {name} is not added")
    original = torch.get_rng_state()
    previous_name = self._current_state_name
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(original)
        self._current_state_name = previous_name


def apply() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.add = _add
    mrandom.CudaRNGStatesTracker.fork = _fork
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
