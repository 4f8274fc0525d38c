"""Every trainer command shown in docs/, README.md, examples/ and recipe/ composes and validates (issue 10
item 12): ``python -m verl.trainer.main_ppo ...`` (also written as ``runpy.run_module('verl.trainer.main_ppo')``
after importing a user module) with the PPO config's compose and validation, and
``python -m verl.trainer.sft_trainer ...`` / ``torchrun ... -m verl.trainer.sft_trainer ...`` with the SFT
trainer's own compose and validation.

Markdown / reST: the command lines (with their ``\\`` continuations) are read from the files; a literal
``...`` ("the rest of your command") is dropped, so a partial command is checked as a user would run it:
with no model path it runs on the embedded demo. Shell scripts are run under bash in a stand-in checkout
whose ``.venv/bin/python`` is a stub that records its arguments (so their variables and defaults are
expanded by bash itself and nothing is executed).

Issue 25, "commands that run as written in a fresh shell": a fresh shell's ``python`` is not the project's
environment, so every command names the interpreter that the README's set-up creates (``.venv/bin/...``) or
comes after the line that activates a venv; the scripts' bare ``python``/``python3``/``torchrun`` are traps
that fail the test. A few cheap commands (``--help``, ``--cfg job``) are really run, in a clean environment.
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
# The asynchronous modes' entry points (verl.experimental.async_policy) -> their mode.
ASYNC = {"verl.experimental.one_step_off_policy.main_ppo": "one_step_off",
         "verl.experimental.fully_async_policy.fully_async_main": "fully_async"}
MODULES = (PPO, SFT, *ASYNC)
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


# What `bash scripts/setup.sh` creates: the interpreter prefix every documented command must use.
VENV_BIN = ".venv/bin/"
BARE = ("python", "python3", "pip", "pip3", "pytest", "torchrun")


def _stub(path: Path, log: Path, fail: bool = False) -> None:
    """An executable that appends its argv to ``log`` (and fails when ``fail``: a bare interpreter call).
    Its own interpreter is named by absolute path: `env python3` would find a stub on PATH."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(log)!r}, 'a').write(json.dumps([sys.argv[0]] + sys.argv[1:]) + '\\n')\n"
                    + ("sys.exit(97)\n" if fail else ""))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _standin_checkout(tmp_path: Path) -> tuple[Path, Path, Path]:
    """``tmp/repo``: links to this checkout's top-level entries plus a ``.venv/bin/python`` stub, and a
    folder of trap executables (bare ``python``, ``torchrun``, ...) for PATH. Returns (repo, log, traps)."""
    repo, log, traps = tmp_path / "repo", tmp_path / "calls.jsonl", tmp_path / "traps"
    repo.mkdir()
    for entry in REPO.iterdir():
        if entry.name not in (".venv", ".git"):
            (repo / entry.name).symlink_to(entry)
    _stub(repo / ".venv" / "bin" / "python", log)
    for name in BARE:
        _stub(traps / name, log, fail=True)
    return repo, log, traps


def _script_commands(tmp_path: Path) -> list[tuple[str, str, list[str]]]:
    repo, log, traps = _standin_checkout(tmp_path)
    venv_python = str(repo / ".venv" / "bin" / "python")
    found = []
    scripts = sorted({p for pattern in SCRIPT_GLOBS for p in REPO.glob(pattern)})
    for script in scripts:
        text = script.read_text()
        mentioned = [m for m in MODULES if m in text]
        if not mentioned:
            continue
        log.write_text("")
        rel = script.relative_to(REPO)
        # A fresh shell: no PYTHON, the system's PATH with the traps first. Variables a script requires
        # without a default get a placeholder (nothing reads them here).
        env = {"PATH": f"{traps}:/usr/bin:/bin", "HOME": str(tmp_path),
               "LORA_ADAPTER_PATH": str(tmp_path / "lora_adapter")}
        proc = subprocess.run(["bash", str(repo / rel)], env=env, cwd=repo, capture_output=True, text=True,
                              timeout=60)
        calls = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        bare = [c for c in calls if c[0] != venv_python]
        assert not bare, f"{rel} calls {[Path(c[0]).name for c in bare]} from PATH, not {VENV_BIN}python"
        assert proc.returncode == 0, f"{rel} failed under the stubs: {proc.stderr[-2000:]}"
        launched = [(m, c[c.index(m) + 1:]) for c in calls for m in MODULES if m in c]
        assert launched, f"{rel} mentions {mentioned} but never launched it"
        found += [(str(rel), m, args) for m, args in launched]
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


def _check_async(args: list[str], mode: str) -> None:
    from verl.experimental.async_policy.launch import load_async_config

    load_async_config(args, mode)  # composes the mode's config, derives its values and validates


