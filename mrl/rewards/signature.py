"""The two signatures a custom reward may have: mrl's, or verl's compute_score, taken as it is.

mrl calls fn(prompt, response, ground_truth, metadata) positionally. A function with a
`solution_str` parameter is verl's compute_score(data_source, solution_str, ground_truth,
extra_info): it is called by keyword, as verl's reward managers call it, with the record's
`data_source` and `extra_info` columns, and may return a float or a dict with a "score" key.
Anything else is refused when the reward is loaded (before a run starts). docs/rewards.md.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from mrl.rewards.base import RewardLoadError

MRL_SIGNATURE = "fn(prompt, response, ground_truth, metadata)"
VERL_SIGNATURE = "compute_score(data_source, solution_str, ground_truth, extra_info=None)"
VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


def adapt(fn: Callable, spec: str) -> Callable:
    """`fn` as mrl calls it: itself (mrl's signature), a VerlReward (verl's), or RewardLoadError."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: call it as mrl's and see
        return fn
    params = signature.parameters
    if "solution_str" in params:
        takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
        passed = tuple(name for name in VERL_ARGS if takes_all or name in params)
        unfilled = [name for name, p in params.items() if p.default is p.empty and name not in passed
                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not unfilled and not any(p.kind is p.POSITIONAL_ONLY and name in passed for name, p in params.items()):
            return VerlReward(fn, passed)
    else:
        try:
            signature.bind("prompt", "response", "ground_truth", {})
            return fn
        except TypeError:
            pass
    name = getattr(fn, "__name__", type(fn).__name__)
    raise RewardLoadError(f"reward {spec!r}: {name}{signature} has neither mrl's signature {MRL_SIGNATURE} nor "
                          f"verl's {VERL_SIGNATURE}: rename or add parameters to match one of them.")


class VerlReward:
    """A verl compute_score called with mrl's arguments; `passed`: the verl arguments it accepts.

    data_source and extra_info are the record's columns of those names (verl's); the ground truth is
    mrl's (data.answer_key), or the record's reward_model.ground_truth (verl's) when that is unset.
    """

    def __init__(self, fn: Callable, passed: tuple[str, ...]) -> None:
        self.fn, self.passed = fn, passed

    def __call__(self, prompt: str, response: str, ground_truth: Any, metadata: dict | None) -> Any:
        record = metadata or {}
        if ground_truth is None and isinstance(record.get("reward_model"), dict):
            ground_truth = record["reward_model"].get("ground_truth")
        args = {"data_source": record.get("data_source"), "solution_str": response, "ground_truth": ground_truth,
                "extra_info": record.get("extra_info")}
        return verl_result(self.fn(**{name: args[name] for name in self.passed}))


def verl_result(value: Any) -> Any:
    """verl's return value as mrl's: a dict's "score" (older verl: "reward") with the rest as details;
    a bool as 0.0 / 1.0."""
    if isinstance(value, dict):
        key = "score" if "score" in value else "reward" if "reward" in value else None
        if key is None:
            raise TypeError(f"a verl compute_score returned a dict without a 'score' key (keys: {sorted(value)})")
        value = (value[key], {k: v for k, v in value.items() if k != key})
    if isinstance(value, tuple) and value and isinstance(value[0], bool):
        return float(value[0]), value[1]
    return float(value) if isinstance(value, bool) else value
