"""The colocated transport on GPUs: the leader packs a bucket into GPU memory and hands every
engine a CUDA IPC handle to it; each engine maps the same memory (no host copy on either side).

The one idea: torch counts one reference per share of the memory, so every open needs a share of
its own: the leader makes one handle per time an engine's processes open a bucket (share), each
opener takes its own (open_shared), and one never opened is given back (give_back); see share.
The leader keeps each bucket until every engine has said it loaded it (mrl.sync.link), and an
engine copies what it keeps. The handles travel in the bucket's JSON header, with the GPU's UUID:
the engine's process may number the same GPU differently (another CUDA_VISIBLE_DEVICES), so it
is found by UUID, never by index. When this transport is used: docs/sync.md, "The transports".
"""

from __future__ import annotations

import base64
import pickle

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

_DEVICE = 6  # rebuild_cuda_tensor's storage_device argument
_REF_COUNTER = 11  # and its ref_counter_handle (ref_counter_offset follows)


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def share(flat: torch.Tensor, opens: list[int]) -> dict:
    """JSON-able handles to `flat` (a CUDA tensor) that other processes on this node can open: for
    each engine, one per time it opens a bucket (`opens`, SyncEndpoint.ipc_opens).

    The handle is torch's own (torch.multiprocessing.reductions), with an event that orders the
    engine's reads after the leader's packing. Torch counts one reference per share and takes one
    back at every open (when the opening process drops the memory, or at once if it had it open),
    so each open needs a share of its own: opened by an engine's process and by each of its
    workers, one share was given back three times, and the trainer held on to every bucket of the
    sync (a TP2 engine on an H200: the whole model). So the leader makes as many handles as each
    engine says it opens a bucket, the receiver keeps its engine's list (for_engine), and each
    opener takes its own (open_shared's `opener`); a handle that will not be opened (a failed
    update, an open that failed) is given back through torch's counter alone (give_back)."""
    if not flat.is_cuda:
        raise ValueError(f"only a CUDA tensor can be shared through CUDA IPC, not one on {flat.device}")
    return {"handles": [[_handle(flat) for _ in range(n)] for n in opens], "gpu": device_uuid(flat.device.index)}


def _handle(flat: torch.Tensor) -> str:
    rebuild, args = reduce_tensor(flat)
    if rebuild is not rebuild_cuda_tensor:
        raise ValueError(f"torch shared {flat.device} memory without a CUDA IPC handle")
    return base64.b64encode(pickle.dumps(args)).decode()


def reachable(gpu: str, endpoints) -> bool:
    """Whether every engine's process sees the GPU (by UUID) that holds the leader's buckets:
    an engine placed on other GPUs (Ray narrows CUDA_VISIBLE_DEVICES per actor) cannot map them,
    and gets host-staged buckets instead."""
    return all(gpu in e.gpus for e in endpoints)


def visible_gpus() -> tuple[str, ...]:
    """The UUIDs of the GPUs this process sees (none without CUDA, or where CUDA cannot start here:
    the sync then stages buckets in host memory)."""
    try:
        return tuple(device_uuid(i) for i in range(torch.cuda.device_count())) if torch.cuda.is_available() else ()
    except RuntimeError:
        return ()


def give_back(shared: dict, openers: range) -> None:
    """Give back the references of handles `openers` of one engine's without opening them: torch's
    own release of a share (what an open does in a process that has the memory mapped already), a
    decrement in the leader's counter file, with no mapping and no CUDA context. For a bucket not
    handed to the engine's processes (a failed update, or an engine that loads in one process), and
    an open that failed (it took no reference): otherwise the leader holds the bucket until it exits."""
    for opener in openers:
        args = _args(shared, opener)
        torch.UntypedStorage._release_ipc_counter(args[_REF_COUNTER], args[_REF_COUNTER + 1])


def for_engine(shared: dict, index: int) -> dict:
    """The handles of engine `index` of a fan-out (the receiver's view of the header)."""
    return {"handles": shared["handles"][index], "gpu": shared["gpu"]}


def open_shared(shared: dict, opener: int = 0) -> torch.Tensor:
    """The tensor behind handle `opener` of one engine's (for_engine): 0 for the engine's own
    process, 1 + r for its worker of rank r. Mapped into this process, on the GPU that holds it."""
    args = _args(shared, opener)
    visible = {device_uuid(i): i for i in range(torch.cuda.device_count())}
    if shared["gpu"] not in visible:
        raise RuntimeError(f"the weight sync's bucket lives on GPU {shared['gpu']}, which this engine's process "
                           f"does not see (it sees {sorted(visible) or 'no GPU'}): colocated placement needs the "
                           "engine on the trainer's GPUs; use sync.transport: broadcast otherwise")
    args[_DEVICE] = visible[shared["gpu"]]
    return rebuild_cuda_tensor(*args)


def _args(shared: dict, opener: int) -> list:
    """rebuild_cuda_tensor's arguments in handle `opener` of one engine's."""
    handles = shared["handles"]
    if opener >= len(handles):
        raise RuntimeError(f"the weight sync's bucket has {len(handles)} CUDA IPC handle(s) for this engine and "
                           f"open number {opener} asked for one more: the engine must declare how many times its "
                           "processes open a bucket (ipc_opens: its own process and each worker's)")
    return list(pickle.loads(base64.b64decode(handles[opener])))
