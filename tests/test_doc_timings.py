"""Issue 25: documented timings are measurements, labelled with when and on what they were taken.

Claims drifted from measurements ("the suite takes ~10 min" when it took 20 on 2 cores; "about two
minutes" for a 33 s demo). Every duration written in the docs, README, examples, recipes and scripts' comments
(``35 s``, ``~10 min``, ``about two minutes``, ``10-minute``) must have a date (YYYY-MM-DD) and a machine
(``2-core CPU``, ``H100``, ...) in its paragraph or earlier in its section or a section it is nested in (a
"Measured on one H100, 2026-11-25:" lead-in covers the list below it). In shell scripts only comments are
read, each comment block on its own. A limit that is not a measurement is written without a number.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/**/*.md", "docs/**/*.rst", "examples/**/*.md", "recipe/**/*.md")
SCRIPTS = ("examples/**/*.sh", "recipe/**/*.sh", "scripts/*.sh", ".ci/run")

_UNIT = r"(?:ms|s|sec|secs|seconds?|min|mins|minutes?|h|hrs?|hours?)"
DURATION = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:\s?-\s?\d+(?:\.\d+)?)?[ -]?" + _UNIT + r"\b"
                      r"|\b(?:a|one|two|three|four|five|ten|few|several|a couple of) (?:minutes?|hours?)\b"
                      r"|\b(?:two|three|four|five|ten|few|several) seconds\b",
                      re.IGNORECASE)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
MACHINE = re.compile(r"\b(?:\d+-core CPU|CPU|H100|H200|A100|GPU|NPU)s?\b")

def _blocks(path: Path) -> list[tuple[int, str, str]]:
    """``(line, paragraph, scope)`` of a document: the scope is the paragraph's section so far and the
    sections it is nested in, headings included. For shell files: each comment block, its own scope."""
    lines = path.read_text().splitlines()
    if path.suffix not in (".md", ".rst"):
        out, block, start = [], [], 0
        for number, line in enumerate([*lines, ""], 1):
            if line.lstrip().startswith("#") and not line.startswith("#!"):
                start = start if block else number
                block.append(line)
            elif block:
                out.append((start, "\n".join(block), ""))
                block = []
        return out
    out, para, start = [], [], 0
    stack: list[tuple[int, list[str]]] = [(0, [])]  # (heading level, lines) from the file down to here

    def flush():
        if para:
            scope = "\n".join(line for _, section in stack for line in section)
            out.append((start, "\n".join(para), scope))
            stack[-1][1].extend(para)
            para.clear()

    in_fence = False  # a shell comment in a fenced block ("# then ...") is code, not a Markdown heading
    for number, line in enumerate(lines, 1):
        if path.suffix == ".md" and line.lstrip().startswith("```"):
            in_fence = not in_fence
        md_heading = re.match(r"(#+)\s", line) if path.suffix == ".md" and not in_fence else None
        rst_underline = path.suffix == ".rst" and re.fullmatch(r"[=\-~^]{4,}", line.strip() or "x")
        if md_heading or rst_underline:
            title = line if md_heading else (para.pop() if para else "")
            flush()
            level = len(md_heading.group(1)) if md_heading else 1
            while stack[-1][0] >= level:
                stack.pop()
            stack.append((level, [title]))
            out.append((number - (0 if md_heading else 1), title, "\n".join(t for _, sec in stack for t in sec)))
        elif not line.strip():
            flush()
        else:
            start = start if para else number
            para.append(line)
    flush()
    return out


def _unlabelled(path: Path) -> list[str]:
    rel = str(path.relative_to(REPO))
    problems = []
    for line, para, section in _blocks(path):
        scope = section + "\n" + para
        for found in DURATION.finditer(para):
            if not (DATE.search(scope) and MACHINE.search(scope)):
                problems.append(f"{rel}:{line}: {found.group(0)!r} in: {para.strip()[:160]}")
    return problems


def _files(patterns) -> list[Path]:
    return sorted({p for pattern in patterns for p in REPO.glob(pattern) if p.is_file()})


def test_documented_timings_say_when_and_where_they_were_measured():
    problems = [p for f in _files(DOCS) + _files(SCRIPTS) for p in _unlabelled(f)]
    assert not problems, "timings without a date and machine (measure them or remove them):\n" + "\n".join(problems)


def test_the_check_finds_unlabelled_timings(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    doc = tmp_path / "a.md"
    doc.write_text("# Demo (CPU, about two minutes)\n\nIt takes about two minutes.\n\n## Measured\n\nOn 2026-11-26, on a 2-core CPU:\n\n"
                   "- 30 steps in 35 s\n\n### Nested (H200, 2026-11-21 above)\n\n1.5 ms per token\n\n"
                   "## Other\n\nThe suite takes ~10 min. A second run changes nothing.\n")
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/bash\n# first call ~3 minutes\nsleep 5\n# 2026-11-21, one H200: 100 s\n")
    assert [p.split(":")[1] for p in _unlabelled(doc)] == ["1", "3", "17"]
    assert [p.split(":")[1] for p in _unlabelled(script)] == ["2"]


def test_a_shell_comment_in_a_code_block_is_not_a_heading(tmp_path, monkeypatch):
    # "# then ..." inside ``` once reset the section, so every timing after the block lost its dated heading
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    doc = tmp_path / "a.md"
    doc.write_text("## Measured on one H100 (2026-11-28)\n\n```bash\nrun a\n# then\nrun b\n```\n\nStep 2: 19.0 s.\n\n"
                   "# New top section\n\nIt took 5 s.\n")
    assert [p.split(":")[1] for p in _unlabelled(doc)] == ["13"]
