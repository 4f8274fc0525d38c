"""BaseConfig: a dataclass that reads like a mapping (``cfg.get("x")``, ``cfg["x"]``, ``dict(cfg)``).

Fields are frozen once set, except those named in ``_mutable_fields``; so a policy loss cannot change the
actor's settings for the next micro-batch by accident."""

from __future__ import annotations

import collections.abc
import dataclasses
from typing import Any

__all__ = ["BaseConfig"]


class BaseConfig(collections.abc.Mapping):
    _mutable_fields: frozenset = frozenset()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__ and name not in self._mutable_fields:
            raise dataclasses.FrozenInstanceError(f"{type(self).__name__}.{name} is read-only")
        super().__setattr__(name, value)

    def _names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self)]

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    def __getitem__(self, key: str) -> Any:
        if key not in self._names():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())
