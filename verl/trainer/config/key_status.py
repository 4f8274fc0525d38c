"""The status of every config key, read from ``key_status.txt`` (see that file's header).

Validation uses two of the statuses: ``default-only`` keys (upstream keys not implemented here) are
refused when set to anything but their default, and ``no-op`` keys warn when changed. The key-walk test
and the docs table generator read the same file, so the three never disagree.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import functools
from pathlib import Path
from typing import Any, Optional

__all__ = ["KeyStatus", "STATUSES", "load_key_status", "status_for", "check_key_status"]

STATUS_FILE = Path(__file__).resolve().parent / "key_status.txt"
STATUSES = ("tested", "refused", "default-only", "no-op", "follows", "used", "pending")


@dataclasses.dataclass(frozen=True)
class KeyStatus:
    pattern: str
    status: str
    evidence: str

    def matches(self, key: str) -> bool:
        return key == self.pattern or fnmatch.fnmatchcase(key, self.pattern)

    def default(self) -> Any:
        """The default a default-only / no-op key must keep (a Python literal in the evidence column)."""
        return ast.literal_eval(self.evidence)


@functools.lru_cache(maxsize=1)
def load_key_status() -> tuple[KeyStatus, ...]:
    entries = []
    for number, line in enumerate(STATUS_FILE.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(None, 2)
        if len(parts) < 3 or parts[1] not in STATUSES:
            raise ValueError(f"{STATUS_FILE.name}:{number}: expected '<key> <status> <evidence>' with a status "
                             f"among {', '.join(STATUSES)}; got {line!r}")
        entries.append(KeyStatus(*parts))
    return tuple(entries)


def status_for(key: str) -> Optional[KeyStatus]:
    """The first line matching ``key`` (exact keys are listed before globs)."""
    exact = [e for e in load_key_status() if e.pattern == key]
    if exact:
        return exact[0]
    return next((e for e in load_key_status() if e.matches(key)), None)


def _plain(value: Any) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def check_key_status(cfg) -> tuple[list[str], list[str]]:
    """``(problems, notes)``: default-only keys set to another value, no-op keys that were changed."""
    from omegaconf import OmegaConf

    problems: list[str] = []
    notes: list[str] = []
    for entry in load_key_status():
        if entry.status not in ("default-only", "no-op") or any(ch in entry.pattern for ch in "*?["):
            continue
        sentinel = object()
        try:
            value = OmegaConf.select(cfg, entry.pattern, default=sentinel)
        except Exception:  # noqa: BLE001 - an unresolvable value is reported by the other checks
            continue
        if value is sentinel:
            continue
        value, default = _plain(value), entry.default()
        if value == default or (value in (None, {}, []) and default in (None, {}, [])):
            continue  # (null and an empty mapping/list mean "nothing set" alike)
        if entry.status == "default-only":
            problems.append(f"`{entry.pattern}` is {value!r}, but this upstream option is not implemented here; "
                            f"remove it or leave it at its default ({default!r}).")
        else:
            notes.append(f"{entry.pattern}={value!r} has no effect in this project (it only tunes upstream's "
                         "performance, memory use or logging); it is ignored.")
    return problems, notes
