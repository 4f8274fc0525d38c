"""Every trainer command shown in docs/, README.md, examples/ and recipe/ composes and validates (issue 10
item 12): ``python -m verl.trainer.main_ppo ...`` (also written as ``runpy.run_module('verl.trainer.main_ppo')``
after importing a user module) with the PPO config's compose and validation, and
``python -m verl.trainer.sft_trainer ...`` / ``torchrun ... -m verl.trainer.sft_trainer ...`` with the SFT
trainer's own compose and validation.

Markdown / reST: the command lines (with their ``\\`` continuations) are read from the files; a literal
``...`` ("the rest of your command") is dropped, so a partial command is checked as a user would run it:
with no model path it runs on the embedded demo. Shell scripts are run under bash with ``python``,
``python3`` and ``torchrun`` stubbed (as upstream's example scan did), so their variables and defaults are
expanded by bash itself and nothing is executed.
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
PPO = "verl.trainer.main_ppo"
SFT = "verl.trainer.sft_trainer"
MODULES = (PPO, SFT)
DOC_GLOBS = ("docs/**/*.md", "docs/**/*.rst", "README.md", "examples/**/*.md", "recipe/**/*.md")
SCRIPT_GLOBS = ("examples/**/*.sh", "recipe/**/*.sh")
# `runpy.run_module('verl.trainer.main_ppo', ...)` inside `python -c "..."`: a user module imported first.
RUNPY = re.compile(r"run_module\(\s*['\"](" + "|".join(re.escape(m) for m in MODULES) + r")['\"]")


def _launch(line: str):
    """The module a shell line launches (``-m MODULE`` or ``runpy.run_module('MODULE')``), or None.
    Inline code (a backticked command in prose) and table rows are not commands."""
    for module in MODULES:
        if f"-m {module}" in line and not re.search(r"`[^`]*-m " + re.escape(module), line) and "|" not in line:
            return module
    found = RUNPY.search(line)
    return found.group(1) if found and "|" not in line else None


def _arguments(text: str, module: str) -> list[str]:
    """The trainer's own arguments of a (joined) command line: the words after ``-m MODULE``, or after the
    ``python -c`` program that calls ``runpy.run_module``."""
    text = re.sub(r"\s#.*$", "", text) if "#" in text else text  # trailing shell comments
    words = shlex.split(text, comments=True)
    for i, word in enumerate(words):
        if (word == module and i > 0 and words[i - 1] == "-m") or RUNPY.search(word):
            return [a for a in words[i + 1:] if a != "..." and a != "key=value"]
    raise AssertionError(f"no launch of {module} in {text!r}")


def _doc_commands() -> list[tuple[str, str, list[str]]]:
    """``(file:line, module, arguments)`` of every command in the docs."""
    found = []
    paths = sorted({p for pattern in DOC_GLOBS for p in REPO.glob(pattern)})
    for path in paths:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            module = _launch(lines[i])
            if module is None:
                i += 1
                continue
            start = i
            text = lines[i]
            while text.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text.rstrip()[:-1] + " " + lines[i]
            i += 1
            found.append((f"{path.relative_to(REPO)}:{start + 1}", module, _arguments(text, module)))
    return found


def _script_commands(tmp_path: Path) -> list[tuple[str, str, list[str]]]:
    stub_dir = tmp_path / "bin"
    stub_dir.mkdir()
    log = tmp_path / "calls.jsonl"
    stub = stub_dir / "python"
    # The stub's interpreter is named by absolute path: `env python3` would find the stub itself.
    stub.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    for name in ("python3", "torchrun"):  # torchrun's own flags come before `-m MODULE`, like python's
        (stub_dir / name).symlink_to(stub)
    found = []
    scripts = sorted({p for pattern in SCRIPT_GLOBS for p in REPO.glob(pattern)})
    for script in scripts:
        text = script.read_text()
        mentioned = [m for m in MODULES if m in text]
        if not mentioned:
            continue
        log.write_text("")
        # Variables a script requires without a default get a placeholder (nothing reads them here).
        env = {"PATH": f"{stub_dir}:/usr/bin:/bin", "HOME": str(tmp_path),
               "LORA_ADAPTER_PATH": str(tmp_path / "lora_adapter")}
        proc = subprocess.run(["bash", str(script)], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"{script} failed under the stubs: {proc.stderr[-2000:]}"
        calls = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        launched = [(m, c[c.index(m) + 1:]) for c in calls for m in MODULES if m in c]
        assert launched, f"{script} mentions {mentioned} but never launched it"
        found += [(str(script.relative_to(REPO)), m, args) for m, args in launched]
    return found


def _check_ppo(args: list[str]) -> None:
    from verl.trainer.cli import parse_args
    from verl.trainer.config import compose_config

    parsed = parse_args(args)
    compose_config(parsed.config_name, parsed.overrides, config_dir=parsed.config_dir)  # composes and validates


def _check_sft(args: list[str]) -> None:
    from verl.trainer.sft_trainer import compose_sft_config, validate_sft_config
    from verl.utils.device import get_device_name

    cfg, strategy = compose_sft_config(args)
    # The scripts are written for GPU clusters (trainer.device=cuda); which device this host has is not a
    # property of the command, so the check runs on this host's device and validates everything else.
    cfg.trainer.device = get_device_name()
    validate_sft_config(cfg, strategy)


def _check(where: str, module: str, args: list[str]) -> None:
    try:
        (_check_sft if module == SFT else _check_ppo)(args)
    except Exception as exc:  # noqa: BLE001 - report which command failed
        raise AssertionError(f"{where}: {module} {' '.join(args)}\n{exc}") from exc


DOC_COMMANDS = _doc_commands()


def test_docs_show_commands():
    # The scan itself works: it finds commands of both trainers and the runpy form.
    assert len(DOC_COMMANDS) >= 5
    modules = {m for _, m, _ in DOC_COMMANDS}
    assert modules == {PPO, SFT}, modules
    assert any(w.startswith("docs/advance/fsdp_extension.md") for w, _, _ in DOC_COMMANDS)
    assert any(w.startswith("docs/sft.md") and "model.path=..." in a for w, m, a in DOC_COMMANDS if m == SFT)


def test_runpy_form_reads_the_arguments_after_the_program():
    line = ("python -c \"import my_loaders, runpy; runpy.run_module('verl.trainer.main_ppo', run_name='__main__')\" "
            "a.b=1 ... c=2")
    assert _launch(line) == PPO and _arguments(line, PPO) == ["a.b=1", "c=2"]
    assert _launch("torchrun --nproc_per_node=2 -m verl.trainer.sft_trainer x=1") == SFT
    assert _launch("run `python -m verl.trainer.sft_trainer` for the demo") is None


@pytest.mark.parametrize("where, module, args", DOC_COMMANDS, ids=[w for w, _, _ in DOC_COMMANDS])
def test_doc_command_composes_and_validates(where, module, args):
    _check(where, module, args)


def test_example_and_recipe_scripts_compose_and_validate(tmp_path):
    commands = _script_commands(tmp_path)
    launched = {(Path(w).parts[0], m) for w, m, _ in commands}
    # Both trainers' scripts in examples/, and the recipes, were run and their commands collected.
    assert {("examples", PPO), ("examples", SFT), ("recipe", PPO)} <= launched, launched
    failures = []
    for where, module, args in commands:
        try:
            _check(where, module, args)
        except AssertionError as err:
            failures.append(str(err))
    assert not failures, "\n\n".join(failures)
