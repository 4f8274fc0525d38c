"""Errors a user fixes in their data, reward function or model path, reported like config errors.

``main_ppo`` and ``sft_trainer`` print a :class:`UserFacingError` as one paragraph (what failed, where:
file / row / key / function, and what to do) and exit non-zero, without a traceback unless ``VERL_DEBUG=1``.
The guards here turn the exceptions raised while reading data or scoring responses into such errors; the
original exception stays attached as ``__cause__``.

Two kinds of guard:

* :func:`guard` around the project's own set-up code (building a dataset or a reward manager from config):
  only the exception types that mean bad input (missing file, bad value, missing key ...) are converted, so
  a bug in the project still shows its traceback.
* ``guard(..., catch_all=True)``, used by :class:`GuardedDataset` and :func:`guard_reward_fn`, around the
  code that runs the user's rows and the user's reward function: there any exception (a ZeroDivisionError
  in a scorer, an IndexError on a malformed row) is the user's to fix, and the paragraph names its type.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

__all__ = ["UserFacingError", "debug_enabled", "guard", "GuardedDataset", "RowFailure", "DeferredRowErrors",
           "raise_row_failures", "guard_reward_fn"]

# What goes wrong in user input handled by the project's own code: missing files, malformed rows, bad values.
_USER_EXCEPTIONS = (FileNotFoundError, KeyError, ValueError, TypeError, AttributeError, RuntimeError, OSError)
_NAMES_A_ROW = re.compile(r"\brow \d")


class UserFacingError(RuntimeError):
    """A problem in user input. ``kind`` ("Data", "Reward", "Model", "Config") heads the printed paragraph."""

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

    def __reduce__(self):  # pickling (Ray, multiprocessing) rebuilds it from its parts, not from args
        return (type(self), (self.kind, self.message, self.hint))


def debug_enabled() -> bool:
    """``VERL_DEBUG=1`` (or true/yes) asks for full tracebacks instead of one-paragraph errors."""
    return os.environ.get("VERL_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def _message(err: BaseException, name_type: bool = False) -> str:
    # KeyError's str() is the repr of its argument; the project's messages are sentences.
    text = err.args[0] if isinstance(err, KeyError) and err.args and isinstance(err.args[0], str) else str(err)
    text = " ".join(str(text).split())  # one paragraph, whatever the exception's own line breaks
    if not text:
        return type(err).__name__
    # The project's validation errors are sentences of bad-input types; a user's ZeroDivisionError, or a bare
    # KeyError('answer') from a row, says little without its type.
    if name_type and not (isinstance(err, _USER_EXCEPTIONS) and " " in text):
        return f"{type(err).__name__}: {text}"
    return text


@contextmanager
def guard(kind: str, hint: str = "", where: str = "", catch_all: bool = False) -> Iterator[None]:
    """Re-raise exceptions from the block as :class:`UserFacingError`.

    ``catch_all=False``: only the bad-input types (``FileNotFoundError``, ``KeyError``, ``ValueError`` ...).
    ``catch_all=True``: any ``Exception`` (the block runs user code or user rows), its type named unless the
    message is already one of the project's sentences. ``where`` (the failing object's name) is put in front
    of the message unless the message already names it."""
    try:
        yield
    except UserFacingError:
        raise
    except Exception as err:  # noqa: BLE001 - filtered just below; the cause stays chained
        if not catch_all and not isinstance(err, _USER_EXCEPTIONS):
            raise
        message = _message(err, name_type=catch_all)
        if where and where not in message:
            message = f"{where}: {message}"
        raise UserFacingError(kind, message, hint) from err


class GuardedDataset:
    """A dataset whose row errors (raised lazily while batches are built) are data errors naming the row.

    Any exception while loading a row is converted: a row is user data, so an IndexError from a malformed
    row is as much the user's to fix as the dataset's own ValueError."""

    def __init__(self, dataset: Any, what: str):
        self._dataset = dataset
        self._what = what

    def __len__(self) -> int:
        return len(self._dataset)

    def __getitem__(self, index):
        try:
            return self._dataset[index]
        except UserFacingError:
            raise
        except Exception as err:  # noqa: BLE001 - a row is user data; the cause stays chained
            message = _message(err, name_type=True)
            if not _NAMES_A_ROW.search(message):  # the project's datasets name the row and file themselves
                message = f"row {index} of {self._what}: {message}"
            hint = f"Fix the row or drop it from {self._what}; set VERL_DEBUG=1 for the full traceback."
            raise UserFacingError("Data", message, hint) from err

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_dataset", "_what"):
            # Unpickling (DataLoader workers) looks attributes up before __init__ ran: no recursion.
            raise AttributeError(name)
        return getattr(self._dataset, name)


class RowFailure:
    """A :class:`UserFacingError` raised while a DataLoader worker process loaded a row, as a value.

    PyTorch re-raises a worker's exception by calling its type with the worker's formatted traceback,
    which a :class:`UserFacingError` cannot be rebuilt from (it would surface as a RuntimeError holding a
    traceback). :class:`DeferredRowErrors` returns this record instead, and :func:`raise_row_failures`
    raises the error again in the main process, with the worker's traceback attached as a note (shown with
    ``VERL_DEBUG=1``)."""

    def __init__(self, err: UserFacingError):
        self.kind, self.message, self.hint = err.kind, err.message, err.hint
        self.worker_traceback = "".join(traceback.format_exception(err))

    def error(self) -> UserFacingError:
        err = UserFacingError(self.kind, self.message, self.hint)
        err.add_note("Raised while loading the row (in a DataLoader worker):\n" + self.worker_traceback)
        return err


class DeferredRowErrors:
    """Wraps a :class:`GuardedDataset` for a DataLoader: a failing row comes back as a :class:`RowFailure`."""

    def __init__(self, dataset: GuardedDataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        try:
            return self.dataset[index]
        except UserFacingError as err:
            return RowFailure(err)


def raise_row_failures(rows: list) -> list:
    """``rows`` unchanged, or the first :class:`RowFailure` among them raised as its error."""
    for row in rows:
        if isinstance(row, RowFailure):
            raise row.error()
    return rows


def _callable_name(fn: Callable) -> Optional[str]:
    return getattr(fn, "__qualname__", None) or getattr(type(fn), "__qualname__", None)


def guard_reward_fn(reward_fn: Callable, where: str) -> Callable:
    """The reward manager with any failure reported as a reward error naming ``where`` (its signature is
    kept, so callers that inspect it for ``return_dict`` still see the real one)."""
    plain = inspect.isfunction(reward_fn) or inspect.ismethod(reward_fn) or isinstance(reward_fn, functools.partial)
    target = reward_fn if plain else reward_fn.__call__  # a manager instance: its bound __call__
    hint = f"Fix the reward function ({where}); set VERL_DEBUG=1 for the full traceback."
    name = _callable_name(reward_fn)

    @functools.wraps(target)
    def guarded(*args, **kwargs):
        with guard("Reward", hint, where=name or "", catch_all=True):
            return reward_fn(*args, **kwargs)

    return guarded
