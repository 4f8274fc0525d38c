"""Command-line override checking with helpful error messages.

Hydra's own "key not in struct" error names the key but offers no guess at what was
meant. ``check_overrides`` runs on the config composed *without* the value overrides
and explains every bad override at once: a close valid key, the new home of a legacy
key, or the fact that the key is an upstream verl option this project leaves out.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

__all__ = [
    "CONFIG_DIR",
    "LEGACY_ALIASES",
    "SEQUENCE_PARALLEL_HOMES",
    "settle_sequence_parallel",
    "normalize_overrides",
    "ConfigKeyError",
    "hoist_engine_choice",
    "OPEN_DICT_PATTERNS",
    "check_overrides",
    "config_key_paths",
    "split_overrides",
    "upstream_only_keys",
]

CONFIG_DIR = Path(__file__).resolve().parent
_UPSTREAM_KEYS_FILE = CONFIG_DIR / "upstream_keys.txt"

# Nodes whose contents are free-form: `+path.new_key=value` may add keys below them.
# Any node that is an empty mapping in the base config counts as open as well.
OPEN_DICT_PATTERNS: tuple[str, ...] = (
    "*.model.override_config",
    "*.engine_kwargs.*",
    "ray_kwargs.ray_init",
    "data.apply_chat_template_kwargs",
    "*.optim.override_optimizer_config",
    "*.megatron.override_transformer_config",
    "*.megatron.override_ddp_config",
    "*.megatron.override_mcore_model_config",
    "*.checkpoint.mbridge_config",
)

# Legacy homes that upstream still accepts: the old spelling is rewritten to the new key (one deprecation
# warning each) when the new key exists in the composed config. Matching is by prefix, so a whole subtree
# moves. Where the new home is absent here (e.g. critic.fsdp under model_engine=megatron) the old key is
# refused, naming the new one. Whether the feature then runs is validation's business (e.g.
# reward_model.enable=true becomes reward.reward_model.enable=true: a discriminative reward model).
LEGACY_ALIASES: dict[str, str] = {
    "reward_model.reward_manager": "reward.reward_manager.name",
    "reward_model.reward_kwargs": "reward.reward_kwargs",
    "reward_model.enable": "reward.reward_model.enable",
    "reward_model.enable_resource_pool": "reward.reward_model.enable_resource_pool",
    "reward_model.n_gpus_per_node": "reward.reward_model.n_gpus_per_node",
    "reward_model.nnodes": "reward.reward_model.nnodes",
    "reward_model.num_workers": "reward.num_workers",
    "reward_model.model.path": "reward.reward_model.model_path",
    "reward_model.rollout": "reward.reward_model.rollout",
    "critic.model.fsdp_config": "critic.fsdp",
}

# Spellings upstream's own example scripts use for a key that lives elsewhere in its config: upstream's SAPO
# script adds `+actor_rollout_ref.actor.policy_loss.tau_pos`, while its SAPO loss reads `actor.tau_pos`. The
# script's spelling is read as the key the loss reads (one note each), `+` included.
SPELLING_ALIASES: dict[str, str] = {
    "actor_rollout_ref.actor.policy_loss.tau_pos": "actor_rollout_ref.actor.tau_pos",
    "actor_rollout_ref.actor.policy_loss.tau_neg": "actor_rollout_ref.actor.tau_neg",
}

# Old spellings that are not aliases (the meaning changed): refused with a pointer to the new key.
_MOVED_PREFIXES: dict[str, str] = {
    **LEGACY_ALIASES,
    "actor_rollout_ref.rollout.val_kwargs.max_tokens": "actor_rollout_ref.rollout.response_length",
}


class ConfigKeyError(ValueError):
    """One or more overrides name keys that the config does not have.

    ``problems`` holds one message per bad override.
    """

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        header = f"{len(self.problems)} invalid config override(s):"
        super().__init__("\n".join([header] + [f"  - {p}" for p in self.problems]))


@functools.lru_cache(maxsize=1)
def upstream_only_keys() -> frozenset[str]:
    """Dotted keys that upstream verl 0.9.1 has and this project does not."""
    if not _UPSTREAM_KEYS_FILE.exists():
        return frozenset()
    lines = _UPSTREAM_KEYS_FILE.read_text().splitlines()
    return frozenset(s.strip() for s in lines if s.strip() and not s.startswith("#"))


# --------------------------------------------------------------------------- tree helpers


def _as_tree(cfg: Any) -> Any:
    # A plain container without resolving: interpolations and ??? must not be evaluated here.
    if isinstance(cfg, (DictConfig,)) or OmegaConf.is_config(cfg):
        return OmegaConf.to_container(cfg, resolve=False)
    return cfg


_ABSENT = object()


def _lookup(tree: Any, parts: Sequence[str]) -> Any:
    node = tree
    for part in parts:
        if isinstance(node, dict):
            if part not in node:
                return _ABSENT
            node = node[part]
        elif isinstance(node, list):
            try:
                idx = int(part)
            except ValueError:
                return _ABSENT
            if not -len(node) <= idx < len(node):
                return _ABSENT
            node = node[idx]
        else:
            return _ABSENT
    return node


def config_key_paths(cfg: Any) -> list[str]:
    """Every dotted path in ``cfg`` (mapping nodes and leaves; list items are not expanded)."""
    out: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            out.append(path)
            if isinstance(value, dict):
                walk(value, path)

    tree = _as_tree(cfg)
    if isinstance(tree, dict):
        walk(tree, "")
    return out


def _is_open(tree: Any, path: str) -> bool:
    node = _lookup(tree, path.split(".")) if path else tree
    if isinstance(node, dict) and not node:
        return True
    return any(fnmatch.fnmatchcase(path, pat) for pat in OPEN_DICT_PATTERNS)


def _is_interpolation(node: Any) -> bool:
    return isinstance(node, str) and node.startswith("${") and node.endswith("}")


def _open_ancestor(tree: Any, parts: Sequence[str]) -> Optional[str]:
    """The nearest existing ancestor of ``parts`` that accepts new keys, if any."""
    for depth in range(len(parts) - 1, 0, -1):
        prefix = parts[:depth]
        node = _lookup(tree, prefix)
        if node is _ABSENT:
            continue
        path = ".".join(prefix)
        if (node is None or _is_interpolation(node)) and any(fnmatch.fnmatchcase(path, p) for p in OPEN_DICT_PATTERNS):
            # A free-form node that is currently null, or that inherits another node (the ref's
            # override_transformer_config follows the actor's): Hydra's `+` replaces it with a new mapping.
            return path
        if isinstance(node, dict) and _is_open(tree, path):
            return path
        # Walk further up: keys may be added anywhere inside an open subtree.
    return None


# --------------------------------------------------------------------------- suggestions


def _suggest(key: str, tree: Any, paths: Sequence[str], limit: int = 3) -> list[str]:
    """Likely intended keys, best first. Earlier strategies are more specific, so they win."""
    parts = key.split(".")
    found: list[str] = []

    def add(candidates: Iterable[str]) -> None:
        for cand in candidates:
            if cand != key and cand not in found:
                found.append(cand)

    # 1) Fix the first unknown component among its siblings under the deepest existing
    #    ancestor (catches `optim.lrr` -> `optim.lr` and `actr.ppo_epochs` -> `actor.ppo_epochs`).
    depth = 0
    while depth < len(parts) and _lookup(tree, parts[: depth + 1]) is not _ABSENT:
        depth += 1
    parent = _lookup(tree, parts[:depth]) if depth else tree
    path_set = set(paths)
    if depth < len(parts) and isinstance(parent, dict):
        siblings = [str(k) for k in parent]
        fixes = []
        for match in difflib.get_close_matches(parts[depth], siblings, n=limit, cutoff=0.6):
            fixed = ".".join(parts[:depth] + [match] + parts[depth + 1 :])
            fixes.append(fixed if fixed in path_set else ".".join(parts[:depth] + [match]))
        add(fixes)

    # 2) The same leaf name living in another section (a key put in the wrong place).
    leaf = parts[-1]
    same_leaf = [p for p in paths if p.rsplit(".", 1)[-1] == leaf]
    if 0 < len(same_leaf) <= 6:
        add(sorted(same_leaf, key=lambda p: -difflib.SequenceMatcher(None, key, p).ratio()))

    # 3) Whole-path similarity, only as a fallback; shared prefixes inflate the ratio,
    #    so demand a high score, equal depth, and never suggest an ancestor of the key.
    if not found:
        peers = [p for p in paths if p.count(".") == key.count(".") and not key.startswith(p + ".")]
        add(difflib.get_close_matches(key, peers, n=limit, cutoff=0.9))
    return found[:limit]


def _upstream_hint(key: str) -> bool:
    known = upstream_only_keys()
    if key in known:
        return True
    # A key inside a dropped subtree, or a whole dropped subtree given at once.
    parts = key.split(".")
    if any(".".join(parts[:i]) in known for i in range(1, len(parts))):
        return True
    return any(k.startswith(key + ".") for k in known)


def _moved_hint(key: str, paths: set[str]) -> Optional[str]:
    for old, new in _MOVED_PREFIXES.items():
        if key == old or key.startswith(old + "."):
            target = new + key[len(old) :]
            if target in paths or new in paths:
                return target if target in paths else new
    return None


def _engine_hint(key: str, tree: Any) -> str:
    engine = tree.get("model_engine") if isinstance(tree, dict) else None
    if ".megatron." in f".{key}." and engine != "megatron":
        return " Megatron options need `model_engine=megatron` (or --config-name ppo_megatron_trainer)."
    if (".fsdp_config." in f".{key}." or key.startswith("critic.fsdp.")) and engine == "megatron":
        return " FSDP options need `model_engine=dp`."
    return ""


def _unknown_key_message(key: str, tree: Any, paths: Sequence[str]) -> str:
    from .unsupported import feature_for_key

    feature = feature_for_key(key)
    if feature is not None:
        return f"`{key}` belongs to {feature}, which this project does not implement."
    moved = _moved_hint(key, set(paths))
    if moved is not None:
        return f"`{key}` is a legacy key; it now lives at `{moved}`."
    engine = _engine_hint(key, tree)
    if engine:
        return f"`{key}` is not in the current config.{engine}"
    if _upstream_hint(key):
        return f"`{key}` is an upstream verl option this project does not implement."
    msg = f"`{key}` is not a config key."
    suggestions = _suggest(key, tree, paths)
    if suggestions:
        msg += " Did you mean " + " or ".join(f"`{s}`" for s in suggestions) + "?"
    return msg


# --------------------------------------------------------------------------- parsing


def _parse(overrides: Iterable[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides(list(overrides))


def _is_group_override(ov, config_dir: Path) -> bool:
    key = ov.key_or_group
    if ov.package is not None or "/" in key:
        return True
    # A user's --config-path composes on top of this folder (it is on the search path), so its groups count.
    return "." not in key and ((config_dir / key).is_dir() or (CONFIG_DIR / key).is_dir())


def _is_hydra_key(key: str) -> bool:
    return key == "hydra" or key.startswith("hydra.") or key.startswith("hydra/")


def split_overrides(overrides: Sequence[str], config_dir: Optional[Path] = None) -> tuple[list[str], list[str]]:
    """Split overrides into (config-group choices such as ``model_engine=megatron``, value overrides)."""
    config_dir = Path(config_dir) if config_dir is not None else CONFIG_DIR
    groups: list[str] = []
    values: list[str] = []
    for text, ov in zip(overrides, _parse(overrides)):
        (groups if _is_group_override(ov, config_dir) else values).append(text)
    return groups, values


def _override_value(ov) -> Any:
    try:
        return ov.value()
    except Exception:  # noqa: BLE001 - sweeps and other values Hydra's compose refuses itself
        return _ABSENT


def _hydra_accepts_append(cfg: Any, tree: Any, parts: Sequence[str], ov, assigned: dict[str, Any]) -> bool:
    """Hydra 1.3's rule for ``+key=value`` on a key that already exists (``_apply_overrides_to_config``): it
    is applied (merged, with ``force_add``) when the current value is null (``???`` selects as null too) or
    the new value is a list or dict; otherwise Hydra raises "Could not append to config"."""
    if isinstance(_override_value(ov), (list, dict)):
        return True
    key = ".".join(parts)
    if key in assigned:  # an earlier override in the same list set it: Hydra sees that value
        return assigned[key] is None
    if OmegaConf.is_config(cfg):
        try:
            return OmegaConf.select(cfg, key, throw_on_missing=False) is None
        except Exception:  # noqa: BLE001 - an interpolation that does not resolve yet: judge the raw node
            pass
    return _lookup(tree, parts) is None


# --------------------------------------------------------------------------- main entry


def _check_append(cfg, tree, paths, text: str, ov, exists: bool, open_parent, added: set, assigned: dict):
    """A ``+key=value`` override: the problem with it (None if Hydra accepts it); records what it adds."""
    key = ov.key_or_group
    if exists and _hydra_accepts_append(cfg, tree, key.split("."), ov, assigned):
        assigned[key] = _override_value(ov)
        return None
    if exists:
        return (f"`{key}` already exists with a value, so Hydra refuses `+` on it (\"Could not append to config. "
                f"An item is already at '{key}'\"); set it with `{text.lstrip('+')}` (no leading `+`), or "
                f"`+{text}` to add or override it.")
    if open_parent is not None:
        added.add(key)
        assigned[key] = _override_value(ov)
        return None
    return (_unknown_key_message(key, tree, paths)
            + " (`+` may only add keys below free-form nodes such as override_config or engine_kwargs.*)")


def check_overrides(
    cfg_without_overrides: Any,
    overrides: Sequence[str],
    config_dir: Optional[Path] = None,
) -> None:
    """Raise :class:`ConfigKeyError` if any override names a key ``cfg_without_overrides`` lacks.

    Understands ``key=value``, ``+key=value`` (a new key only below free-form nodes such as
    ``override_config`` or ``engine_kwargs.vllm``; on an existing key exactly Hydra's rule, see
    :func:`_hydra_accepts_append`), ``++key=value`` (set, or add below a free-form node),
    ``~key`` (delete an existing key) and list / dict values. Config-group
    choices (``model_engine=megatron``) and ``hydra.*`` keys are left to Hydra.
    """
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import OverrideParseException

    config_dir = Path(config_dir) if config_dir is not None else CONFIG_DIR
    overrides = list(overrides)
    try:
        parsed = _parse(overrides)
    except OverrideParseException as exc:
        raise ConfigKeyError([f"could not parse overrides: {exc}"]) from exc

    tree = _as_tree(cfg_without_overrides)
    paths = config_key_paths(tree)
    added: set[str] = set()  # keys created by earlier `+` overrides in the same list
    assigned: dict[str, Any] = {}  # key -> value an earlier override in the list left there (Hydra applies in order)
    problems: list[str] = []
    # keys of a left-out feature, one sentence per feature: a script written for that feature sets a dozen of
    # them, and a list of a dozen refusals hides the one thing to say (this project does not build it)
    by_feature: dict[str, list[str]] = {}

    for text, ov in zip(overrides, parsed):
        key = ov.key_or_group
        if _is_hydra_key(key) or _is_group_override(ov, config_dir):
            continue
        parts = key.split(".")
        exists = _lookup(tree, parts) is not _ABSENT or key in added or any(key.startswith(a + ".") for a in added)
        open_parent = _open_ancestor(tree, parts)

        if not exists and ov.type != OverrideType.DEL:
            from .unsupported import feature_for_key

            feature = feature_for_key(key)
            if feature is not None:
                by_feature.setdefault(feature, []).append(key)
                continue
        if ov.type == OverrideType.CHANGE:
            if exists:
                assigned[key] = _override_value(ov)
                continue
            if open_parent is not None:
                problems.append(
                    f"`{key}` does not exist yet; `{open_parent}` is free-form, so add it with `+{text}`."
                )
            else:
                problems.append(_unknown_key_message(key, tree, paths))
        elif ov.type == OverrideType.ADD:
            problem = _check_append(cfg_without_overrides, tree, paths, text, ov, exists, open_parent, added, assigned)
            if problem:
                problems.append(problem)
        elif ov.type == OverrideType.FORCE_ADD:
            assigned[key] = _override_value(ov)
            if exists:
                continue
            if open_parent is not None:
                added.add(key)
            else:
                problems.append(_unknown_key_message(key, tree, paths))
        elif ov.type == OverrideType.DEL:
            assigned[key] = None  # Hydra selects a deleted key as null, so a later `+key=value` adds it back
            if not exists:
                problems.append(f"cannot delete `{key}`: " + _unknown_key_message(key, tree, paths))
        else:  # pragma: no cover - Hydra has no other override types today
            problems.append(f"unsupported override `{text}`")

    for feature, keys in by_feature.items():
        if len(keys) == 1:
            problems.insert(0, _unknown_key_message(keys[0], tree, paths))
        else:
            problems.insert(0, f"`{keys[0]}` and {len(keys) - 1} more key(s) of the same command belong to "
                               f"{feature}, which this project does not implement.")
    if problems:
        raise ConfigKeyError(problems)


# --------------------------------------------------------------------------- upstream spellings

# Where upstream's scripts put the engine choice besides the root group `model_engine=...`: its scaling
# script writes `actor_rollout_ref.actor.model_engine=megatron` next to `actor.strategy=megatron`.
ENGINE_CHOICE_SPELLINGS = ("actor_rollout_ref.actor.model_engine",)


def hoist_engine_choice(overrides: Sequence[str]) -> list[str]:
    """Turn ``actor_rollout_ref.actor.model_engine=X`` into the group choice ``model_engine=X`` that picks
    every role's engine section; a different root choice in the same command is an error naming both."""
    out: list[str] = []
    chosen: dict[str, str] = {}
    for text in overrides:
        key, sep, value = text.lstrip("+").partition("=")
        if sep and key in ENGINE_CHOICE_SPELLINGS:
            chosen[text] = value
            out.append(f"model_engine={value}")
            continue
        if sep and key == "model_engine":
            chosen[text] = value
        out.append(text)
    if len(set(chosen.values())) > 1:
        raise ConfigKeyError([f"{' and '.join(f'`{t}`' for t in chosen)} pick different training engines; "
                              "keep one (`model_engine=...` picks the engine of every role)."])
    return out


