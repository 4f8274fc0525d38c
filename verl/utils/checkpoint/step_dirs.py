"""The checkpoint-directory protocol of every trainer (PPO and SFT alike).

``<trainer.default_local_dir>/global_step_<N>/`` holds step N (one sub-directory per role, plus the trainer's own
state); ``latest_checkpointed_iteration.txt`` next to them names the newest *complete* step. The marker is
written last and atomically, so a crash mid-save leaves the previous step marked; ``trainer.resume_mode=auto``
resumes from the marked step, ``resume_path`` from ``trainer.resume_from_path``, ``disable`` from scratch.

Every file is written under a temporary name and renamed (a failed write leaves no truncated file and removes
its temporary one). Once every part is on disk the trainer writes ``checkpoint_manifest.json`` (each file's
size) into the step directory, then moves the marker. A save that fails (a full disk, a write error) removes
its partial directory and stops the run with a :class:`CheckpointError`; the previous checkpoint stays marked.
On resume a step directory whose manifest disagrees with the disk (a file missing or truncated since) is
refused naming the file, as is a file that fails to load; the error names the earlier complete checkpoints
to resume from instead (``trainer.resume_mode=resume_path``). Upstream's checkpoints (no manifest) are loaded as
they are.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import Callable, Optional

from verl.utils.user_errors import UserFacingError

__all__ = ["LATEST_FILE", "MANIFEST_FILE", "STEP_PREFIX", "CheckpointError", "atomic_torch_save", "check_resumable",
           "checkpoint_root", "complete_steps", "latest_step_dir", "loading", "mark_latest", "prune_steps",
           "resume_dir", "save_failed", "step_dir", "step_of", "torch_load", "write_manifest"]

LATEST_FILE = "latest_checkpointed_iteration.txt"
MANIFEST_FILE = "checkpoint_manifest.json"
STEP_PREFIX = "global_step_"


class CheckpointError(UserFacingError):
    """A checkpoint that could not be written or read: one paragraph naming the file, exit code 1."""

    def __init__(self, message: str, hint: str = "", kind: str = "Checkpoint"):
        super().__init__(kind, message, hint)

    def __reduce__(self):
        return (type(self), (self.message, self.hint, self.kind))


def atomic_torch_save(obj, path: str) -> None:
    """``torch.save`` to ``path.tmp``, then rename: a reader never sees a partial file; on failure (a full
    disk) the temporary file is removed and the error re-raised."""
    import torch

    tmp = path + ".tmp"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def torch_load(path: str, **kwargs):
    """``torch.load`` (CPU, full pickles) whose failure names the file: a truncated or corrupt checkpoint file
    is a :class:`CheckpointError`."""
    import torch

    kwargs.setdefault("map_location", "cpu")
    kwargs.setdefault("weights_only", False)
    try:
        return torch.load(path, **kwargs)
    except (RuntimeError, EOFError, OSError, ValueError, ImportError, AttributeError) as err:
        if isinstance(err, FileNotFoundError):
            raise CheckpointError(f"checkpoint file {path} is missing") from err
        size = os.path.getsize(path) if os.path.exists(path) else 0
        first = " ".join(str(err).split())[:200]
        raise CheckpointError(f"checkpoint file {path} ({size} bytes) cannot be read; it is truncated or corrupt "
                              f"({type(err).__name__}: {first})") from err


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
    """Delete all but the newest ``keep`` step directories up to the marked one (None or <= 0: keep every one).
    Directories newer than the mark (another run's, or an earlier run's that resumed from an older step) are
    not counted and not touched, so the marked step is never the one deleted."""
    if not keep or keep <= 0:
        return
    latest = latest_step_dir(root)
    limit = step_of(latest) if latest is not None else None
    steps = sorted(int(d[len(STEP_PREFIX):]) for d in os.listdir(root) if _is_step_name(d))
    if limit is not None:
        steps = [s for s in steps if s <= limit]
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


# ------------------------------------------------------------------------------------------ completeness
def write_manifest(path: str) -> None:
    """Record every file of the step directory ``path`` with its size (called once all parts are written)."""
    files = {}
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            if name == MANIFEST_FILE or name.endswith(".tmp"):
                continue
            full = os.path.join(dirpath, name)
            files[os.path.relpath(full, path)] = os.path.getsize(full)
    tmp = os.path.join(path, MANIFEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"files": dict(sorted(files.items()))}, f, indent=0)
    os.replace(tmp, os.path.join(path, MANIFEST_FILE))


def manifest_problem(path: str) -> Optional[str]:
    """What is wrong with step directory ``path`` against its manifest (None: complete, or no manifest)."""
    manifest = os.path.join(path, MANIFEST_FILE)
    if not os.path.exists(manifest):
        return None
    try:
        with open(manifest) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"its manifest {manifest} cannot be read ({type(err).__name__}: {err})"
    for rel, size in files.items():
        full = os.path.join(path, rel)
        if not os.path.exists(full):
            return f"{full} is missing"
        actual = os.path.getsize(full)
        if actual != size:
            return f"{full} is {actual} bytes, but {size} were written (truncated or changed since)"
    return None


def complete_steps(root: str, below: Optional[int] = None) -> list[str]:
    """Step directories under ``root`` (below step ``below``) that look complete: a manifest the disk agrees
    with. Newest first."""
    if not os.path.isdir(root):
        return []
    steps = sorted((int(d[len(STEP_PREFIX):]) for d in os.listdir(root) if _is_step_name(d)), reverse=True)
    out = []
    for s in steps:
        path = step_dir(root, s)
        if (below is None or s < below) and os.path.exists(os.path.join(path, MANIFEST_FILE)) \
                and manifest_problem(path) is None:
            out.append(path)
    return out


def _earlier_hint(path: str) -> str:
    root = os.path.dirname(os.path.normpath(path))
    earlier = complete_steps(root, below=step_of(path))
    if earlier:
        return (f"The newest complete checkpoint before it is {earlier[0]}: resume from it with "
                f"trainer.resume_mode=resume_path trainer.resume_from_path={earlier[0]} (or move the damaged "
                "directory away and keep trainer.resume_mode=auto), or start fresh with trainer.resume_mode=disable.")
    return "No complete checkpoint precedes it; start fresh with trainer.resume_mode=disable."


def check_resumable(path: str) -> None:
    """Refuse to resume from ``path`` when it is missing or its files disagree with its manifest."""
    if not os.path.isdir(path):
        raise CheckpointError(f"the checkpoint directory {path} does not exist", _earlier_hint(path))
    problem = manifest_problem(path)
    if problem:
        raise CheckpointError(f"cannot resume from {path}: {problem}", _earlier_hint(path))


@contextlib.contextmanager
def loading(path: str):
    """Around the loads of one step directory: a file that fails to load (in this process or a worker) is a
    :class:`CheckpointError` naming it, with the earlier checkpoints to resume from."""
    try:
        yield
    except CheckpointError as err:
        raise CheckpointError(err.message, _earlier_hint(path)) from err
    except Exception as err:  # noqa: BLE001 - a worker's load error arrives wrapped (Ray); name the directory
        if not isinstance(err, CheckpointError) and isinstance(getattr(err, "cause", None), CheckpointError):
            raise CheckpointError(err.cause.message, _earlier_hint(path)) from err
        raise


def save_failed(root: str, path: str, err: BaseException) -> CheckpointError:
    """The error for a save of ``path`` that failed with ``err``: the partial directory is removed (a full disk
    gets its space back), the marked checkpoint is untouched."""
    latest = latest_step_dir(root)
    removed = ""
    if os.path.isdir(path) and (latest is None or os.path.normpath(latest) != os.path.normpath(path)):
        shutil.rmtree(path, ignore_errors=True)
        removed = f"; the partial {os.path.basename(path)} was removed"
    cause = getattr(err, "cause", None) or err
    text = " ".join(str(cause).split())[:300]
    where = f"{latest} is still the latest complete checkpoint" if latest else "no earlier checkpoint exists"
    return CheckpointError(
        f"saving the checkpoint {path} failed ({type(cause).__name__}: {text}){removed}; {where} "
        f"({LATEST_FILE} unchanged)",
        "Free disk space or fix the directory's permissions (trainer.default_local_dir), then start the same "
        "command again: trainer.resume_mode=auto resumes from the latest complete checkpoint.")
