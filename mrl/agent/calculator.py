"""Exact arithmetic on long integers and decimals from a string, for the calculator tool.

The expression is parsed with `ast` and only numbers, + - * / // % **, unary signs and
parentheses are evaluated: no eval, no names, no calls. Integers stay exact; decimals (written
with a point or an exponent, read from their source text so 0.1 is exactly 0.1) are exact for
+ - * // % and integer powers. `/` of non-multiples and fractional powers are rounded to
DIVISION_DIGITS significant digits after the integer part. Every number is bounded to
MAX_DIGITS digits (below Python's 4300-digit int/str limit), and a power whose result would pass
that bound is refused before it is computed. Errors are CalculatorError with a one-line reason.
"""

from __future__ import annotations

import ast
import decimal
import math
from decimal import Decimal

MAX_DIGITS = 4000
DIVISION_DIGITS = 50
MAX_EXPRESSION_CHARS = 20_000
_LOG10_2 = 0.30103

Number = int | Decimal

# + - * and integer powers of decimals are computed exactly: an inexact result means it needs more
# than MAX_DIGITS digits, which is refused rather than silently rounded.
_EXACT = decimal.Context(prec=MAX_DIGITS, Emax=4 * MAX_DIGITS, Emin=-4 * MAX_DIGITS,
                         traps=[decimal.Inexact, decimal.Overflow, decimal.InvalidOperation,
                                decimal.DivisionByZero])


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message says why, in one line."""


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, as exact decimal text (no exponent notation)."""
    source = expression.strip()
    if not source:
        raise CalculatorError("the expression is empty: write numbers with + - * / // % ** and parentheses.")
    if len(source) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression has {len(source)} characters; the limit is {MAX_EXPRESSION_CHARS}.")
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError as exc:
        if "integer string conversion" in str(exc.msg):  # Python's own 4300-digit bound
            raise CalculatorError(f"a number has more than {MAX_DIGITS} digits; that is the limit.") from None
        raise CalculatorError(f"{_clip(source)!r} is not an arithmetic expression ({exc.msg}, column "
                              f"{exc.offset}): use numbers, + - * / // % ** and parentheses.") from None
    except (ValueError, RecursionError, MemoryError) as exc:  # a literal too long, parentheses too deep
        raise CalculatorError(f"cannot read the expression: {exc}.") from None
    try:
        return _format(_evaluate(tree.body, source))
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply.") from None
    except decimal.DecimalException as exc:
        raise CalculatorError(f"the result cannot be computed exactly within {MAX_DIGITS} digits "
                              f"({type(exc).__name__}).") from None


def _evaluate(node: ast.AST, source: str) -> Number:
    if isinstance(node, ast.Constant):
        return _checked(_literal(node, source))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand, source)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _checked(_OPERATORS[type(node.op)](_evaluate(node.left, source), _evaluate(node.right, source)))
    raise CalculatorError(f"{_describe(node)} is not allowed: use numbers, + - * / // % ** and parentheses.")


def _literal(node: ast.Constant, source: str) -> Number:
    value = node.value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculatorError(f"{value!r} is not a number.")
    if isinstance(value, int):
        return value
    return Decimal(ast.get_source_segment(source, node) or repr(value))


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Call):
        return "a function call"
    if isinstance(node, ast.BinOp):
        hint = " (use ** for powers)" if isinstance(node.op, ast.BitXor) else ""
        return f"the operator {type(node.op).__name__}{hint}"
    return f"{type(node).__name__}"


def _add(a: Number, b: Number) -> Number:
    return a + b if _both_int(a, b) else _EXACT.add(Decimal(a), Decimal(b))


def _sub(a: Number, b: Number) -> Number:
    return a - b if _both_int(a, b) else _EXACT.subtract(Decimal(a), Decimal(b))


def _mul(a: Number, b: Number) -> Number:
    # Both factors are within MAX_DIGITS, so the product is cheap to compute before it is checked.
    return a * b if _both_int(a, b) else _EXACT.multiply(Decimal(a), Decimal(b))


def _div(a: Number, b: Number) -> Number:
    _nonzero(b)
    if _both_int(a, b) and a % b == 0:
        return a // b
    return _rounded_quotient(Decimal(a), Decimal(b))


def _floordiv(a: Number, b: Number) -> Number:
    _nonzero(b)
    if _both_int(a, b):
        return a // b
    return _floor_quotient(Decimal(a), Decimal(b))


