"""Errors a user fixes in their data, reward function or model path, reported like config errors.

``main_ppo`` prints a :class:`UserFacingError` as one paragraph (what failed, where: file / row / key,
and what to do) and exits non-zero, without a traceback unless ``VERL_DEBUG=1``. The guards here turn
the exceptions raised while reading data or scoring responses into such errors; the original exception
stays attached as ``__cause__``.
"""

from __future__ import annotations

import functools
import inspect
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

__all__ = ["UserFacingError", "debug_enabled", "guard", "GuardedDataset", "guard_reward_fn"]

# What goes wrong in user input: missing files, malformed rows, bad values, user code that raises.
_USER_EXCEPTIONS = (FileNotFoundError, KeyError, ValueError, TypeError, AttributeError, RuntimeError, OSError)


class UserFacingError(RuntimeError):
    """A problem in user input. ``kind`` ("Data", "Reward", "Model") heads the printed paragraph."""

    def __init__(self, kind: str, message: str, hint: str = ""):
        self.kind = kind
        self.message = message.strip()
        self.hint = hint.strip()
        super().__init__(self.paragraph())

    def paragraph(self) -> str:
        text = f"{self.kind} error: {self.message.rstrip('.')}."
        if self.hint:
            text += f" {self.hint}"
        return text


def debug_enabled() -> bool:
    """``VERL_DEBUG=1`` (or true/yes) asks for full tracebacks instead of one-paragraph errors."""
    return os.environ.get("VERL_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def _message(err: BaseException) -> str:
    # KeyError's str() is the repr of its argument; the project's messages are sentences.
    text = err.args[0] if isinstance(err, KeyError) and err.args and isinstance(err.args[0], str) else str(err)
    return text or type(err).__name__


@contextmanager
def guard(kind: str, hint: str = "") -> Iterator[None]:
    """Re-raise user-input exceptions from the block as :class:`UserFacingError`."""
    try:
        yield
    except UserFacingError:
        raise
    except _USER_EXCEPTIONS as err:
        raise UserFacingError(kind, _message(err), hint) from err


class GuardedDataset:
    """A dataset whose row errors (raised lazily while batches are built) are data errors."""

    def __init__(self, dataset: Any, what: str):
        self._dataset = dataset
        self._what = what

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index):
        with guard("Data", f"Fix the row or drop it from {self._what}."):
            return self._dataset[index]

    def __getattr__(self, name: str):
        return getattr(self._dataset, name)


def guard_reward_fn(reward_fn: Callable, where: str) -> Callable:
    """The reward manager with its failures reported as reward errors (its signature is kept, so callers
    that inspect it for ``return_dict`` still see the real one)."""
    plain = inspect.isfunction(reward_fn) or inspect.ismethod(reward_fn) or isinstance(reward_fn, functools.partial)
    target = reward_fn if plain else reward_fn.__call__  # a manager instance: its bound __call__

    @functools.wraps(target)
    def guarded(*args, **kwargs):
        with guard("Reward", f"Fix the reward function ({where}); set VERL_DEBUG=1 for the full traceback."):
            return reward_fn(*args, **kwargs)

    return guarded
