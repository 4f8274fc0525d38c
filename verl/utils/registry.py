"""The one registry helper behind every extension point (advantage estimators, policy losses, KL types,
rollout engines, reward managers, tool parsers, agent loops, training engines, model specs).

A :class:`Registry` is a ``dict`` (so code written against upstream's plain registry dicts, which reads or
rebinds ``core_algos.ADV_ESTIMATOR_REGISTRY[...]``, keeps working) with three behaviours shared by all of
them: registering a taken name with a different object is an error unless ``override=True``; entries may
be dotted import paths that are imported on first use (heavy engines stay optional); and an unknown name
raises :class:`UnknownNameError` naming the config key, the registered names and the closest one.
Config validation asks these live registries, so whatever a user registers before ``main_ppo`` runs is
accepted.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import MutableMapping
from typing import Any, Callable, Iterable, Optional

__all__ = ["Registry", "UnknownNameError", "as_registry", "import_dotted"]


class UnknownNameError(ValueError):
    """A name that no registry entry answers to."""


def import_dotted(path: str, extra: Optional[str] = None) -> Any:
    """``"pkg.module.attr"`` (or ``"pkg.module:attr"``) -> the attribute, with an install hint on ImportError."""
    module_name, _, attr = path.replace(":", ".").rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = f" Install it with `pip install -e .[{extra}]`." if extra else ""
        raise ImportError(f"{path} could not be imported ({exc}).{hint}") from exc
    if not hasattr(module, attr):  # the path names a module itself (e.g. a weight converter module)
        return importlib.import_module(path)
    return getattr(module, attr)


class _RegistryLogic:
    """What every registry does, written against the mapping protocol so that it serves both a
    :class:`Registry` and a plain dict a user put in its place (:func:`as_registry`)."""

    kind: str
    config_key: Optional[str]
    extras: dict[str, str]
    aliases: dict[str, str]

    # -- registering -----------------------------------------------------------------------
    def register(self, name: str, obj: Any = None, *, override: bool = False) -> Any:
        """``reg.register("x", fn)`` or ``@reg.register("x")``; returns the object (decorator-friendly)."""
        if obj is None:
            return lambda o: self.register(name, o, override=override)
        current = self.get(name)
        # The same object, or the same class/function re-created by a module reload, is not a clash.
        same = current is obj or current == obj or (
            current is not None and "<" not in _describe(obj) and _describe(current) == _describe(obj))
        if current is not None and not same and not override:
            raise ValueError(f"{self.kind} {name!r} is already registered ({_describe(current)}); "
                             f"pass override=True to replace it")
        self[name] = obj
        return obj

    # -- looking up -----------------------------------------------------------------------
    def canonical(self, name: str) -> str:
        return self.aliases.get(name, name)

    def names(self) -> list[str]:
        return sorted(self)

    def known(self, name: Any) -> bool:
        return isinstance(name, str) and self.canonical(name) in self

    def get_or_raise(self, name: Any) -> Any:
        """The registered object for ``name`` (imported if registered as a dotted path)."""
        key = self.canonical(name) if isinstance(name, str) else name
        if key not in self:
            raise UnknownNameError(self.unknown_message(name))
        obj = self[key]
        if isinstance(obj, str):
            obj = import_dotted(obj, extra=self.extras.get(key))
        return obj

    def unknown_message(self, name: Any) -> str:
        where = f"{self.config_key}={name!r}" if self.config_key else repr(name)
        msg = f"{where} is not a registered {self.kind}; registered: {', '.join(self.names()) or 'none'}"
        close = difflib.get_close_matches(str(name), self.names(), n=1)
        if close:
            msg += f" (did you mean {close[0]!r}?)"
        return msg

    def check(self, name: Any, problems: list[str]) -> None:
        """Append the unknown-name message to ``problems`` (validation collects all problems at once)."""
        if not self.known(name):
            problems.append(self.unknown_message(name))


class Registry(_RegistryLogic, dict):
    """name -> object (or dotted path to it, resolved lazily).

    ``kind`` reads in messages ("advantage estimator"); ``config_key`` is the key users set to pick an
    entry ("algorithm.adv_estimator"); ``extras`` maps a name to the pip extra that provides it.
    """

    def __init__(self, kind: str, config_key: Optional[str] = None, extras: Optional[dict[str, str]] = None,
                 aliases: Optional[dict[str, str]] = None):
        super().__init__()
        self.kind = kind
        self.config_key = config_key
        self.extras = dict(extras or {})
        self.aliases = dict(aliases or {})


class _DictRegistry(_RegistryLogic, MutableMapping):
    """A plain dict seen as a registry: reads and writes go to that dict itself, so code holding the dict
    sees what is registered through the module's functions."""

    def __init__(self, mapping: dict, like: Registry):
        self._mapping = mapping
        self.kind, self.config_key = like.kind, like.config_key
        self.extras, self.aliases = like.extras, like.aliases

    def __getitem__(self, key):
        return self._mapping[key]

    def __setitem__(self, key, value):
        self._mapping[key] = value

    def __delitem__(self, key):
        del self._mapping[key]

    def __iter__(self):
        return iter(self._mapping)

    def __len__(self):
        return len(self._mapping)


def as_registry(mapping: Any, like: Registry) -> Any:
    """``mapping`` if it is a :class:`Registry`, else a registry over that very dict with ``like``'s kind and
    config key. Upstream's registries are plain module-level dicts that its users (and its tests) clear or
    rebind (``core_algos.ADV_ESTIMATOR_REGISTRY = {...}``) before registering; modules that own such a
    registry resolve it through here at call time, so a rebound dict is the one registered into and read."""
    if isinstance(mapping, Registry):
        return mapping
    if not isinstance(mapping, MutableMapping):
        raise TypeError(f"the {like.kind} registry was replaced by a {type(mapping).__name__}; it must be a dict")
    return _DictRegistry(mapping, like)


def _describe(obj: Any) -> str:
    if isinstance(obj, str):
        return obj
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