def _mod(a: Number, b: Number) -> Number:
    _nonzero(b)
    if _both_int(a, b):
        return a % b
    a, b = Decimal(a), Decimal(b)
    return _EXACT.subtract(a, _EXACT.multiply(b, Decimal(_floor_quotient(a, b))))


def _pow(base: Number, exponent: Number) -> Number:
    if isinstance(exponent, Decimal) and exponent == exponent.to_integral_value():
        exponent = int(exponent)
    if isinstance(exponent, Decimal):
        return _fractional_power(Decimal(base), exponent)
    if isinstance(base, Decimal):
        base = base.normalize(_EXACT)  # 1.50 -> 1.5: trailing zeros would multiply in the power
    if exponent < 0:
        _nonzero(base, "0 to a negative power")
        return _rounded_quotient(Decimal(1), Decimal(_pow(base, -exponent)))
    digits = _power_digits(base, exponent)
    if digits > MAX_DIGITS + 1:
        raise CalculatorError(f"the power would have about {digits:.0f} digits; the limit is {MAX_DIGITS}.")
    return base**exponent if isinstance(base, int) else _EXACT.power(base, exponent)


def _power_digits(base: Number, exponent: int) -> float:
    """About how many digits base**exponent has written out exactly (a decimal's coefficient
    carries its fractional digits), computed without the power."""
    coefficient = abs(base) if isinstance(base, int) else int("".join(map(str, base.as_tuple().digits)))
    return 0.0 if coefficient in (0, 1) else exponent * math.log10(coefficient) + 1


def _fractional_power(base: Decimal, exponent: Decimal) -> Decimal:
    if base < 0:
        raise CalculatorError("a negative number to a fractional power has no real value.")
    if base == 0:
        _nonzero(exponent > 0, "0 to a negative power")
        return Decimal(0)
    magnitude = abs(float(exponent)) * (abs(base.adjusted()) + 1)
    if magnitude > MAX_DIGITS:
        raise CalculatorError(f"the power would have about {magnitude:.0f} digits; the limit is {MAX_DIGITS}.")
    context = decimal.Context(prec=int(magnitude) + DIVISION_DIGITS, traps=[decimal.Overflow])
    return context.power(base, exponent)


def _rounded_quotient(a: Decimal, b: Decimal) -> Decimal:
    integer_digits = max(a.adjusted() - b.adjusted() + 1, 0)
    context = decimal.Context(prec=integer_digits + DIVISION_DIGITS, Emax=4 * MAX_DIGITS,
                              Emin=-4 * MAX_DIGITS, traps=[decimal.Overflow, decimal.InvalidOperation])
    return context.divide(a, b)


def _floor_quotient(a: Decimal, b: Decimal) -> int:
    # Decimal's // truncates toward zero; Python's (and this calculator's) floors.
    quotient, remainder = _EXACT.divmod(a, b)
    return int(quotient) - (1 if remainder != 0 and (remainder < 0) != (b < 0) else 0)


def _nonzero(value: Number, what: str = "division by zero") -> None:
    if value == 0:
        raise CalculatorError(f"{what} is undefined.")


def _both_int(a: Number, b: Number) -> bool:
    return isinstance(a, int) and isinstance(b, int)


def _digits(value: Number) -> int:
    """Significant digits, at most one too many (no conversion of a long int to text)."""
    if isinstance(value, int):
        return int(abs(value).bit_length() * _LOG10_2) + 1
    return max(len(value.as_tuple().digits), value.adjusted() + 1)


def _checked(value: Number) -> Number:
    if isinstance(value, int):
        estimate = _digits(value)
        too_big = estimate > MAX_DIGITS and (estimate > MAX_DIGITS + 1 or len(str(abs(value))) > MAX_DIGITS)
    else:
        too_big = value != 0 and (abs(value.adjusted()) > MAX_DIGITS or len(value.as_tuple().digits) > MAX_DIGITS)
    if too_big:
        raise CalculatorError(f"a number in the calculation has more than {MAX_DIGITS} digits; that is the limit.")
    return value


def _format(value: Number) -> str:
    if isinstance(value, int):
        return str(value)
    text = format(value, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


_OPERATORS = {ast.Add: _add, ast.Sub: _sub, ast.Mult: _mul, ast.Div: _div, ast.FloorDiv: _floordiv,
              ast.Mod: _mod, ast.Pow: _pow}
