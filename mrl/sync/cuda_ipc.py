"""The colocated transport on GPUs: the leader packs a bucket into GPU memory and hands every
engine a CUDA IPC handle to it; each engine maps the same memory (no host copy on either side).

The handle is torch's own (torch.multiprocessing.reductions), with an event that orders the
engine's reads after the leader's packing. Its reference count is one per share, not per process
that opens it (the engine's process and its workers may each open it): so the leader keeps each
bucket until every engine has said it loaded it (mrl.sync.sender), and an engine copies what it
keeps. It travels in the
bucket's JSON header, with the GPU's UUID: the engine's process may number the same GPU differently
(another CUDA_VISIBLE_DEVICES), so it is found by UUID, never by index.
"""

from __future__ import annotations

import base64
import pickle

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

_DEVICE = 6  # rebuild_cuda_tensor's storage_device argument


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def share(flat: torch.Tensor) -> dict:
    """A JSON-able handle to `flat` (a CUDA tensor) that another process on this node can open."""
    rebuild, args = reduce_tensor(flat)
    if rebuild is not rebuild_cuda_tensor:
        raise ValueError(f"only a CUDA tensor can be shared through CUDA IPC, not one on {flat.device}")
    return {"handle": base64.b64encode(pickle.dumps(args)).decode(), "gpu": device_uuid(flat.device.index)}


def open_shared(shared: dict) -> torch.Tensor:
    """The tensor behind `share`'s handle, mapped into this process (on the GPU that holds it)."""
    args = list(pickle.loads(base64.b64decode(shared["handle"])))
    visible = {device_uuid(i): i for i in range(torch.cuda.device_count())}
    if shared["gpu"] not in visible:
        raise RuntimeError(f"the weight sync's bucket lives on GPU {shared['gpu']}, which this engine's process "
                           f"does not see (it sees {sorted(visible) or 'no GPU'}): colocated placement needs the "
                           "engine on the trainer's GPUs; use sync.transport: broadcast otherwise")
    args[_DEVICE] = visible[shared["gpu"]]
    return rebuild_cuda_tensor(*args)
