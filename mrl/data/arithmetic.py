"""A synthetic arithmetic task ("12+7=" → "19") with train and held-out splits.

Which split a problem belongs to is a hash of (seed, problem), so the splits never overlap and do
not depend on how many problems are drawn or in what order; the draw itself is seeded too.
Each problem also carries "demonstrations", the answers SFT is shown: with `teacher_error` > 0 a
careless teacher writes each of them ten too high with that probability, while the reward
still checks the true "answer": imitation then learns the teacher's habit, and only the reward tells
which habit is right (the demo's task, docs/benchmarks.md).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Iterator

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
SPLITS = ("train", "heldout")
# Enumerating the problem space keeps sampling exact and without repeats; beyond this it is too big.
_MAX_PROBLEMS = 2_000_000
# A careless teacher's answers a problem: enough that each problem's share of wrong ones is near teacher_error
DEMONSTRATIONS = 10
# Its slip: the tens digit one too high, an error unlike the model's own (mostly ±1 in the last digit), so
# imitation makes it the model's favourite answer rather than blurring it into its mistakes
TEACHER_SLIP = 10


@dataclass(frozen=True)
class ArithmeticTask:
    """Problems `a op b` with integer operands in [min_operand, max_operand] and ops from `ops`."""

    ops: tuple[str, ...] = ("+", "-")
    min_operand: int = 0
    max_operand: int = 99
    heldout_fraction: float = 0.1
    seed: int = 0
    teacher_error: float = 0.0

    def __post_init__(self) -> None:
        unknown = [op for op in self.ops if op not in OPERATIONS]
        if unknown or not self.ops:
            raise ValueError(f"arithmetic ops {list(self.ops)}: each must be one of {list(OPERATIONS)}.")
        if self.min_operand > self.max_operand:
            raise ValueError(f"arithmetic min_operand {self.min_operand} > max_operand {self.max_operand}.")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"arithmetic heldout_fraction must be in (0, 1), got {self.heldout_fraction}.")
        if not 0.0 <= self.teacher_error <= 1.0:
            raise ValueError(f"arithmetic teacher_error must be in [0, 1], got {self.teacher_error}.")
        if self.space_size() > _MAX_PROBLEMS:
            raise ValueError(f"{self.space_size()} possible problems is too many: narrow the operand range.")

    def space_size(self) -> int:
        return len(self.ops) * (self.max_operand - self.min_operand + 1) ** 2

    def split_of(self, a: int, op: str, b: int) -> str:
        """"heldout" for a fixed, seed-dependent fraction of problems, "train" for the rest."""
        return "heldout" if _unit_hash(f"{self.seed}|{a}{op}{b}") < self.heldout_fraction else "train"

    def demonstrations(self, a: int, op: str, b: int) -> list[str]:
        """The answers SFT is shown for a problem: DEMONSTRATIONS of them, each the result, or with
        probability `teacher_error` the result + TEACHER_SLIP (seeded: the same ones every run of a seed)."""
        result = OPERATIONS[op](a, b)
        return [str(result + TEACHER_SLIP * (_unit_hash(f"{self.seed}|teacher|{a}{op}{b}|{k}") < self.teacher_error))
                for k in range(DEMONSTRATIONS if self.teacher_error else 1)]

    def _problems(self) -> Iterator[tuple[int, str, int]]:
        operands = range(self.min_operand, self.max_operand + 1)
        return ((a, op, b) for op in self.ops for a in operands for b in operands)

    def sample(self, n: int, split: str, seed: int = 0) -> list[dict[str, str]]:
        """n distinct problems of `split` as {"prompt": "a op b=", "answer": str(result), "demonstrations"}."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")
        pool = [p for p in self._problems() if self.split_of(*p) == split]
        if n > len(pool):
            raise ValueError(f"asked for {n} {split} problems but the {split} split has only {len(pool)}: widen the operand range.")
        chosen = random.Random(f"{self.seed}|{split}|{seed}").sample(pool, n)
        return [{"prompt": f"{a}{op}{b}=", "answer": str(OPERATIONS[op](a, b)), "demonstrations": self.demonstrations(a, op, b)}
                for a, op, b in chosen]


def _unit_hash(text: str) -> float:
    """A stable hash of `text` in [0, 1)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") / 2**64
