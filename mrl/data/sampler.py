"""An epoch-based batch sampler whose position can be saved and restored for resume."""

from __future__ import annotations

import random
from typing import Any


class EpochSampler:
    """Yields batches of indices into a dataset of `num_items`, reshuffled every epoch.

    The order of epoch e depends only on (seed, e), so state_dict() needs just the epoch and the
    position in it to resume exactly where a run stopped.
    """

    def __init__(self, num_items: int, batch_size: int, seed: int = 0, shuffle: bool = True, drop_last: bool = True) -> None:
        if num_items < 1 or batch_size < 1:
            raise ValueError(f"sampler needs num_items >= 1 and batch_size >= 1, got {num_items} and {batch_size}.")
        if drop_last and batch_size > num_items:
            raise ValueError(
                f"batch size {batch_size} exceeds the dataset's {num_items} items: lower data.batch_size or add data."
            )
        self.num_items, self.batch_size, self.seed = num_items, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.num_items))
        if self.shuffle:
            random.Random(f"{self.seed}|{epoch}").shuffle(order)
        return order

    def next_batch(self) -> list[int]:
        """The next batch; a new epoch starts when the current one cannot fill a batch."""
        remaining = self.num_items - self.position
        if remaining <= 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch, self.position = self.epoch + 1, 0
        batch = self._order(self.epoch)[self.position : self.position + self.batch_size]
        self.position += len(batch)
        return batch

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state (JSON-serialisable)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_items": self.num_items, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from state_dict(); the dataset size and batch size must match the saved run."""
        for key in ("num_items", "batch_size", "seed"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]} but this run has {getattr(self, key)}: "
                    "resume with the same data and batch size, or start fresh."
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
