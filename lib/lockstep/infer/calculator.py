"""The model's calculator tool: an allowlist evaluator over Python's parsed syntax tree for
arithmetic and `'text'.count('t')`. It never calls `eval`, never raises to its caller, and is
not a general Python sandbox."""

from __future__ import annotations

import ast
import re
import threading
import warnings
from fractions import Fraction

# The text the engine forces between <|output_start|> and <|output_end|> when evaluate() refuses.
NO_RESULT = "no result"

MAX_EXPR_CHARS = 512  # longer tool calls are refused before parsing
MAX_SIGN_RUN = 4  # consecutive +/- signs (unary nesting), checked on the raw text
_SIGN_RUN = re.compile(r"[+\-](?:\s*[+\-]){%d,}" % MAX_SIGN_RUN)
MAX_PAREN_DEPTH = 32  # checked on the raw text, so the parser never sees deep nesting
MAX_TREE_DEPTH = 300  # nodes on one root-to-leaf path (`1+1+...` chains, `--1`); bounds recursion
MAX_STRING_CHARS = 256  # a string literal in .count()
MAX_DIGITS = 18  # per numeric literal, integer and fraction digits together
# Every intermediate value's numerator and denominator stay below this, so a multiplication
# chain inside the length cap cannot build a huge integer (each op costs microseconds).
MAX_MAGNITUDE = 10**30
RESULT_DECIMALS = 10

# warnings.catch_warnings swaps the process-wide filter list on entry and back on exit, so two
# calls inside it at once could restore each other's list; parses take microseconds, so they queue.
_PARSE_LOCK = threading.Lock()

_ALLOWED_CHARS = frozenset(
    "0123456789.+-*/() \t'\"_,abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ!?:;#&%$@=<>[]{}|~^`"
)


class _Refused(Exception):
    """Raised inside the evaluator; evaluate() turns it into None."""


def evaluate(expr: str) -> str | None:
    """The value of `expr` as text, or None ("no result") if it is not an allowed expression or
    breaks a cap. Allowed: int and decimal literals, + - * /, parentheses, unary minus and plus,
    and `'literal'.count('literal')`. Arithmetic is exact (fractions); results print as an
    integer when whole, else rounded to 10 decimals with trailing zeros dropped. Thousands
    separators between digits (`1,000`) are accepted, as GSM8K writes them.

    Safe to call from many threads at once: no signals, bounded work, and the one global it
    touches (the warning filters, around the parse) behind a lock."""
    try:
        if not isinstance(expr, str):
            return None
        text = expr.strip()
        if not text or len(text) > MAX_EXPR_CHARS:
            return None
        # ASCII only: unicode digits and look-alike operators are refused, not normalised.
        if not set(text) <= _ALLOWED_CHARS:
            return None
        depth = 0
        for ch in text:
            depth += ch == "("
            depth -= ch == ")"
            if depth > MAX_PAREN_DEPTH:
                return None
        # Long runs of signs (`- - - ... 1`) nest one unary node per sign; refuse them before the
        # parser, whose recursion-limit error is not thread-safe on CPython 3.11 (it surfaces
        # as "AST constructor recursion depth mismatch" in another thread).
        if _SIGN_RUN.search(text):
            return None
        text = _drop_thousands_commas(text)
        tree = _parse(text)
        value = _eval(tree.body, text, 0)
        if isinstance(value, str):
            return None
        return _format(value)
    except (
        _Refused,
        SyntaxError,
        ValueError,
        ZeroDivisionError,
        RecursionError,
        MemoryError,
        OverflowError,
        SystemError,
    ):
        return None


def _parse(text: str) -> ast.Expression:
    """`ast.parse(text, mode="eval")` without the parser's SyntaxWarnings. Model-written tool
    calls such as `12a` or `1if 2` make it warn on stderr before the evaluator refuses them; a
    refusal is already the answer, so the warnings are noise in logs and chat sessions. The filter
    holds for this call only: the process's filters are the same before and after."""
    with _PARSE_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        return ast.parse(text, mode="eval")


def _drop_thousands_commas(text: str) -> str:
    """`1,234,567` -> `1234567` outside string literals; any other comma is left for the parser
    to refuse (tuples are not allowed)."""
    out = []
    quote = None
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "," and 0 < i < len(text) - 4 and text[i - 1].isdigit() and text[i + 1 : i + 4].isdigit():
            after = text[i + 4] if i + 4 < len(text) else ""
            if not after.isdigit():
                continue
        out.append(ch)
    return "".join(out)


def _check(value: Fraction) -> Fraction:
    if abs(value.numerator) >= MAX_MAGNITUDE or value.denominator >= MAX_MAGNITUDE:
        raise _Refused
    return value


def _eval(node: ast.AST, src: str, depth: int) -> Fraction | str:
    if depth > MAX_TREE_DEPTH:
        raise _Refused
    depth += 1
    if isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise _Refused
        if isinstance(v, str):
            if len(v) > MAX_STRING_CHARS:
                raise _Refused
            return v
        return _literal(src[node.col_offset : node.end_col_offset])
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _number(_eval(node.operand, src, depth))
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        a, b = _number(_eval(node.left, src, depth)), _number(_eval(node.right, src, depth))
        if isinstance(node.op, ast.Add):
            return _check(a + b)
        if isinstance(node.op, ast.Sub):
            return _check(a - b)
        if isinstance(node.op, ast.Mult):
            return _check(a * b)
        if b == 0:
            raise _Refused
        return _check(a / b)
    if isinstance(node, ast.Call):
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr == "count"
            and isinstance(func.value, ast.Constant)
            and isinstance(func.value.value, str)
            and len(node.args) == 1
            and not node.keywords
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            haystack, needle = func.value.value, node.args[0].value
            if len(haystack) > MAX_STRING_CHARS or len(needle) > MAX_STRING_CHARS:
                raise _Refused
            return Fraction(haystack.count(needle))
    raise _Refused


def _literal(text: str) -> Fraction:
    """A numeric literal from its source text (not the float Python parsed), so `0.1` is exactly
    1/10. Exponents, hex, octal, binary, underscores and complex literals are refused."""
    if not text or not set(text) <= set("0123456789.") or text.count(".") > 1:
        raise _Refused
    if sum(ch.isdigit() for ch in text) > MAX_DIGITS:
        raise _Refused
    return _check(Fraction(text))


def _number(v: Fraction | str) -> Fraction:
    if isinstance(v, str):
        raise _Refused
    return v


def _format(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    scaled = round(value * 10**RESULT_DECIMALS)  # round half to even, exact
    sign = "-" if scaled < 0 else ""
    whole, frac = divmod(abs(scaled), 10**RESULT_DECIMALS)
    frac_text = str(frac).rjust(RESULT_DECIMALS, "0").rstrip("0")
    if not frac_text:
        return f"{sign}{whole}" if whole else "0"
    return f"{sign}{whole}.{frac_text}"
