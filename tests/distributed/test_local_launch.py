"""run_local (mrl verify, convert, merge --verify, the distributed tests): a rank that dies without
a result ends the launch within seconds, naming the rank and how it ended, whether its peer waits
in a collective with it (and fails there, blaming the connection) or works on alone."""

from __future__ import annotations

import os
import signal
import time

import pytest

from mrl.megatron.local_launch import WorkerError, run_local


def _one_rank_dies(rank: int, world: int, how: str, peer: str) -> int:
    import torch.distributed as dist

    if rank == 1:
        if how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    if peer == "in a collective":
        dist.barrier()  # rank 1 never comes: gloo fails here at once
    else:
        time.sleep(100)  # no collective: nothing but the launch notices rank 1
    return rank


@pytest.mark.parametrize("how, said", [("killed", "rank 1 was killed by signal 9"), ("exit", "rank 1 exited with code 3")])
@pytest.mark.parametrize("peer", ["in a collective", "working alone"])
def test_a_rank_that_dies_ends_the_launch_at_once_naming_it(how, said, peer):
    start = time.monotonic()
    with pytest.raises(WorkerError, match=f"{said} before returning a result"):
        run_local(_one_rank_dies, 2, how, peer, timeout_s=120)
    assert time.monotonic() - start < 60  # not the launch's 120 s
