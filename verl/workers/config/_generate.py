"""Build config dataclasses from the trainer's YAML files, so the YAML stays the one place keys and defaults live.

A YAML section becomes a dataclass whose fields are its keys, with the YAML's values as defaults.
Interpolations are resolved against the file itself: ``${oc.select:other.key,fallback}`` outside the
composed config gives its fallback, ``${.sibling}`` the sibling's value. ``???`` (and anything that does not
resolve on its own) defaults to None. Keys named in ``sections`` are typed with their own dataclass (attribute
access, ``cfg.optim.lr``); other nested mappings stay dicts, as upstream's free-form ones do.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from verl.workers.config.base import BaseConfig

CONFIG_DIR = Path(__file__).resolve().parents[2] / "trainer" / "config"


def load_yaml(relpath: str) -> DictConfig:
    """``verl/trainer/config/<relpath>`` without its Hydra ``defaults`` list (those mount other files)."""
    raw = OmegaConf.load(CONFIG_DIR / relpath)
    if "defaults" in raw:
        del raw["defaults"]
    return raw


def yaml_defaults(section: DictConfig) -> dict[str, Any]:
    """Each key's default as a plain value (see the module docstring for interpolations)."""
    out = {}
    for key in section.keys():
        try:
            value = section[key]
            if OmegaConf.is_config(value):
                value = OmegaConf.to_container(value, resolve=True)
        except Exception:  # noqa: BLE001 - ``???`` or an interpolation only the composed config can resolve
            value = None
        out[str(key)] = None if value == "???" else value
    return out


def _field(value, typed: Optional[type] = None) -> tuple[type, dataclasses.Field]:
    if typed is not None:
        return typed, dataclasses.field(default_factory=typed)
    if isinstance(value, (dict, list)):
        return type(value), dataclasses.field(default_factory=lambda v=value: copy.deepcopy(v))
    return (Any if value is None else type(value)), dataclasses.field(default=value)


def make_config(name: str, defaults: dict[str, Any], module: str, doc: str, bases: tuple = (BaseConfig,),
                sections: Optional[dict[str, type]] = None, skip: tuple = (), extra_fields: tuple = (),
                namespace: Optional[dict] = None) -> type:
    """A dataclass named ``name`` with one field per key of ``defaults`` (minus ``skip``), in ``module``."""
    sections = dict(sections or {})
    fields = []
    for key, value in defaults.items():
        if key in skip:
            continue
        ftype, fdef = _field(value, sections.pop(key, None))
        fields.append((key, ftype, fdef))
    for key, typed in sections.items():  # typed sections the YAML mounts from other files (optim, profiler)
        fields.append((key, typed, dataclasses.field(default_factory=typed)))
    cls = dataclasses.make_dataclass(name, fields + list(extra_fields), bases=bases, namespace=namespace)
    cls.__module__ = module  # pickling (Ray) finds the class there
    cls.__doc__ = doc
    return cls


def split_family(members: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Keys every member shares with one default (the base class's fields), and each member's own keys
    (the rest, including shared keys whose default differs: the subclass overrides the default)."""
    first, *rest = members.values()
    common = {k: v for k, v in first.items() if all(k in m and m[k] == v for m in rest)}
    own = {name: {k: v for k, v in m.items() if k not in common} for name, m in members.items()}
    return common, own


def section_classes(cls: type) -> dict[str, type]:
    """Fields of ``cls`` typed with a generated config dataclass."""
    return {f.name: f.type for f in dataclasses.fields(cls)
            if isinstance(f.type, type) and issubclass(f.type, BaseConfig)}


def build(cls: type, data: dict, where: str, **overrides) -> BaseConfig:
    """``cls`` from a composed (resolved) section, nested sections included. A key the dataclass does not
    declare is an error naming it: the composed config only holds YAML keys, so it means the YAML and this
    package disagree."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping of keys to values, got {type(data).__name__}: {data!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names - set(overrides))
    if unknown:
        raise ValueError(f"{where} has keys {unknown} that {cls.__name__} does not declare; add them to the YAML "
                         f"under verl/trainer/config/ that defines {where.rsplit('.', 1)[-1]}")
    kwargs = dict(data)
    for key, sub in section_classes(cls).items():
        if key in kwargs:
            kwargs[key] = build(sub, kwargs[key], f"{where}.{key}")
    kwargs.update(overrides)
    return cls(**kwargs)
