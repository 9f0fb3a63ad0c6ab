"""Rule-based rewards: `exact_answer` and `boxed_math` (1.0 for a correct answer, else 0.0)."""

from __future__ import annotations

import re
from fractions import Fraction

from mrl.rewards.base import REWARD_FUNCTIONS

# An optionally signed integer or decimal, allowing thousands separators ("1,234.5").
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")


@REWARD_FUNCTIONS.register("exact_answer")
def exact_answer(prompt: str, response: str, ground_truth: str | None, metadata: dict | None = None):
    """1.0 when the answer equals the ground truth, else 0.0.

    A numeric ground truth is compared with the last number in the response (so "the sum is 19."
    matches "19" and "19.0"); any other ground truth with the whole stripped response.
    """
    truth = (ground_truth or "").strip()
    truth_number = parse_number(truth)
    if truth_number is not None:
        numbers = _NUMBER.findall(response)
        extracted = numbers[-1] if numbers else None
        correct = extracted is not None and parse_number(extracted) == truth_number
    else:
        extracted = response.strip()
        correct = extracted == truth
    return float(correct), {"extracted": extracted}


@REWARD_FUNCTIONS.register("boxed_math")
def boxed_math(prompt: str, response: str, ground_truth: str | None, metadata: dict | None = None):
    """1.0 when the last \\boxed{...} of the response equals the ground truth after normalisation.

    Numbers compare by value (1/2 = 0.5 = \\frac{1}{2}); other answers by their normalised LaTeX.
    A ground truth that itself contains \\boxed{} is unwrapped first.
    """
    answer = last_boxed(response)
    if answer is None:
        return 0.0, {"extracted": None}
    truth = ground_truth or ""
    truth = last_boxed(truth) or truth
    return float(answers_equal(answer, truth)), {"extracted": answer}


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) with balanced braces, or None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    open_brace = text.index("{", start)
    depth = 0
    for pos in range(open_brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[pos], 0)
        if depth == 0:
            return text[open_brace + 1 : pos]
    return None  # unbalanced: the answer was cut off


# LaTeX that changes how an answer looks, not what it is.
_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "$", "^\\circ", "^{\\circ}", "\\%", "%", "\\displaystyle")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def normalize_answer(answer: str) -> str:
    """Canonical text of a short math answer: no spacing/sizing LaTeX, \\frac{a}{b} → (a)/(b)."""
    s = _TEXT.sub(r"\1", answer)
    for token in _DROP:
        s = s.replace(token, "")
    s = _FRAC.sub(r"(\1)/(\2)", s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def answers_equal(a: str, b: str) -> bool:
    """Equal by value when both are numbers or simple fractions, else by normalised text."""
    na, nb = normalize_answer(a), normalize_answer(b)
    va, vb = parse_number(na), parse_number(nb)
    if va is not None and vb is not None:
        return va == vb
    return na == nb


def parse_number(text: str) -> Fraction | None:
    """Exact value of "12", "-0.50", "1,000", "3/4" or "(3)/(4)"; None for anything else."""
    s = text.strip().replace(" ", "")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    fraction = re.fullmatch(r"(-?)\(?(-?\d+)\)?/\(?(\d+)\)?", s)
    if fraction:
        sign, num, den = fraction.groups()
        if int(den) == 0:
            return None
        value = Fraction(int(num), int(den))
        return -value if sign else value
    if re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", s):
        return Fraction(s)
    return None
