"""Proof that a weight sync wrote every engine parameter exactly once.

A sync that silently skips a tensor (a renamed module, a dropped prefix, a vision tower filtered by mistake)
leaves the engine sampling from stale weights while training continues — the failure shows up only as a
slowly diverging KL. :func:`check_coverage` turns that into an immediate error naming the tensors.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Iterable, Optional

from .names import EngineLayout, engine_targets, required_shards


class WeightCoverageError(RuntimeError):
    """Raised when a weight sync misses, repeats or misdirects engine parameters."""

    def __init__(self, missing, duplicated, unknown, incomplete):
        self.missing = sorted(missing)
        self.duplicated = sorted(duplicated)
        self.unknown = sorted(unknown)
        self.incomplete = dict(sorted(incomplete.items()))
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} engine parameter(s) never written: {_head(self.missing)}")
        if self.incomplete:
            desc = [f"{k} (missing shards {sorted(map(str, v))})" for k, v in self.incomplete.items()]
            parts.append(f"{len(desc)} fused engine parameter(s) partly written: {_head(desc)}")
        if self.duplicated:
            parts.append(f"{len(self.duplicated)} written more than once: {_head(self.duplicated)}")
        if self.unknown:
            parts.append(f"{len(self.unknown)} written name(s) match no engine parameter: {_head(self.unknown)}")
        super().__init__("weight sync coverage check failed: " + "; ".join(parts))


def _head(names, n: int = 20) -> str:
    names = list(names)
    more = f" ... (+{len(names) - n} more)" if len(names) > n else ""
    return ", ".join(map(str, names[:n])) + more


def check_coverage(
    engine_param_names: Iterable[str],
    written_names: Iterable[str],
    layout: Optional[EngineLayout] = None,
) -> None:
    """Raise :class:`WeightCoverageError` unless every engine parameter was written exactly once.

    ``engine_param_names``: the engine model's parameter names (``model.named_parameters()``).
    ``written_names``: the names handed to the engine loader, either engine names already (``layout=None``)
    or HF checkpoint names mapped through ``layout`` (fused engine tensors then need every shard: q, k and v
    for ``qkv_proj``, each expert's w1/w3 for ``w13_weight``, ...).
    """
    engine = set(engine_param_names)
    hits: Counter = Counter()  # (engine name, shard) -> times written
    unknown: set[str] = set()
    for name in written_names:
        targets = [(name, None)] if layout is None else engine_targets(name, layout)
        if layout is not None and not targets:
            continue  # a tensor the engine deliberately does not own (tied lm_head, dropped vision tower)
        for target, shard in targets:
            if target not in engine:
                unknown.add(name)
            else:
                hits[(target, shard)] += 1

    got: dict[str, set] = defaultdict(set)
    duplicated = set()
    for (target, shard), count in hits.items():
        got[target].add(shard)
        if count > 1:
            duplicated.add(target if shard is None else f"{target}[{shard}]")
    missing = {n for n in engine if n not in got}
    incomplete = {}
    if layout is not None:
        for target, shards in got.items():
            lacking = required_shards(target, layout) - shards
            if lacking:
                incomplete[target] = lacking
    if missing or duplicated or unknown or incomplete:
        raise WeightCoverageError(missing, duplicated, unknown, incomplete)


def check_loader_coverage(
    engine_param_names: Iterable[str],
    loaded_names: Optional[Iterable[str]],
    sent_names: Iterable[str],
) -> None:
    """Coverage from the engine's own word: every engine parameter must be among the names its loader reported
    loaded (vLLM's ``load_weights`` returns them), and no HF tensor may be sent twice.

    Works for any architecture the engine can load; names the engine cannot place make its loader raise. The
    shard-level check of :func:`check_coverage` (q, k and v all written into ``qkv_proj``) needs a layout and
    runs in addition for the architectures that have one (Qwen3.5).
    """
    if loaded_names is None:
        raise WeightCoverageError(["<the engine's weight loader reported no loaded names>"], (), (), {})
    engine = set(engine_param_names)
    missing = engine - set(loaded_names)
    sent = Counter(sent_names)
    duplicated = {n for n, c in sent.items() if c > 1}
    if missing or duplicated:
        raise WeightCoverageError(missing, duplicated, (), {})
