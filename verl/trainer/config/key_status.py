"""The status of every config key, read from ``key_status.txt`` (see that file's header).

Validation uses two of the statuses: ``default-only`` keys (upstream keys not implemented here) are
refused when set to anything but their default, and ``no-op`` keys (no effect on results here) warn when
changed. The key-walk test and the docs table generator read the same file, so the three never disagree.
:func:`keys_named_in` is the rule by which a ``tested`` line's test file must name its key (the file's
header states it).
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import fnmatch
import functools
import re
from pathlib import Path
from typing import Any, Iterable, Optional

__all__ = ["KeyStatus", "STATUSES", "RETIRED_STATUSES", "load_key_status", "status_for", "check_key_status",
           "keys_named_in", "segments_to_name"]

STATUS_FILE = Path(__file__).resolve().parent / "key_status.txt"
STATUSES = ("tested", "refused", "default-only", "no-op", "follows")
# Statuses this file once had. They parse (so validation keeps working while a line is being fixed), but the
# key walk fails for any line that still has one: "read by code, no test" and "being implemented" are
# exactly the keys nothing shows to work.
RETIRED_STATUSES = ("used", "pending")


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
        if len(parts) < 3 or parts[1] not in STATUSES + RETIRED_STATUSES:
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
            notes.append(f"{entry.pattern}={value!r} has no effect in this project (upstream uses it for performance, "
                         "memory or logging only, or together with an option not built here); it is ignored.")
    return problems, notes


# ------------------------------------------------------------------------------ the naming rule for `tested`
LONG_SEGMENT = 12  # a last segment longer than this, with an underscore, may name its key alone if unique
_DOTTED_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def segments_to_name(key: str, all_keys: Iterable[str]) -> int:
    """How many trailing segments of ``key`` a dotted name must end in to name it: 1 for a one-segment key or
    for a last segment longer than LONG_SEGMENT characters, containing ``_``, that ends no other key of
    ``all_keys``; else 2 (``optim.lr``, ``fsdp_config.param_offload``)."""
    parts = key.split(".")
    if len(parts) == 1:
        return 1
    last = parts[-1]
    if len(last) > LONG_SEGMENT and "_" in last and sum(k.rsplit(".", 1)[-1] == last for k in all_keys) == 1:
        return 1
    return 2


def _common_tail(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def keys_named_in(text: str, all_keys: Iterable[str]) -> set[str]:
    """The keys of ``all_keys`` that ``text`` (a test file) names.

    Every dotted name in the text (``actor_rollout_ref.actor.optim.lr`` in an override, ``cfg.critic.optim.lr``,
    the ``.optim.lr`` after an f-string's ``{role}``) is matched against the keys by trailing segments. It
    names the keys it matches on the most trailing segments, provided that is at least
    :func:`segments_to_name` of the key: ``critic.optim.lr`` names the critic's key only (the actor's
    matches on two segments, the critic's on three), ``optim.lr`` names every ``*.optim.lr`` alike, and a
    bare ``lr`` names none. A sibling key (``optim.lr_warmup_steps``) never names ``optim.lr``."""
    all_keys = list(all_keys)
    by_last: dict[str, list[list[str]]] = collections.defaultdict(list)
    for key in all_keys:
        by_last[key.rsplit(".", 1)[-1]].append(key.split("."))
    need = {key: segments_to_name(key, all_keys) for key in all_keys}
    named: set[str] = set()
    for match in set(_DOTTED_NAME.findall(text)):
        parts = match.split(".")
        candidates = by_last.get(parts[-1])
        if not candidates:
            continue
        scores = [(_common_tail(parts, c), ".".join(c)) for c in candidates]
        best = max(score for score, _ in scores)
        named.update(key for score, key in scores if score == best and score >= need[key])
    return named
