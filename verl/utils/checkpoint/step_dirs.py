"""The checkpoint-directory protocol of every trainer (PPO and SFT alike).

``<trainer.default_local_dir>/global_step_<N>/`` holds step N (one sub-directory per role, plus the trainer's own
state); ``latest_checkpointed_iteration.txt`` next to them names the newest *complete* step. The marker is
written last and atomically, so a crash mid-save leaves the previous step marked; ``trainer.resume_mode=auto``
resumes from the marked step, ``resume_path`` from ``trainer.resume_from_path``, ``disable`` from scratch.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable, Optional

__all__ = ["LATEST_FILE", "STEP_PREFIX", "checkpoint_root", "latest_step_dir", "mark_latest", "prune_steps",
           "resume_dir", "step_dir", "step_of"]

LATEST_FILE = "latest_checkpointed_iteration.txt"
STEP_PREFIX = "global_step_"


def checkpoint_root(default_local_dir: str) -> str:
    return os.path.abspath(os.path.expanduser(str(default_local_dir)))


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"{STEP_PREFIX}{int(step)}")


def step_of(path: str) -> int:
    """``.../global_step_N`` -> N."""
    return int(os.path.basename(os.path.normpath(str(path)))[len(STEP_PREFIX):])


def _is_step_name(name: str) -> bool:
    return name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX):].isdigit()


def mark_latest(root: str, step: int) -> None:
    """Name ``step`` the newest complete checkpoint (atomic: the old mark stands until the rename)."""
    tmp = os.path.join(root, LATEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(int(step)))
    os.replace(tmp, os.path.join(root, LATEST_FILE))


def latest_step_dir(root: str) -> Optional[str]:
    """The marked step's directory, or None when nothing was marked yet."""
    marker = os.path.join(root, LATEST_FILE)
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        return step_dir(root, int(f.read().strip()))


def prune_steps(root: str, keep: Optional[int]) -> None:
    """Delete all but the newest ``keep`` step directories (None or <= 0: keep every one)."""
    if not keep or keep <= 0:
        return
    steps = sorted(int(d[len(STEP_PREFIX):]) for d in os.listdir(root) if _is_step_name(d))
    for s in steps[:-keep]:
        shutil.rmtree(step_dir(root, s), ignore_errors=True)


def resume_dir(trainer_cfg, error: Callable[[str], Exception] = ValueError) -> Optional[str]:
    """The step directory ``trainer.resume_mode`` asks to resume from (None: start fresh). ``error`` builds the
    exception for a misconfigured resume (each trainer reports config problems its own way)."""
    mode = trainer_cfg.get("resume_mode", "auto")
    if mode == "disable":
        return None
    if mode == "resume_path":
        path = trainer_cfg.get("resume_from_path")
        if not path or not os.path.basename(os.path.normpath(str(path))).startswith(STEP_PREFIX):
            raise error("trainer.resume_mode=resume_path needs trainer.resume_from_path pointing at a "
                        f".../global_step_N directory (got {path!r})")
        return os.path.abspath(os.path.expanduser(str(path)))
    if mode != "auto":
        raise error(f"trainer.resume_mode={mode!r}; expected auto, disable or resume_path")
    return latest_step_dir(checkpoint_root(trainer_cfg.default_local_dir))
