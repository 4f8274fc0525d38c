"""Collect the trainer command lines of upstream verl's example scripts into a data file.

    python scripts/extract_upstream_commands.py /path/to/verl            # a checkout (work tree)
    python scripts/extract_upstream_commands.py /path/to/verl/.git      # or a bare git directory (its HEAD)
    python scripts/extract_upstream_commands.py --suite async /path/to/verl   # the asynchronous modes' scripts

Upstream's scripts cannot be shipped here; what the tests need is only the argument list each script hands
to ``python -m verl.trainer.main_ppo``. This script runs every ``*.sh`` of the example folders a Qwen3.5 user
would start from (``SUITES``) under stand-in commands: ``python3``, ``uv``, ``ray`` and the other tools a
script calls are stubs on PATH that record their arguments and exit 0, so nothing is trained or downloaded.
The script's own defaults fill its variables (``$HOME`` reads as ``/home/user``, ``date`` as a fixed stamp).
The arguments after ``-m verl.trainer.main_ppo`` are written, per script, to
``tests/trainer/data/upstream_example_commands.json`` with upstream's commit; tests/trainer/
test_upstream_examples.py composes and validates each of them.

``--suite async`` does the same for the shell folders of upstream's asynchronous entry points
(``verl/experimental/{fully_async_policy,one_step_off_policy}/shell``): each script's arguments after whichever
of the two modules it launches, with the module, to ``tests/experimental/async_policy/data/
upstream_async_commands.json`` (tests/experimental/async_policy/test_upstream_async_scripts.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Suite:
    out: Path
    tree: str  # the upstream folder the script folders are under
    folders: tuple[str, ...]
    modules: tuple[str, ...]  # the entry points a script of the suite launches


SUITES = {
    # The example folders of issue 27 (grpo, dapo, gspo, sapo, rollout correction, LoRA, profiling) and the
    # folders of the losses / estimators this project implements from upstream (otb, gdpo, prefix grouper).
    "examples": Suite(REPO / "tests" / "trainer" / "data" / "upstream_example_commands.json", "examples",
                      ("grpo_trainer", "dapo_trainer", "gspo_trainer", "sapo_trainer", "rollout_correction",
                       "tuning/lora", "profile", "otb_trainer", "gdpo_trainer", "prefix_grouper"),
                      ("verl.trainer.main_ppo",)),
    # Issue 26: the asynchronous modes' own scripts (their colocated baselines launch main_ppo).
    "async": Suite(REPO / "tests" / "experimental" / "async_policy" / "data" / "upstream_async_commands.json",
                   "verl/experimental", ("fully_async_policy/shell", "one_step_off_policy/shell"),
                   ("verl.experimental.fully_async_policy.fully_async_main",
                    "verl.experimental.one_step_off_policy.main_ppo", "verl.trainer.main_ppo")),
}
STUBS = ("python", "python3", "uv", "ray", "torchrun", "nvidia-smi", "npu-smi", "hf", "huggingface-cli", "wget",
         "curl", "pip", "git")
HOME = "/home/user"
STAMP = "20260101_000000"
# Variables some scripts require without a default (placeholders: nothing reads the paths here).
REQUIRED_ENV = {"HDFS_ROOT": "/hdfs", "DATA_ROOT": f"{HOME}/data", "RAY_DATA_HOME": f"{HOME}/verl",
                "INFER_BACKEND": "vllm", "LORA_ADAPTER_PATH": f"{HOME}/lora_adapter",
                "KIMI_K2_6_MODEL_PATH": "/models/Kimi-K2.6"}


def _examples(source: Path, into: Path, tree: str) -> tuple[Path, Path, str]:
    """(the checkout's root, its folder ``tree``, upstream's commit) from a work tree or a git directory."""
    git_dir = source if (source / "HEAD").is_file() and (source / "objects").is_dir() else source / ".git"
    commit = subprocess.run(["git", f"--git-dir={git_dir}", "rev-parse", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    if (source / tree).is_dir():
        return source, source / tree, commit
    archive = subprocess.run(["git", f"--git-dir={git_dir}", "archive", "HEAD", tree], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into, into / tree, commit


def _write_stubs(folder: Path, log: Path) -> None:
    folder.mkdir()
    for name in STUBS:
        stub = folder / name
        # Each call appends its argv as one JSON line; nothing else happens.
        stub.write_text("#!/usr/bin/env bash\n"
                        f'printf "%s\\0" "$0" "$@" >> "{log}"; printf "\\n" >> "{log}"\n')
        stub.chmod(0o755)
    (folder / "date").write_text(f"#!/usr/bin/env bash\necho {STAMP}\n")
    (folder / "date").chmod(0o755)
    # Sourced by the non-interactive bash first: raising the open-files limit is not allowed here.
    (folder / "bash_env").write_text("ulimit() { :; }\n")


def _calls(log: Path) -> list[list[str]]:
    text = log.read_text() if log.exists() else ""
    return [[a for a in line.split("\0") if a != ""] for line in text.split("\0\n") if line.strip("\0\n")]


def extract(source: Path, suite: Suite = SUITES["examples"]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        root, examples, commit = _examples(source, tmp, suite.tree)
        log = tmp / "calls"
        _write_stubs(tmp / "bin", log)
        home = tmp / "home"
        home.mkdir()
        commands: dict[str, dict] = {}
        absent = [f for f in suite.folders if not (examples / f).is_dir()]
        for folder in suite.folders:
            for script in sorted((examples / folder).glob("*.sh")) if folder not in absent else ():
                log.write_text("")
                env = {"PATH": f"{tmp / 'bin'}:/usr/bin:/bin", "HOME": str(home), "VERL_USE_UV": "0",
                       "BASH_ENV": str(tmp / "bin" / "bash_env"), **REQUIRED_ENV}
                proc = subprocess.run(["bash", str(script)], cwd=tmp, env=env, capture_output=True, text=True,
                                      timeout=60)
                rel = str(script.relative_to(root))
                launched = [(c, m) for c in _calls(log) for m in suite.modules if m in c]
                if not launched:
                    commands[rel] = {"error": f"no {' / '.join(suite.modules)} launch (exit {proc.returncode}): "
                                              f"{proc.stderr.strip().splitlines()[-1:]}"}
                    continue
                call, module = launched[-1]
                args = [a.replace(str(home), HOME).replace(str(tmp), f"{HOME}/verl")
                        for a in call[call.index(module) + 1:]]
                commands[rel] = {"args": args} if len(suite.modules) == 1 else {"module": module, "args": args}
    out = {"upstream": "verl-project/verl", "commit": commit}
    out.update({"module": suite.modules[0]} if len(suite.modules) == 1 else {"modules": list(suite.modules)})
    out.update({"folders": list(suite.folders), "absent_folders": absent, "commands": commands})
    return out


def main(argv: list[str]) -> int:
    name = "examples"
    if argv[:1] == ["--suite"] and len(argv) >= 2:
        name, argv = argv[1], argv[2:]
    if len(argv) != 1 or name not in SUITES:
        print(__doc__, file=sys.stderr)
        return 2
    suite = SUITES[name]
    data = extract(Path(argv[0]).resolve(), suite)
    out = suite.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    print(f"{len(data['commands'])} scripts from {data['upstream']}@{data['commit'][:10]} -> {out.relative_to(REPO)}"
          + (f"; folders absent there: {', '.join(data['absent_folders'])}" if data["absent_folders"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
