"""Rule reward for GSM8K: compare the model's final number with the reference answer.

``strict`` only accepts the dataset's own ``#### <number>`` answer line (so it also rewards the format);
``flexible`` takes the last number anywhere in the response.
"""

from __future__ import annotations

import re

# Answers sit at the end; matching only the tail keeps regex cost bounded on very long responses.
_TAIL_CHARS = 300
_STRICT_RE = re.compile(r"####\s*\$?\s*(-?[0-9][0-9.,]*|-?\.[0-9]+)")
_NUMBER_RE = re.compile(r"-?[0-9.,]+")


def _clean_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").rstrip(".")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer as a string without thousands separators, or None when there is none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k.extract_solution: method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-_TAIL_CHARS:]
    if method == "strict":
        found = _STRICT_RE.findall(tail)
        return _clean_number(found[-1]) if found else None
    for candidate in reversed(_NUMBER_RE.findall(tail)):
        cleaned = _clean_number(candidate)
        if cleaned not in ("", "-"):
            return cleaned
    return None


def _same_number(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    """``score`` for a correct answer, ``format_score`` for a wrong but extractable one, 0 when none is found."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return score if _same_number(answer, _clean_number(str(ground_truth).strip())) else format_score
