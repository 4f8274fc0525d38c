"""What a run needs from this host - the model directory, the data files - checked before the config's
batch-size arithmetic, so the first lines of an error are the ones a user can act on (issue 25).

``validate_config`` / ``validate_sft_config`` stay pure functions of the config (the docs-command test
validates commands whose paths exist only on a GPU cluster); the entry points call :func:`validate_in_order`,
which lists the problems found here first and the config's own problems after them, in one error.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable

from omegaconf import DictConfig, OmegaConf

__all__ = ["host_problems", "validate_in_order"]


def _files(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def _model_problem(key: str, value) -> str | None:
    from verl.utils.model_path import is_hub_id

    if value is None or str(value) == "":
        return None  # "not set" is the config validation's message
    raw = str(value)
    if "://" in raw or os.path.isdir(os.path.expanduser(raw)):
        return None
    if is_hub_id(raw):
        return None  # fetched (or found in the HF cache) when the model loads
    if os.path.exists(os.path.expanduser(raw)):
        return f"`{key}={raw}` is a file; point it at the checkpoint's directory (config.json + weights)"
    return (f"`{key}={raw}`: no such directory (and not a Hugging Face Hub id like Qwen/Qwen3.5-9B); point it "
            "at a local checkpoint directory")


def host_problems(cfg: DictConfig, model_keys: Iterable[str], data_keys: Iterable[str]) -> list[str]:
    """Model paths that are neither a local directory nor a hub id, and local data files that do not exist.
    Remote URLs (``hdfs://``, ``s3://``, ...) are left to the loaders."""
    problems = []
    for key in model_keys:
        problem = _model_problem(key, OmegaConf.select(cfg, key))
        if problem:
            problems.append(problem)
    for key in data_keys:
        for path in _files(OmegaConf.select(cfg, key)):
            if "://" not in path and not os.path.exists(os.path.expanduser(path)):
                problems.append(f"`{key}`: {path} does not exist")
    return problems


def validate_in_order(cfg: DictConfig, first: list[str], validate: Callable[[DictConfig], None]) -> None:
    """Run ``validate(cfg)``; raise one ConfigValidationError with ``first`` (paths, device) before the
    problems ``validate`` found, or nothing when both are empty."""
    from verl.trainer.config.checks import ConfigValidationError

    rest: list[str] = []
    try:
        validate(cfg)
    except ConfigValidationError as err:
        rest = [p for p in err.problems if p not in first]
    if first or rest:
        raise ConfigValidationError(first + rest)