def _legacy_target(key: str, tree: Any) -> Optional[tuple[str, bool, str, str]]:
    """``(new key, below a free-form node, old home, new home)`` for a legacy key whose new home exists
    here, else None."""
    for old, new in {**LEGACY_ALIASES, **SPELLING_ALIASES}.items():
        if key != old and not key.startswith(old + "."):
            continue
        target = new + key[len(old):]
        parts = target.split(".")
        if _lookup(tree, parts) is not _ABSENT:
            return target, False, old, new
        if _lookup(tree, new.split(".")) is not _ABSENT and _open_ancestor(tree, parts) is not None:
            return target, True, old, new
        return None
    return None


# Upstream moved Ulysses sequence parallelism from the role (its key there is marked deprecated) into the
# role's FSDP engine section, and a role value above 1 still wins. Workers here read the role key.
SEQUENCE_PARALLEL_HOMES = (("actor_rollout_ref.actor", "fsdp_config"), ("actor_rollout_ref.ref", "fsdp_config"),
                           ("critic", "fsdp"))


def settle_sequence_parallel(cfg: Any) -> None:
    """Give each role one Ulysses size, read from the role key: the engine section's value moves there when
    the role key is left at 1. Two different values above 1 stay for validation to refuse."""
    for role, engine in SEQUENCE_PARALLEL_HOMES:
        section = OmegaConf.select(cfg, role, default=None)
        if section is None or OmegaConf.select(section, engine, default=None) is None:
            continue  # a role that is absent, or runs on Megatron
        engine_sp = OmegaConf.select(section, f"{engine}.ulysses_sequence_parallel_size", default=1)
        if isinstance(engine_sp, int) and engine_sp > 1 and section.get("ulysses_sequence_parallel_size", 1) == 1:
            with open_dict(section):
                section.ulysses_sequence_parallel_size = engine_sp


