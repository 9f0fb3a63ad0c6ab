"""A synthetic arithmetic task ("12+7=" → "19") with train and held-out splits.

Which split a problem belongs to is a hash of (seed, problem), so the splits never overlap and do
not depend on how many problems are drawn or in what order; the draw itself is seeded too.
Each problem also carries "demonstrations", the answers SFT is shown: with `teacher_error` > 0 a
careless teacher writes each of them ten too high with that probability, while the reward
still checks the true "answer": imitation then learns the teacher's habit, and only the reward tells
which habit is right (the demo's task, docs/benchmarks.md). With `tool_calls` a demonstration is a
conversation: a Hermes <tool_call> of the calculator, its answer, the result (the agent recipe,
configs/tiny_cpu_agent.yaml); the careless teacher then skips the tool and writes the result from
memory, which the student cannot. A space too big to enumerate is sampled by drawing problems.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from typing import Iterator

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
SPLITS = ("train", "heldout")
# Enumerating the problem space keeps sampling exact and without repeats; beyond this problems are drawn.
_MAX_PROBLEMS = 2_000_000
# Drawing stays cheap while a sample asks for at most this share of its split (few repeats)
_DRAWN_SHARE = 0.1
TOOL = "calculator"  # the built-in tool (mrl.agent.tools) a tool_calls demonstration calls
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
    tool_calls: bool = False

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

    def space_size(self) -> int:
        return len(self.ops) * (self.max_operand - self.min_operand + 1) ** 2

    def split_of(self, a: int, op: str, b: int) -> str:
        """"heldout" for a fixed, seed-dependent fraction of problems, "train" for the rest."""
        return "heldout" if _unit_hash(f"{self.seed}|{a}{op}{b}") < self.heldout_fraction else "train"

    def demonstrations(self, a: int, op: str, b: int) -> list:
        """What SFT is shown for a problem: DEMONSTRATIONS of them, each the result, or with
        probability `teacher_error` the result + TEACHER_SLIP (seeded: the same ones every run of a seed);
        with `tool_calls` each a conversation (`conversation`), careless with that probability."""
        result = OPERATIONS[op](a, b)
        careless = [_unit_hash(f"{self.seed}|teacher|{a}{op}{b}|{k}") < self.teacher_error
                    for k in range(DEMONSTRATIONS if self.teacher_error else 1)]
        if self.tool_calls:
            return [conversation(a, op, b, careless=c) for c in careless]
        return [str(result + TEACHER_SLIP * c) for c in careless]

    def _problems(self) -> Iterator[tuple[int, str, int]]:
        operands = range(self.min_operand, self.max_operand + 1)
        return ((a, op, b) for op in self.ops for a in operands for b in operands)

    def sample(self, n: int, split: str, seed: int = 0) -> list[dict]:
        """n distinct problems of `split` as {"prompt": "a op b=", "answer": str(result), "demonstrations"}."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")
        rng = random.Random(f"{self.seed}|{split}|{seed}")
        if self.space_size() > _MAX_PROBLEMS:
            chosen = self._drawn(n, split, rng)
        else:
            pool = [p for p in self._problems() if self.split_of(*p) == split]
            if n > len(pool):
                raise ValueError(f"asked for {n} {split} problems but the {split} split has only {len(pool)}: "
                                 "widen the operand range.")
            chosen = rng.sample(pool, n)
        return [{"prompt": f"{a}{op}{b}=", "answer": str(OPERATIONS[op](a, b)), "demonstrations": self.demonstrations(a, op, b)}
                for a, op, b in chosen]

    def _drawn(self, n: int, split: str, rng: random.Random) -> list[tuple[int, str, int]]:
        """n distinct problems of `split` drawn at random (a space too big to enumerate)."""
        share = self.heldout_fraction if split == "heldout" else 1 - self.heldout_fraction
        if n > _DRAWN_SHARE * share * self.space_size():
            raise ValueError(f"asked for {n} {split} problems of about {share * self.space_size():.0f}: more than "
                             f"{_DRAWN_SHARE:.0%} of a split too big to enumerate; widen the operand range.")
        chosen: dict[tuple[int, str, int], None] = {}  # insertion-ordered: the draw order
        while len(chosen) < n:
            problem = (rng.randint(self.min_operand, self.max_operand), rng.choice(self.ops),
                       rng.randint(self.min_operand, self.max_operand))
            if self.split_of(*problem) == split:
                chosen[problem] = None
        return list(chosen)


def conversation(a: int, op: str, b: int, careless: bool = False) -> list[dict[str, str]]:
    """A demonstration of solving `a op b` with the calculator, as chat messages: the assistant's Hermes
    tool call, the tool's answer (the calculator writes an integer as str() does), the final answer.
    Careless: the final answer alone, from memory (right: the teacher can add; the student cannot)."""
    expression, result = f"{a}{op}{b}", str(OPERATIONS[op](a, b))
    if careless:
        return [{"role": "assistant", "content": result}]
    call = json.dumps({"name": TOOL, "arguments": {"expression": expression}})
    return [{"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
            {"role": "tool", "content": result}, {"role": "assistant", "content": result}]


def _unit_hash(text: str) -> float:
    """A stable hash of `text` in [0, 1)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") / 2**64
