"""Colocated placement: a rank's training state leaves the GPU while the rollout engine generates
(trainer.offload_actor_during_rollout), and comes back before the rank's next forward.

Every tensor is moved by its storage: the storage's bytes go to a host buffer and the storage is
resized to 0, which frees the GPU memory while every tensor viewing it (a parameter inside DDP's
param buffer, a `main_grad`, an optimizer's shard) stays the same Python object; so nothing that
holds a reference (DDP's buckets, the optimizer's param groups, the weight sender) is rebuilt.
On a machine without CUDA offloading is a no-op that reports the bytes it would move (`moved:
False`); `move_host_tensors=True` runs the release/restore path on host storages too (tests check
with it that a round trip leaves training unchanged). What the plan counts: docs/plan.md, "Actor
offload during generation".
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

# What moves, by part: "weights" (the model's parameters, Megatron DDP's param buffers, module
# buffers), "grads" (DDP's grad buffers, `main_grad`), "optimizer" (the fp32 main copies and Adam's
# moments Megatron's optimizer holds) and "reference" (the frozen KL reference copy). A storage is
# counted once, under the first part that names it (in PARTS order).
PARTS = ("weights", "grads", "optimizer", "reference")


@dataclass
class _Held:
    """One storage of a part: its size on the device and its host copy (kept between steps)."""

    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None = None


def _bytes_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    return torch.tensor([], dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


class StateOffloader:
    """Moves a rank's parts off the device and back. `tensors(part)` lists the part's tensors now
    (the optimizer's state appears at its first step, so it is asked at every offload).

    On CUDA the host buffers are pinned, allocated once and reused every step, the copies are
    non-blocking and synchronized once, and torch.cuda.empty_cache() hands the freed blocks back so
    vLLM's wake-up can take them. Only CUDA storages are moved there: an optimizer part that
    optim.offload_fraction already keeps in host memory stays where it is. Without a GPU those CUDA
    specifics (pinned buffers, non-blocking copies, empty_cache) are not run."""

    def __init__(self, tensors: Callable[[str], Iterable[torch.Tensor]], move_host_tensors: bool = False):
        self.tensors = tensors
        self.move_host = move_host_tensors
        self.cuda = torch.cuda.is_available()
        self.away: dict[str, list[_Held]] = {}  # parts off the device now
        self._hosts: dict[int, torch.Tensor] = {}  # host buffers by storage identity, reused

    def _storages(self) -> dict[str, list[torch.UntypedStorage]]:
        """Each part's distinct storages; one shared by two parts goes to the first in PARTS.
        With CUDA only CUDA storages (what lives in host memory already does not move)."""
        seen: set[int] = set()
        found: dict[str, list[torch.UntypedStorage]] = {}
        for part in PARTS:
            found[part] = []
            for tensor in self.tensors(part):
                storage = tensor.untyped_storage()
                if storage._cdata in seen or (self.cuda and storage.device.type != "cuda"):
                    continue
                seen.add(storage._cdata)
                found[part].append(storage)
        return found

    def _moves(self, storage: torch.UntypedStorage) -> bool:
        return storage.device.type == "cuda" or self.move_host

    def offload(self, parts: Iterable[str]) -> dict[str, Any]:
        """Move `parts` (those not away already) off the device: {"bytes", "by_part", "moved", "seconds"}."""
        start, parts = time.perf_counter(), [p for p in parts if p not in self.away]
        unknown = set(parts) - set(PARTS)
        if unknown:
            raise ValueError(f"unknown offload parts {sorted(unknown)}; known: {', '.join(PARTS)}")
        storages = self._storages()
        by_part, moving = {}, []
        for part in parts:
            held = [_Held(s, s.nbytes()) for s in storages[part] if s.nbytes() > 0]
            by_part[part] = sum(h.nbytes for h in held)
            self.away[part] = held
            moving += [h for h in held if self._moves(h.storage)]
        for h in moving:  # copy everything out first, then free: one synchronization
            h.host = self._host_buffer(h)
            h.host.copy_(_bytes_view(h.storage, h.nbytes), non_blocking=self.cuda)
        if self.cuda and moving:
            torch.cuda.synchronize()
        for h in moving:
            h.storage.resize_(0)
        if self.cuda and moving:
            torch.cuda.empty_cache()  # the freed blocks go back to the driver, for vLLM
        return {"bytes": sum(by_part.values()), "by_part": by_part, "moved": bool(moving),
                "seconds": time.perf_counter() - start}

    def onload(self, parts: Iterable[str] = PARTS) -> dict[str, Any]:
        """Bring `parts` back (those away): the same report as offload."""
        start, by_part, moved = time.perf_counter(), {}, False
        for part in [p for p in parts if p in self.away]:
            held = self.away.pop(part)
            by_part[part] = sum(h.nbytes for h in held)
            for h in held:
                if h.host is None:  # not moved (host memory already)
                    continue
                h.storage.resize_(h.nbytes)  # the same storage object: every view of it is whole again
                _bytes_view(h.storage, h.nbytes).copy_(h.host, non_blocking=self.cuda)
                moved = True
        if self.cuda and moved:
            torch.cuda.synchronize()  # the next kernel reads these bytes
        return {"bytes": sum(by_part.values()), "by_part": by_part, "moved": moved,
                "seconds": time.perf_counter() - start}

    def _host_buffer(self, held: _Held) -> torch.Tensor:
        key = held.storage._cdata
        host = self._hosts.get(key)
        if host is None or host.numel() != held.nbytes:
            host = torch.empty(held.nbytes, dtype=torch.uint8, pin_memory=self.cuda)
            self._hosts[key] = host
        return host


def trainable_tensors(trainable: Any, reference: Any | None, part: str) -> list[torch.Tensor]:
    """The tensors of `part` on an actor rank (mrl.megatron.training.Trainable, the reference BuiltModel)."""
    if part == "weights":
        out = [p for chunk in trainable.built.chunks for p in chunk.parameters()]
        out += [b for chunk in trainable.built.chunks for _, b in chunk.named_buffers() if b is not None]
        return out + [b.param_data for b in _ddp_buffers(trainable) if b.param_data is not None]
    if part == "grads":
        out = [b.grad_data for b in _ddp_buffers(trainable) if b.grad_data is not None]
        for chunk in trainable.built.chunks:
            for p in chunk.parameters():
                out += [g for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
        return out
    if part == "optimizer":
        return list(_optimizer_tensors(trainable.optimizer))
    if part == "reference":
        if reference is None:
            return []
        return [p for chunk in reference.chunks for p in chunk.parameters()] + [
            b for chunk in reference.chunks for _, b in chunk.named_buffers() if b is not None]
    raise ValueError(f"unknown offload part {part!r}; known: {', '.join(PARTS)}")


def _ddp_buffers(trainable: Any) -> list[Any]:
    """Megatron DDP's _ParamAndGradBuffers (dense and expert) of every chunk."""
    return [b for ddp in trainable.ddp_chunks for b in list(ddp.buffers) + list(ddp.expert_parallel_buffers)]


def _optimizer_tensors(optimizer: Any) -> Iterable[torch.Tensor]:
    """Every tensor a Megatron optimizer steps or keeps: ChainedOptimizer's parts, a wrapper's inner
    torch optimizer, HybridDeviceOptimizer's sub-optimizers; their params and state."""
    for inner in getattr(optimizer, "chained_optimizers", None) or []:
        yield from _optimizer_tensors(inner)
    if hasattr(optimizer, "chained_optimizers"):
        return
    torch_opt = optimizer if isinstance(optimizer, torch.optim.Optimizer) else getattr(optimizer, "optimizer", None)
    if torch_opt is None:
        return
    for group in torch_opt.param_groups:
        yield from group["params"]
    for state in torch_opt.state.values():
        yield from (v for v in state.values() if torch.is_tensor(v) and v.numel() > 0)
    for sub in getattr(torch_opt, "sub_optimizers", None) or []:
        yield from _optimizer_tensors(sub)
