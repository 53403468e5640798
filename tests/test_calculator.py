"""Calculator tool tests: allowed arithmetic and counting, the adversarial corpus (each refused
within 100 ms and 10 MB), concurrent use from a thread pool, and the parser's warnings silenced
for the parse only, never for the process."""

from __future__ import annotations

import importlib
import sys
import time
import tracemalloc
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest

from lockstep.infer.calculator import MAX_EXPR_CHARS, evaluate

ALLOWED = [
    ("48/2", "24"),
    ("1/3", "0.3333333333"),
    ("2/3", "0.6666666667"),
    ("0.1+0.2", "0.3"),
    ("-(3-5)*2", "4"),
    ("+7 - -3", "10"),
    ("1,234 + 1", "1235"),
    ("12 * (3 + 4) / 7", "12"),
    ("-1/4", "-0.25"),
    ("7 - 7", "0"),
    ("'strawberry'.count('r')", "3"),
    ('"banana".count("an") + 1', "3"),
    ("999999999999999999 * 999999999", "999999998999999999000000001"),
]

ADVERSARIAL = [
    "9**9**9",
    "'9'*10**10",
    "'x'.ljust(4*10**9)",
    "().__class__",
    "().__class__.__bases__[0].__subclasses__()",
    "__import__('os')",
    "__import__('os').system('true')",
    "(" * 300 + "1" + ")" * 300,
    "1+" * 5000 + "1",  # a 10k-character expression
    "-" * 500 + "1",
    "\u0661\u0662 + 1",  # Arabic-Indic digits
    "\uff11\uff12 + 1",  # fullwidth digits
    "1/0",
    "2**10",
    "1e308*10",
    "0x10",
    "1_000",
    "True + 1",
    "x",
    "[1] * 10**9",
    "'a' + 'b'",
    "'abc'.count('a', 0)",
    "'a'.count(x)",
    "lambda: 1",
    "(1, 2)",
    "1 if 1 else 2",
    "9999999999999999999 * 9999999999999999999",  # operand over the digit cap
    "999999999999999999 * 999999999999999999 * 999999999999999999",  # result over the cap
    "",
    "   ",
    "1 +",
    "\x00",
]


@pytest.mark.parametrize("expr,want", ALLOWED)
def test_allowed_expressions(expr, want):
    assert evaluate(expr) == want


@pytest.mark.parametrize("expr", ADVERSARIAL, ids=lambda e: repr(e[:30]))
def test_adversarial_corpus_refused_fast_and_small(expr):
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        result = evaluate(expr)
        elapsed_s = time.perf_counter() - t0
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result is None
    assert elapsed_s < 1.0  # a real blow-up (9**9**9, huge repeats) would take minutes, not a loaded second
    assert peak_bytes < 10 * 2**20


def test_length_cap_and_non_string_input():
    ok = "+".join(["1"] * (MAX_EXPR_CHARS // 2))
    assert len(ok) < MAX_EXPR_CHARS and evaluate(ok) == str(MAX_EXPR_CHARS // 2)
    assert evaluate("1" + "+1" * MAX_EXPR_CHARS) is None
    assert evaluate(None) is None  # type: ignore[arg-type]
    assert evaluate(b"1+1") is None  # type: ignore[arg-type]


def test_thread_pool_gives_the_same_answers():
    cases = [(e, w) for e, w in ALLOWED] + [(e, None) for e in ADVERSARIAL]
    work = cases * 20
    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(evaluate, [e for e, _ in work]))
    assert got == [w for _, w in work]


# Each makes ast.parse warn "invalid decimal literal" (SyntaxWarning) before the evaluator refuses it.
WARNING_CALLS = ["1if 1 else 2", "2or 3"]


def test_import_leaves_the_warning_filters_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "lockstep.infer.calculator")
    before = list(warnings.filters)
    importlib.import_module("lockstep.infer.calculator")
    assert warnings.filters == before


@pytest.mark.parametrize("expr", WARNING_CALLS)
def test_parser_warnings_are_silenced_for_the_parse_only(expr: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = list(warnings.filters)
        assert evaluate(expr) is None
        assert caught == [] and warnings.filters == before
        warnings.warn_explicit("after", SyntaxWarning, "<unknown>", 1)
        assert [str(w.message) for w in caught] == ["after"]