def _check(where: str, module: str, args: list[str]) -> None:
    try:
        if module in ASYNC:
            _check_async(args, ASYNC[module])
        else:
            (_check_sft if module == SFT else _check_ppo)(args)
    except Exception as exc:  # noqa: BLE001 - report which command failed
        raise AssertionError(f"{where}: {module} {' '.join(args)}\n{exc}") from exc


DOC_COMMANDS = _doc_commands()


def test_docs_show_commands():
    # The scan itself works: it finds commands of both trainers and the runpy form.
    assert len(DOC_COMMANDS) >= 5
    modules = {m for _, m, _ in DOC_COMMANDS}
    assert modules == {PPO, SFT, *ASYNC}, modules
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


# --------------------------------------------------------------------------- issue 25: a fresh shell
_COMMAND = re.compile(r"^\s*(?:\$ )?(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(\S+)")
_ACTIVATE = re.compile(r"source \S*bin/activate")


def _interpreter_problems(path: Path, root: Path = REPO) -> list[str]:
    """Lines of ``path`` whose command starts with a bare python / pip / pytest / torchrun before any line
    that activates a venv."""
    problems = []
    activated = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        activated = activated or bool(_ACTIVATE.search(line))
        found = _COMMAND.match(line)
        if found and found.group(1) in BARE and not activated:
            problems.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return problems


def test_setup_creates_the_interpreter_the_docs_name():
    assert 'VENV="$ROOT/.venv"' in (REPO / "scripts" / "setup.sh").read_text()


def test_doc_commands_name_the_projects_interpreter(tmp_path):
    docs = sorted({p for pattern in DOC_GLOBS for p in REPO.glob(pattern)})
    problems = [p for doc in docs for p in _interpreter_problems(doc)]
    assert not problems, ("commands a fresh shell runs with the system's interpreter; write .venv/bin/python "
                          "(or activate the venv first):\n" + "\n".join(problems))
    # The check itself finds a bare command, and accepts one after an activation line.
    sample = tmp_path / "x.md"
    sample.write_text("```bash\nFOO=1 python -m verl.trainer.main_ppo\n.venv/bin/python x.py\n"
                      "source .venv/bin/activate\npytest -q\n```\n")
    assert _interpreter_problems(sample, root=tmp_path) == ["x.md:2: FOO=1 python -m verl.trainer.main_ppo"]


def _clean_run(args: list[str], tmp_path: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run a documented command from the repository root in a clean environment (no PYTHONPATH, no
    activated venv, the system's PATH). ``.venv/bin/python`` is this checkout's when it has one; a git
    worktree that shares another checkout's venv runs it with this test's interpreter (PYTHON=... for the
    scripts), still importing this checkout's ``verl`` from the working directory."""
    venv = REPO / ".venv" / "bin" / "python"
    python = str(venv) if venv.exists() else sys.executable
    args = [python if a == ".venv/bin/python" else a for a in args]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "VERL_DEMO_DIR": str(tmp_path / "demo"),
           "PYTHON": python}
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_readme_and_sft_commands_answer_help_and_cfg_in_a_clean_shell(tmp_path):
    ppo = _clean_run([".venv/bin/python", "-m", PPO, "--cfg", "job", "--package", "trainer"], tmp_path)
    assert ppo.returncode == 0, ppo.stderr[-3000:]
    assert "project_name: verl_demo" in ppo.stdout
    sft = _clean_run([".venv/bin/python", "-m", SFT, "--help"], tmp_path)
    assert sft.returncode == 0 and sft.stdout.startswith(f"usage: python -m {SFT}"), sft.stderr[-3000:]
    assert not (tmp_path / "demo").exists()  # neither built the demo


def test_an_example_script_runs_as_written_in_a_clean_shell(tmp_path):
    # The profiler example on the demo, with --cfg job appended (the scripts pass "$@" on): the real
    # interpreter composes and validates it, and nothing trains.
    proc = _clean_run(["bash", "examples/profiler/run_demo_torch_profile.sh", "--cfg", "job",
                       "--package", "global_profiler"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tool: torch" in proc.stdout


def test_readme_opens_with_the_commands_and_what_they_do():
    """Issue 25: the first screen says what the project is, the set-up and the two commands, what the demo
    prints and how long it took; the feature table and GPU figures follow."""
    text = (REPO / "README.md").read_text()
    first_screen = "\n".join(text.splitlines()[:60])
    for command in ("bash scripts/setup.sh", ".venv/bin/python -m verl.trainer.main_ppo",
                    ".venv/bin/python -m pytest -q"):
        assert command in first_screen, command
    assert "step 1 | score " in first_screen and "2-core CPU" in first_screen
    assert text.index("## Quick start") < text.index("### Where a run's outputs go") < text.index(
        "## Features and status") < text.index("Measured on one H200")
    # The set-up runs once, not in front of every command.
    assert "setup.sh &&" not in text
