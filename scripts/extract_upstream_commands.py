"""Collect the trainer command lines of upstream verl's example scripts into a data file.

    python scripts/extract_upstream_commands.py /path/to/verl            # a checkout (work tree)
    python scripts/extract_upstream_commands.py /path/to/verl/.git      # or a bare git directory (its HEAD)

Upstream's scripts cannot be shipped here; what the tests need is only the argument list each script hands
to ``python -m verl.trainer.main_ppo``. This script runs every ``*.sh`` of the example folders a Qwen3.5 user
would start from (``FOLDERS``) under stand-in commands: ``python3``, ``uv``, ``ray`` and the other tools a
script calls are stubs on PATH that record their arguments and exit 0, so nothing is trained or downloaded.
The script's own defaults fill its variables (``$HOME`` reads as ``/home/user``, ``date`` as a fixed stamp).
The arguments after ``-m verl.trainer.main_ppo`` are written, per script, to
``tests/trainer/data/upstream_example_commands.json`` with upstream's commit; tests/trainer/
test_upstream_examples.py composes and validates each of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "trainer" / "data" / "upstream_example_commands.json"
MODULE = "verl.trainer.main_ppo"
# The example folders of issue 27 (grpo, dapo, gspo, sapo, rollout correction, LoRA, profiling) and the
# folders of the losses / estimators this project implements from upstream (otb, gdpo, prefix grouper).
FOLDERS = ("grpo_trainer", "dapo_trainer", "gspo_trainer", "sapo_trainer", "rollout_correction", "tuning/lora",
           "profile", "otb_trainer", "gdpo_trainer", "prefix_grouper")
STUBS = ("python", "python3", "uv", "ray", "torchrun", "nvidia-smi", "npu-smi", "hf", "huggingface-cli", "wget",
         "curl", "pip", "git")
HOME = "/home/user"
STAMP = "20260101_000000"
# Variables some scripts require without a default (placeholders: nothing reads the paths here).
REQUIRED_ENV = {"HDFS_ROOT": "/hdfs", "DATA_ROOT": f"{HOME}/data", "RAY_DATA_HOME": f"{HOME}/verl",
                "INFER_BACKEND": "vllm", "LORA_ADAPTER_PATH": f"{HOME}/lora_adapter",
                "KIMI_K2_6_MODEL_PATH": "/models/Kimi-K2.6"}


def _examples(source: Path, into: Path) -> tuple[Path, str]:
    """(the examples folder, upstream's commit) from a work tree or a git directory."""
    git_dir = source if (source / "HEAD").is_file() and (source / "objects").is_dir() else source / ".git"
    commit = subprocess.run(["git", f"--git-dir={git_dir}", "rev-parse", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    if (source / "examples").is_dir():
        return source / "examples", commit
    archive = subprocess.run(["git", f"--git-dir={git_dir}", "archive", "HEAD", "examples"], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "examples", commit


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


def extract(source: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        examples, commit = _examples(source, tmp)
        log = tmp / "calls"
        _write_stubs(tmp / "bin", log)
        home = tmp / "home"
        home.mkdir()
        commands: dict[str, dict] = {}
        absent = [f for f in FOLDERS if not (examples / f).is_dir()]
        for folder in FOLDERS:
            for script in sorted((examples / folder).glob("*.sh")) if folder not in absent else ():
                log.write_text("")
                env = {"PATH": f"{tmp / 'bin'}:/usr/bin:/bin", "HOME": str(home), "VERL_USE_UV": "0",
                       "BASH_ENV": str(tmp / "bin" / "bash_env"), **REQUIRED_ENV}
                proc = subprocess.run(["bash", str(script)], cwd=tmp, env=env, capture_output=True, text=True,
                                      timeout=60)
                rel = str(script.relative_to(examples.parent))
                launched = [c for c in _calls(log) if MODULE in c]
                if not launched:
                    commands[rel] = {"error": f"no {MODULE} launch (exit {proc.returncode}): "
                                              f"{proc.stderr.strip().splitlines()[-1:]}"}
                    continue
                call = launched[-1]
                args = [a.replace(str(home), HOME).replace(str(tmp), f"{HOME}/verl")
                        for a in call[call.index(MODULE) + 1:]]
                commands[rel] = {"args": args}
    return {"upstream": "verl-project/verl", "commit": commit, "module": MODULE, "folders": list(FOLDERS),
            "absent_folders": absent, "commands": commands}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    data = extract(Path(argv[0]).resolve())
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    print(f"{len(data['commands'])} scripts from {data['upstream']}@{data['commit'][:10]} -> {OUT.relative_to(REPO)}"
          + (f"; folders absent there: {', '.join(data['absent_folders'])}" if data["absent_folders"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
