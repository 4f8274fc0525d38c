"""Small, dependency-free Python helpers shared across verl.

Everything here works on plain dicts / lists so that it can be used from the
driver, from Ray workers and from tests without pulling in torch.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
from contextlib import contextmanager
from functools import wraps
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Optional

import numpy as np  # only for deep_equal / describe_type on arrays

__all__ = [
    "union_two_dict",
    "rename_dict",
    "append_to_dict",
    "list_of_dict_to_dict_of_list",
    "convert_nested_value_to_list_recursive",
    "convert_to_regular_types",
    "temp_env_var",
    "timeout_limit",
    "NestedNamespace",
    "DynamicEnum",
    "DynamicEnumMeta",
    "CheckError",
    "deep_equal",
    "describe_type",
]


class CheckError(ValueError, AssertionError):
    """Invalid-input error raised by verl's data utilities.

    It is a ``ValueError`` (what callers should catch), and also an
    ``AssertionError`` because upstream verl signalled the same conditions with
    ``assert``; code written against that keeps working.
    """


def union_two_dict(dict1: dict, dict2: dict) -> dict:
    """Merge ``dict2`` into ``dict1`` in place and return ``dict1``.

    A key present in both dicts must map to equal values; silently preferring
    one side would hide bugs where two producers disagree about meta data.
    """
    for key, value in dict2.items():
        if key in dict1 and not _values_equal(dict1[key], value):
            raise CheckError(
                f"`{key}` in meta_dict1 and meta_dict2 are not the same object: "
                f"{dict1[key]!r} vs {value!r}. Rename one of them or make them agree before merging."
            )
        dict1[key] = value
    return dict1


def _values_equal(a: Any, b: Any) -> bool:
    # numpy arrays / tensors return element-wise results from ==; reduce them to a bool.
    result = a == b
    if isinstance(result, bool):
        return result
    try:
        return bool(result.all())
    except Exception:
        return bool(result)


def deep_equal(a: Any, b: Any, _seen: Optional[set] = None) -> bool:
    """Structural equality over numpy arrays, lists, tuples and dicts where NaN equals NaN.

    Used to check that two producers agree on a value; identical rollouts carrying a
    NaN reward must still compare equal. Self-referencing containers are handled.
    """
    if type(a) is not type(b):
        return False
    seen = set() if _seen is None else _seen
    if id(a) in seen:
        return True
    if isinstance(a, float):
        return a == b or (a != a and b != b)  # a != a only for NaN
    if isinstance(a, np.ndarray) and a.dtype != object:
        return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, np.ndarray | list | tuple | dict):
        if isinstance(a, np.ndarray):
            if a.shape != b.shape:
                return False
            pairs = zip(a.flat, b.flat)
        elif isinstance(a, dict):
            if a.keys() != b.keys():
                return False
            pairs = ((a[k], b[k]) for k in a)
        else:
            if len(a) != len(b):
                return False
            pairs = zip(a, b)
        seen.add(id(a))
        try:
            return all(deep_equal(x, y, seen) for x, y in pairs)
        finally:
            seen.discard(id(a))
    result = a == b
    return bool(result.all()) if isinstance(result, np.ndarray) else bool(result)


def describe_type(value: Any) -> str:
    """Short recursive type description, e.g. ``list[int]`` or ``dict[str: float]``.

    Lists are summarised by their first three items; dicts by their first entry.
    """
    if isinstance(value, np.ndarray):
        return f"ndarray{value.shape} ({value.dtype})"
    if isinstance(value, dict):
        first = next(iter(value.items()), None)
        return "dict" if first is None else f"dict[{describe_type(first[0])}: {describe_type(first[1])}]"
    if isinstance(value, tuple):
        return "tuple(" + ", ".join(map(describe_type, value)) + ")"
    if isinstance(value, list):
        kinds = sorted({describe_type(item) for item in value[:3]})
        return "list[" + ("|".join(kinds) if kinds else "...") + "]"
    return type(value).__name__


def rename_dict(data: dict, prefix: str = "") -> dict:
    """Return a copy of ``data`` whose keys all start with ``prefix``."""
    return {(key if key.startswith(prefix) else prefix + key): value for key, value in data.items()}


def append_to_dict(data: dict, new_data: dict, prefix: str = "") -> None:
    """Accumulate ``new_data`` into lists stored in ``data`` (in place).

    List values are extended, scalars appended. Keys get ``prefix`` unless they
    already carry it. A value exposing ``init_list()`` (a metric aggregator)
    decides the container type itself.
    """
    for key, value in new_data.items():
        full_key = key if key.startswith(prefix) else prefix + key
        if full_key not in data:
            data[full_key] = value.init_list() if hasattr(value, "init_list") else []
        if isinstance(value, list):
            data[full_key].extend(value)
        else:
            data[full_key].append(value)


def list_of_dict_to_dict_of_list(list_of_dict: list[dict]) -> dict:
    """Transpose ``[{k: v0}, {k: v1}]`` into ``{k: [v0, v1]}``.

    The first dict defines the key set; a later dict with an unknown key is an error.
    """
    if not list_of_dict:
        return {}
    output: dict[Any, list] = {key: [] for key in list_of_dict[0]}
    for position, item in enumerate(list_of_dict):
        for key, value in item.items():
            if key not in output:
                raise KeyError(
                    f"Key '{key}' is not present in the keys of the first dictionary in the list "
                    f"(found in element {position}); all dicts must share the first dict's keys."
                )
            output[key].append(value)
    return output


def convert_nested_value_to_list_recursive(data_item: Any) -> Any:
    """Recursively turn numpy arrays inside dicts/lists into Python lists."""
    if isinstance(data_item, dict):
        return {k: convert_nested_value_to_list_recursive(v) for k, v in data_item.items()}
    if isinstance(data_item, list):
        return [convert_nested_value_to_list_recursive(v) for v in data_item]
    if hasattr(data_item, "tolist") and type(data_item).__module__ == "numpy":
        return convert_nested_value_to_list_recursive(data_item.tolist())
    return data_item


def convert_to_regular_types(obj: Any) -> Any:
    """Turn OmegaConf containers (and nested lists/tuples/dicts) into builtin types."""
    try:
        from omegaconf import DictConfig, ListConfig
    except ImportError:  # omegaconf is optional for this helper
        DictConfig = ListConfig = ()  # noqa: N806
    if DictConfig and isinstance(obj, DictConfig):
        return {k: convert_to_regular_types(v) for k, v in obj.items()}
    if ListConfig and isinstance(obj, ListConfig):
        return [convert_to_regular_types(v) for v in obj]
    if isinstance(obj, list | tuple):
        return [convert_to_regular_types(v) for v in obj]
    if isinstance(obj, dict):
        return {k: convert_to_regular_types(v) for k, v in obj.items()}
    return obj


@contextmanager
def temp_env_var(key: str, value: str):
    """Set an environment variable for the duration of the block, then restore it."""
    had_value = key in os.environ
    saved = os.environ.get(key, "")
    os.environ[key] = value
    try:
        yield
    finally:
        os.environ.pop(key, None)
        if had_value:
            os.environ[key] = saved


def _run_and_report(func: Callable, result_queue, args: tuple, kwargs: dict) -> None:
    # Module-level so the child process can unpickle it.
    try:
        result_queue.put((True, func(*args, **kwargs)))
    except Exception as exc:  # report, never crash the child silently
        import pickle

        try:
            pickle.dumps(exc)
        except Exception:
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        result_queue.put((False, exc))


def timeout_limit(seconds: float, use_signals: bool = False):
    """Decorator that raises ``TimeoutError`` when the call runs longer than ``seconds``.

    ``use_signals=True`` uses SIGALRM (main thread of the main process only);
    otherwise the call runs in a child process, so arguments and the result must be picklable.
    """
    if seconds <= 0:
        raise ValueError(f"timeout_limit needs a positive number of seconds, got {seconds}")

    def decorator(func):
        if use_signals:

            @wraps(func)
            def with_alarm(*args, **kwargs):
                def on_alarm(signum, frame):
                    raise TimeoutError(f"{func.__name__} timed out after {seconds} seconds")

                old_handler = signal.signal(signal.SIGALRM, on_alarm)
                signal.setitimer(signal.ITIMER_REAL, seconds)
                try:
                    return func(*args, **kwargs)
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    signal.signal(signal.SIGALRM, old_handler)

            return with_alarm

        @wraps(func)
        def in_child(*args, **kwargs):
            result_queue = multiprocessing.Queue()
            child = multiprocessing.Process(target=_run_and_report, args=(func, result_queue, args, kwargs))
            child.start()
            child.join(seconds)
            if child.is_alive():
                child.terminate()
                child.join(1)
                raise TimeoutError(f"{func.__name__} timed out after {seconds} seconds")
            try:
                ok, payload = result_queue.get(timeout=1)
            except Exception as err:
                raise RuntimeError(
                    f"{func.__name__} exited (code {child.exitcode}) without returning a result"
                ) from err
            if ok:
                return payload
            raise payload

        return in_child

    return decorator


class NestedNamespace(SimpleNamespace):
    """``SimpleNamespace`` that converts nested dicts into namespaces (dot access all the way down)."""

    def __init__(self, dictionary: dict, **kwargs):
        super().__init__(**kwargs)
        for key, value in dictionary.items():
            setattr(self, key, NestedNamespace(value) if isinstance(value, dict) else value)


class DynamicEnumMeta(type):
    """Metaclass giving :class:`DynamicEnum` subclasses enum-like class-level behaviour."""

    def __iter__(cls) -> Iterator[Any]:
        return iter(cls._registry.values())

    def __contains__(cls, item: Any) -> bool:
        if isinstance(item, str):
            return item.upper() in cls._registry
        return item in cls._registry.values()

    def __getitem__(cls, name: str) -> Any:
        return cls._registry[name.upper()]

    def __reduce_ex__(cls, protocol):
        # Pickle the class by reference so workers reuse their own registry.
        return getattr, (importlib.import_module(cls.__module__), cls.__name__)

    def names(cls) -> list[str]:
        return list(cls._registry)

    def values(cls) -> list[Any]:
        return list(cls._registry.values())


class DynamicEnum(metaclass=DynamicEnumMeta):
    """An enum whose members can be registered at runtime (e.g. plugin dispatch modes).

    Subclasses should define their own ``_registry = {}`` and ``_next_value = 0``.
    """

    _registry: dict[str, "DynamicEnum"] = {}
    _next_value: int = 0

    def __init__(self, name: str, value: int):
        self.name = name
        self.value = value

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {self.value}>"

    def __reduce_ex__(self, protocol):
        # Members unpickle to the already-registered singleton of the receiving process.
        owner = getattr(importlib.import_module(type(self).__module__), type(self).__name__)
        return getattr, (owner, self.name)

    @classmethod
    def register(cls, name: str) -> "DynamicEnum":
        """Create member ``NAME`` (upper-cased) with the next integer value."""
        if name.upper() in cls._registry:
            raise ValueError(f"{name.upper()} already registered in {cls.__name__}; pick another name")
        value, cls._next_value = cls._next_value, cls._next_value + 1
        cls._registry[name.upper()] = new_member = cls(name.upper(), value)
        setattr(cls, new_member.name, new_member)
        return new_member

    @classmethod
    def remove(cls, name: str) -> "DynamicEnum":
        """Unregister member ``NAME`` and return it."""
        try:
            gone = cls._registry.pop(name.upper())
        except KeyError:
            raise KeyError(f"{name.upper()} is not registered in {cls.__name__}; known: {list(cls._registry)}") from None
        delattr(cls, gone.name)
        return gone

    @classmethod
    def from_name(cls, name: str) -> Optional["DynamicEnum"]:
        """The member called ``name`` (case-insensitive), or None."""
        return cls._registry.get(name.upper())


def config_get(cfg, key: str, default=None):
    """Read ``key`` from a dataclass, DictConfig, dict or None alike (None gives ``default``)."""
    if cfg is None:
        return default
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    getter = getattr(cfg, "get", None)
    if callable(getter):
        try:
            return getter(key, default)
        except TypeError:
            pass
    return getattr(cfg, key, default)