def _is_null(ov) -> bool:
    try:
        return ov.value() is None
    except Exception:  # noqa: BLE001 - sweeps and other exotic values are not null
        return False


def _rewrite_key(text: str, old_key: str, new_key: str, force_add: bool = False) -> str:
    head_len = len(text) - len(text.lstrip("+~"))
    head, rest = text[:head_len], text[head_len:]
    if force_add and head in ("", "+"):
        head = "++"  # a key below a free-form node: add it, or set it if an earlier override added it
    return head + new_key + rest[len(old_key):]


def normalize_overrides(
    cfg_without_overrides: Any,
    overrides: Sequence[str],
    config_dir: Optional[Path] = None,
) -> tuple[list[str], list[str]]:
    """Rewrite upstream spellings into overrides Hydra composes here; returns ``(overrides, notes)``.

    * A legacy key whose new home exists (``reward_model.reward_manager``) becomes the new key, with one
      deprecation note naming it.
    * An upstream key below a free-form node, set without ``+`` as upstream's scripts do
      (``ray_kwargs.ray_init.runtime_env.py_executable=...``), is added (``++``) as upstream's config has it.

    Anything else is passed through unchanged for :func:`check_overrides` to judge. Parse errors are left
    to it as well.
    """
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import OverrideParseException

    config_dir = Path(config_dir) if config_dir is not None else CONFIG_DIR
    overrides = list(overrides)
    try:
        parsed = _parse(overrides)
    except OverrideParseException:
        return overrides, []
    tree = _as_tree(cfg_without_overrides)
    out: list[str] = []
    notes: list[str] = []
    for text, ov in zip(overrides, parsed):
        key = ov.key_or_group
        if _is_hydra_key(key) or _is_group_override(ov, config_dir):
            out.append(text)
            continue
        parts = key.split(".")
        if _lookup(tree, parts) is _ABSENT:
            legacy = _legacy_target(key, tree)
            if legacy is not None:
                new_key, below_open, old_home, new_home = legacy
                if old_home in SPELLING_ALIASES:
                    note = f"`{old_home}` is read as `{new_home}`, the key upstream's loss reads."
                    below_open = True  # `+` on the script's (absent) key sets the existing one
                else:
                    note = f"`{old_home}` is deprecated; use `{new_home}` (applied there for this run"
                    note += f": `{key}` -> `{new_key}`)." if old_home != key else ")."
                if not any(n.startswith(f"`{old_home}` ") for n in notes):  # one warning per legacy home
                    notes.append(note)
                text = _rewrite_key(text, key, new_key, force_add=below_open)
            elif (ov.type == OverrideType.CHANGE and _open_ancestor(tree, parts) is not None
                  and key in upstream_only_keys()):
                text = "++" + text
            elif ov.type in (OverrideType.CHANGE, OverrideType.ADD, OverrideType.FORCE_ADD) and _is_null(ov) \
                    and key in upstream_only_keys():
                # `trainer.default_hdfs_dir=null`: upstream's "off" for a feature that is not here anyway.
                notes.append(f"`{key}=null` turns off an upstream feature this project does not have; ignored.")
                continue
        out.append(text)
    return out, notes
