"""Math answer rewards: math-verify (the default: LaTeX and plain answers parsed to sympy and compared
symbolically), and a small parser of our own (the last `\\boxed{}` or number, compared numerically) used only where
math-verify is not installed.

math-verify bounds its parsing and comparison with `signal.alarm`, which works only in a process's main thread:
in the driver's reward processes (`rollout/rewards/processes.py`, where `task.reward_isolation: auto` runs these
rewards) its own timeouts apply, on its reward threads they are off; `task.reward_timeout_s` bounds the call either
way.
"""

from __future__ import annotations

import math
import numbers
import re
import threading
from typing import Any

MATH_VERIFY_TIMEOUT_S = 5
"""math-verify's own limit on one parse or comparison, in the main thread only (it uses signals)."""
_DELIMITED = ("$", "\\boxed", "\\[", "\\(")


def _math_verify():
    """The math_verify module, or None where it is not installed (the basic parser stands in)."""
    try:
        import math_verify  # sympy and ANTLR take a second to import: only where a math reward runs
    except ImportError:
        return None
    return math_verify


def _own_timeout() -> int | None:
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _gold_text(answer: Any) -> str:
    """A reference answer as text math-verify reads: numbers as they print, GSM8K's `#### 42` as `42`, bare
    LaTeX (`\\frac{1}{2}`) inside `$...$` so that its LaTeX extraction finds it."""
    text = str(answer).strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip()
    return text if any(mark in text for mark in _DELIMITED) else f"${text}$"


def math_verify_reward(response: str, answer: Any, sample: Any = None) -> float:
    """1.0 when math-verify finds the response's final answer equal to the reference `answer`, else 0.0.

    The response's answer is its last `\\boxed{}`, else its last LaTeX or plain expression; the reference may
    be a number, LaTeX (with or without `$`), `\\boxed{...}` or `#### 42`.
    """
    math_verify = _math_verify()
    if math_verify is None:
        raise ImportError("math_verify_reward needs math-verify: pip install 'math-verify[antlr4_13_2]'")
    timeout = _own_timeout()
    gold = math_verify.parse(_gold_text(answer), parsing_timeout=timeout)
    if not gold:
        gold = math_verify.parse(str(answer), parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math-verify cannot read the reference answer {answer!r}")
    predicted = math_verify.parse(response, parsing_timeout=timeout)
    return 1.0 if predicted and math_verify.verify(gold, predicted, timeout_seconds=timeout) else 0.0


# ----------------------------------------------------------------------------------------------------------------
# The basic parser: the last \boxed{...} or else the last number of the response, compared numerically.

# Thousands separators only in groups of three, so that a list "1,2,3" does not read as 123.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\d?frac\{([^{}]+)\}\{([^{}]+)\}")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None


def parse_number(text: str) -> float | None:
    """The value of a number written as an integer, decimal, `1,234`, `a/b` or `\\frac{a}{b}`; else None."""
    text = text.strip().strip("$").strip()
    frac = _FRAC.fullmatch(text)
    if frac:
        num, den = parse_number(frac.group(1)), parse_number(frac.group(2))
        return None if num is None or den in (None, 0) else num / den
    text = text.replace(",", "")
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return float(num) / float(den) if float(den) != 0 else None
        return float(text)
    except ValueError:
        return None


def extract_answer(text: str) -> str | None:
    """The final answer of a response: the last `\\boxed{...}`, else the last number, else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers_found = _NUMBER.findall(_FRAC.sub(lambda m: f"{m.group(1)}/{m.group(2)}", text))
    return numbers_found[-1] if numbers_found else None


def _reference_value(answer: Any) -> tuple[float | None, str]:
    """Numeric value and normalised text of a reference answer (number, '42', '#### 42', '\\boxed{42}')."""
    if isinstance(answer, numbers.Real) and not isinstance(answer, bool):
        return float(answer), str(answer)
    text = str(answer)
    value = parse_number(text)
    if value is None:
        extracted = extract_answer(text)
        if extracted is not None:
            text, value = extracted, parse_number(extracted)
    return value, _normalise(text)


def _normalise(text: str) -> str:
    return re.sub(r"\s+", "", text).strip("$.").lower()


def basic_math_reward(response: str, answer: Any, sample: Any = None) -> float:
    """1.0 when the response's final answer (last `\\boxed{}` or last number) equals the reference, else 0.0.

    Numbers compare with relative tolerance 1e-6; non-numeric answers compare as whitespace-free lower-case text.
    Far weaker than math-verify (`x=3`, `\\sqrt 2`, `(1, 2)` or `10\\%` all fail): only its stand-in.
    """
    got = extract_answer(response)
    if got is None:
        return 0.0
    ref_value, ref_text = _reference_value(answer)
    value = parse_number(got)
    if ref_value is not None and value is not None:
        return 1.0 if math.isclose(value, ref_value, rel_tol=1e-6, abs_tol=1e-9) else 0.0
    return 1.0 if _normalise(got) == ref_text else 0.0


def math_reward(response: str, answer: Any, sample: Any = None) -> float:
    """The default math reward: math-verify where it is installed, else the basic parser."""
    if _math_verify() is None:
        return basic_math_reward(response, answer, sample)
    return math_verify_reward(response, answer, sample)


math_reward.warm_up = math_verify_reward.warm_up = _math_verify  # a reward process imports math-verify at start
