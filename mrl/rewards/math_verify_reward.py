"""`math_verify`: 1.0 when the response's final answer equals the ground truth symbolically, judged
by HuggingFace's math-verify (LaTeX and plain answers parsed into sympy and compared: 0.5 = \\frac12,
x=2 ~ 2, intervals, sets, \\sqrt{8} = 2\\sqrt{2}, (x+1)^2 = x^2+2x+1).

build_reward runs it in the reward sandbox's worker processes (mrl/rewards/sandbox.py), never in
the driver, for two reasons:
  - sympy ran over 10 minutes on a pathological answer (9^{9^{9^9}}); the sandbox's per-call
    timeout (reward.timeout_s) kills and replaces a worker that overruns, whatever it is stuck in;
  - math-verify bounds its own parsing and comparisons with signal.alarm, which works only in a
    process's main thread: a sandbox worker calls the function there. Those alarms end a slow
    answer cheaply (score 0, the worker lives on) before the sandbox has to kill anything.
This module imports math-verify (sympy, antlr) at its top, so a worker pays that import when it
starts, not within a sample's timeout; `mrl.rewards` names it by import path and never imports it.
"""

from __future__ import annotations

import threading
from itertools import product

from math_verify import LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException

# math-verify's own alarms (whole seconds; one per parse, one per candidate pair compared). A
# timeout raises, so it is scored 0 and logged to reward_errors.jsonl like any failed call.
PARSE_TIMEOUT_S = 2
COMPARE_TIMEOUT_S = 2


def math_verify(prompt: str, response: str, ground_truth: str | None, metadata: dict | None = None):
    """1.0 when the response's answer (the last \\boxed{}, else the last LaTeX or plain expression)
    equals the ground truth (a bare or \\boxed{} answer, LaTeX or plain), else 0.0."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("math_verify times sympy with signal.alarm, which works only in a process's main "
                           "thread: score it through build_reward (reward.name: math_verify), whose workers call it there.")
    truth = (ground_truth or "").strip()
    if not truth:
        raise ValueError("math_verify needs a ground truth: set data.answer_key to the field that holds the answer.")
    # A bare ground truth is boxed so that LaTeX extraction reads it whole ("1,2" a set, not 1.2).
    gold = _parse(truth if "\\boxed" in truth else f"\\boxed{{{truth}}}", [LatexExtractionConfig()], "ground truth")
    answer = _parse(response, None, "response")
    info = {"extracted": str(answer[-1]) if answer else None}
    return float(bool(gold and answer) and _equal(gold, answer)), info


def _parse(text: str, extraction: list | None, what: str) -> list:
    """math-verify's parse: [sympy object, matched text], or [] when nothing parses."""
    kwargs = {} if extraction is None else {"extraction_config": extraction}
    try:
        return parse(text, parsing_timeout=PARSE_TIMEOUT_S, raise_on_error=True, **kwargs)
    except TimeoutException:
        raise TimeoutError(f"math-verify parsing the {what} took over {PARSE_TIMEOUT_S}s") from None
    except Exception:  # noqa: BLE001 - an answer that does not parse is a wrong answer, not a failure
        return []


def _equal(gold: list, answer: list) -> bool:
    """Any (gold, answer) candidate pair equal, as math-verify's verify(gold, answer) decides, except
    that a timeout raises instead of being logged and read as 'not equal'."""
    for g, a in product(gold, answer):
        try:
            if verify(g, a, timeout_seconds=COMPARE_TIMEOUT_S, raise_on_error=True):
                return True
        except TimeoutException:
            raise TimeoutError(f"math-verify comparing the answer took over {COMPARE_TIMEOUT_S}s") from None
        except Exception:  # noqa: BLE001 - math-verify's own default: an error in one pair is no match
            continue
    return False
