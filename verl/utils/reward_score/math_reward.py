"""Rule reward for MATH-style data: compare the last ``\\boxed{...}`` answer with the reference.

Both sides go through :func:`strip_string`, a string normaliser for the LaTeX spellings that commonly differ
between a model and the reference (``\\dfrac`` vs ``\\frac``, ``\\frac12``, ``a/b``, units, degrees, percent,
``x = `` prefixes, spaces). It is a string match, not a symbolic one.
"""

from __future__ import annotations

import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed_only_string(string: str) -> str | None:
    """The last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced) or ``\\boxed x`` in ``string``, else None."""
    start = string.rfind("\\boxed")
    command = "\\boxed"
    if start < 0:
        start = string.rfind("\\fbox")
        command = "\\fbox"
        if start < 0:
            return None
    after = string[start + len(command) :]
    if after.startswith(" "):
        # "\boxed 5$": the argument runs to the closing dollar (or the end).
        return command + " " + after[1:].split("$", 1)[0]
    depth = 0
    for pos in range(start + len(command), len(string)):
        ch = string[pos]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return string[start : pos + 1]
        elif depth == 0 and not ch.isspace():
            return None  # a bare "\boxed" without an argument
    return None


def remove_boxed(s: str) -> str:
    """The argument of a string returned by :func:`last_boxed_only_string`."""
    for command in _BOX_COMMANDS:
        if s.startswith(command + " "):
            return s[len(command) + 1 :]
        if s.startswith(command + "{") and s.endswith("}"):
            return s[len(command) + 1 : -1]
    raise ValueError(f"remove_boxed: {s[:60]!r} is not a \\boxed{{...}} / \\fbox{{...}} expression")


def _read_group(s: str, pos: int) -> tuple[str, int] | None:
    """One TeX argument at ``pos``: a braced group (without braces) or a single character."""
    if pos >= len(s):
        return None
    if s[pos] != "{":
        return s[pos], pos + 1
    depth = 0
    for end in range(pos, len(s)):
        if s[end] == "{":
            depth += 1
        elif s[end] == "}":
            depth -= 1
            if depth == 0:
                return s[pos + 1 : end], end + 1
    return None


def _brace_fracs(s: str) -> str:
    """``\\frac12`` / ``\\frac1{72}`` / ``\\frac{a}b`` -> ``\\frac{1}{2}`` ... (both arguments braced)."""
    out, pos = [], 0
    while True:
        hit = s.find("\\frac", pos)
        if hit < 0:
            out.append(s[pos:])
            return "".join(out)
        out.append(s[pos : hit + 5])
        num = _read_group(s, hit + 5)
        den = _read_group(s, num[1]) if num else None
        if num is None or den is None:
            out.append(s[hit + 5 :])
            return "".join(out)
        out.append("{" + num[0] + "}{" + den[0] + "}")
        pos = den[1]


def _slash_to_frac(s: str) -> str:
    match = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{match.group(1)}}}{{{match.group(2)}}}" if match else s


def strip_string(string: str) -> str:
    """Normalise a LaTeX answer so equivalent spellings compare equal as strings."""
    s = string.replace("\n", "").replace("\\!", "")
    s = s.replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    # "\text{ cm}" style trailing units: a space right after "\text{" marks a unit in MATH answers.
    unit = s.find("\\text{ ")
    if unit >= 0:
        s = s[:unit]
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s.startswith("."):
        s = "0" + s
    # "k = 5" / "x=5" -> "5" (only a short left-hand side, so equations are left alone).
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0].strip()) <= 2:
        s = sides[1]
    s = re.sub(r"\\sqrt([^{\\\s])", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    s = _brace_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_to_frac(s)


def is_equiv(str1: str | None, str2: str | None, verbose: bool = False) -> bool:
    """Equal after :func:`strip_string` (raw equality if normalising fails)."""
    if str1 is None or str2 is None:
        return str1 is None and str2 is None
    try:
        a, b = strip_string(str1), strip_string(str2)
    except Exception:
        return str1 == str2
    if verbose:
        print(a, b)
    return a == b


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 when the last boxed answer matches ``ground_truth`` after normalisation, else 0.0."""
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    try:
        answer = remove_boxed(boxed)
    except ValueError:
        return 0.0
    return 1.0 if is_equiv(answer, str(ground_truth)) else 0.0
