"""Every ``python -m verl.trainer.main_ppo`` command shown in docs/, README.md and examples/ composes and
validates (issue 10 item 12).

Markdown / reST: the command lines (with their ``\\`` continuations) are read from the files; a literal
``...`` ("the rest of your command") is dropped, so a partial command is checked as a user would run it:
with no model path it runs on the embedded demo. Shell scripts are run under bash with ``python`` and
``python3`` stubbed (as upstream's example scan did), so their variables and defaults are expanded by bash
itself and nothing is executed.
"""

from __future__ import annotations

import json
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MARK = "verl.trainer.main_ppo"


def _doc_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in sorted([*REPO.glob("docs/**/*.md"), *REPO.glob("docs/**/*.rst"), REPO / "README.md"]):
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            line = lines[i]
            if f"-m {MARK}" not in line or re.search(r"`[^`]*-m " + re.escape(MARK), line) or "|" in line:
                i += 1
                continue
            start = i
            text = line
            while text.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text.rstrip()[:-1] + " " + lines[i]
            i += 1
            text = re.sub(r"\s#.*$", "", text) if "#" in text else text  # trailing shell comments
            args = shlex.split(text.split(f"-m {MARK}", 1)[1], comments=True)
            args = [a for a in args if a != "..." and a != "key=value"]
            found.append((f"{path.relative_to(REPO)}:{start + 1}", args))
    return found


def _script_commands(tmp_path: Path) -> list[tuple[str, list[str]]]:
    stub_dir = tmp_path / "bin"
    stub_dir.mkdir()
    log = tmp_path / "calls.jsonl"
    stub = stub_dir / "python"
    # The stub's interpreter is named by absolute path: `env python3` would find the stub itself.
    stub.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    (stub_dir / "python3").symlink_to(stub)
    found = []
    for script in sorted(REPO.glob("examples/**/*.sh")):
        if MARK not in script.read_text():
            continue
        log.write_text("")
        # Variables a script requires without a default get a placeholder (nothing reads them here).
        env = {"PATH": f"{stub_dir}:/usr/bin:/bin", "HOME": str(tmp_path),
               "LORA_ADAPTER_PATH": str(tmp_path / "lora_adapter")}
        proc = subprocess.run(["bash", str(script)], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"{script} failed under the python stub: {proc.stderr[-2000:]}"
        calls = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        mains = [c[c.index(MARK) + 1:] for c in calls if MARK in c]
        assert mains, f"{script} mentions {MARK} but never launched it"
        found += [(str(script.relative_to(REPO)), args) for args in mains]
    return found


def _check(where: str, args: list[str]) -> None:
    from verl.trainer.cli import parse_args
    from verl.trainer.config import compose_config

    parsed = parse_args(args)
    try:
        compose_config(parsed.config_name, parsed.overrides, config_dir=parsed.config_dir)
    except Exception as exc:  # noqa: BLE001 - report which command failed
        raise AssertionError(f"{where}: {' '.join(args)}\n{exc}") from exc


DOC_COMMANDS = _doc_commands()


def test_docs_show_commands():
    assert len(DOC_COMMANDS) >= 5  # the scan itself works


@pytest.mark.parametrize("where, args", DOC_COMMANDS, ids=[w for w, _ in DOC_COMMANDS])
def test_doc_command_composes_and_validates(where, args):
    _check(where, args)


def test_example_scripts_compose_and_validate(tmp_path):
    commands = _script_commands(tmp_path)
    assert commands
    failures = []
    for where, args in commands:
        try:
            _check(where, args)
        except AssertionError as err:
            failures.append(str(err))
    assert not failures, "\n\n".join(failures)
