"""The reading and reporting machinery behind :func:`verl.trainer.config.validate.validate_config`.

:class:`Checker` reads a composed config defensively and collects every problem (one message per issue,
naming the key) instead of stopping at the first; the section rules live in ``role_checks`` (trainer, data,
actor, rollout, reference, critic) and ``algo_checks`` (algorithm, reward, recipes, features left out).
Registry-backed keys are checked against the live registries through :func:`live_registry`, so whatever a
user registers before ``main_ppo`` runs is accepted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

__all__ = [
    "CONFIG_DIR",
    "UNSET",
    "Checker",
    "ConfigValidationError",
    "ConfigWarning",
    "check_kl_name",
    "train_strategy",
    "compute_world_size",
    "is_interpolation",
    "live_registry",
    "loss_agg_modes",
    "need_critic",
    "need_reference_policy",
]

CONFIG_DIR = Path(__file__).resolve().parent


class ConfigValidationError(ValueError):
    """The config is inconsistent; ``problems`` lists one message per issue."""

    def __init__(self, problems: Iterable[str]):
        self.problems = list(problems)
        header = f"{len(self.problems)} problem(s) in the trainer config:"
        super().__init__("\n".join([header] + [f"  - {p}" for p in self.problems]))


class ConfigWarning(UserWarning):
    """A legal but probably unintended setting."""


UNSET = object()


class Checker:
    """Reads values defensively and records problems instead of stopping at the first."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.problems: list[str] = []
        self.notes: list[str] = []

    # -- reading ------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        try:
            value = OmegaConf.select(self.cfg, key, default=UNSET, throw_on_missing=True)
        except MissingMandatoryValue:
            return UNSET
        except OmegaConfBaseException as exc:
            self.fail(key, f"could not be resolved ({type(exc).__name__}: {exc})")
            return UNSET
        if value is UNSET:
            return default
        if OmegaConf.is_config(value):
            return OmegaConf.to_container(value, resolve=True)
        return value

    def fail(self, key: str, message: str) -> None:
        self.problems.append(f"`{key}` {message}")

    def warn(self, message: str) -> None:
        self.notes.append(message)

    # -- typed checks (each returns the value, or None when it is unusable) ---------------
    def integer(self, key: str, minimum: Optional[int] = None, allow_none: bool = False) -> Optional[int]:
        value = self.get(key)
        if value is UNSET:
            self.fail(key, "is required but not set.")
            return None
        if value is None:
            if not allow_none:
                self.fail(key, "must be an integer, got null.")
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(key, f"must be an integer, got {value!r}.")
            return None
        if minimum is not None and value < minimum:
            self.fail(key, f"must be >= {minimum}, got {value}.")
            return None
        return value

    def number(self, key: str, low: Optional[float] = None, high: Optional[float] = None,
               low_open: bool = False, high_open: bool = False) -> Optional[float]:
        value = self.get(key)
        if value is UNSET or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(key, f"must be a number, got {value if value is not UNSET else 'nothing'!r}.")
            return None
        bad_low = low is not None and (value <= low if low_open else value < low)
        bad_high = high is not None and (value >= high if high_open else value > high)
        if bad_low or bad_high:
            lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
            hi = "" if high is None else f"{'<' if high_open else '<='} {high}"
            self.fail(key, f"must be {' and '.join(x for x in (lo, hi) if x)}, got {value}.")
            return None
        return value

    def choice(self, key: str, choices: Iterable[Any], allow_none: bool = False, hint: str = "") -> Any:
        value = self.get(key)
        choices = tuple(choices)
        if value is UNSET:
            self.fail(key, f"is required: set it to one of {', '.join(map(str, choices))}.")
            return None
        if value is None and allow_none:
            return None
        if value not in choices:
            from .unsupported import feature_for_value

            feature = feature_for_value(key, value)
            if feature:
                hint = f" {value!r} selects {feature}, which this project does not implement.{hint}"
            self.fail(key, f"is {value!r}; valid values are {', '.join(map(str, choices))}.{hint}")
            return None
        return value

    def registered(self, key: str, kind: str, strip_plus: bool = False) -> Any:
        """A value that must name an entry of a live registry (see :func:`live_registry`)."""
        value = self.get(key)
        if value is UNSET:
            self.fail(key, "is required but not set.")
            return None
        name = value[:-1] if strip_plus and isinstance(value, str) and value.endswith("+") else value
        reg = live_registry(kind)
        if reg.known(name):
            return value
        from .unsupported import feature_for_value

        feature = feature_for_value(key, name)
        known = ", ".join(reg.names() + sorted(reg.aliases))
        extra = " (optionally with a trailing '+')" if strip_plus else ""
        if feature:
            self.fail(key, f"is {value!r}, which selects {feature}: this project does not implement it. "
                           f"Registered {reg.kind}s: {known}{extra}.")
        else:
            self.fail(key, f"is {value!r}, not a registered {reg.kind}; registered: {known}{extra}. "
                           f"Register your own before main_ppo runs, or pick one of those.")
        return None

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.get(key, default)
        return bool(value) if value is not UNSET else default

    def micro_batch_pair(self, section: str, base: str, dynamic_key: str) -> None:
        """Exactly one of ``<base>`` (deprecated) and ``<base>_per_gpu`` unless dynamic batching."""
        if self.flag(f"{section}.{dynamic_key}"):
            return
        legacy, per_gpu = f"{section}.{base}", f"{section}.{base}_per_gpu"
        a, b = self.get(legacy), self.get(per_gpu)
        a = None if a is UNSET else a
        b = None if b is UNSET else b
        # critic.ppo_micro_batch_size_per_gpu defaults to an interpolation of the legacy key;
        # an inherited value is not a second, conflicting setting.
        if a is not None and b is not None and b == a and is_interpolation(self.cfg, per_gpu):
            b = None
        if a is None and b is None:
            self.fail(per_gpu, f"must be set (or set `{section}.{dynamic_key}=true`): "
                               f"it is the number of samples per forward pass on one GPU.")
        elif a is not None and b is not None:
            self.fail(legacy, f"and `{per_gpu}` are both set; remove the deprecated `{legacy}`.")


def is_interpolation(cfg: DictConfig, key: str) -> bool:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    try:
        return OmegaConf.is_config(node) and OmegaConf.is_interpolation(node, leaf)
    except Exception:
        return False


def live_registry(kind: str):
    """The live registry behind a registry-backed key (imported here so plugins registered first count)."""
    if kind == "adv":
        from verl.trainer.ppo.core_algos import adv_estimator_registry

        reg = adv_estimator_registry()
    elif kind == "policy_loss":
        from verl.trainer.ppo.core_algos import policy_loss_registry

        reg = policy_loss_registry()
    elif kind == "kl":
        from verl.trainer.ppo.kl import KL_ESTIMATOR_REGISTRY as reg
    elif kind == "rollout":
        from verl.workers.rollout.base import ROLLOUT_REGISTRY as reg
    elif kind == "reward_manager":
        import verl.workers.reward_manager  # noqa: F401  (registers the built-in managers)
        from verl.workers.reward_manager.registry import REWARD_MANAGER_REGISTRY as reg
    elif kind == "tool_parser":
        from verl.experimental.agent_loop.tool_parser import TOOL_PARSER_REGISTRY as reg
    elif kind == "agent_loop":
        import verl.experimental.agent_loop  # noqa: F401  (registers the built-in loops)
        from verl.experimental.agent_loop.agent_loop import AGENT_LOOP_REGISTRY as reg
    elif kind == "engine":
        from verl.workers.engine import EngineRegistry as reg  # the package registers fsdp2 and megatron
    else:  # pragma: no cover - programming error
        raise KeyError(kind)
    return reg


def loss_agg_modes() -> tuple[str, ...]:
    from verl.trainer.ppo.loss_agg import AGG_LOSS_MODES

    return tuple(AGG_LOSS_MODES)


def compute_world_size(cfg: DictConfig) -> int:
    """Total trainer processes: ``trainer.nnodes * trainer.n_gpus_per_node``."""
    return int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)


def need_reference_policy(cfg: DictConfig) -> bool:
    """A reference policy is needed whenever a KL term is used."""
    return bool(OmegaConf.select(cfg, "algorithm.use_kl_in_reward", default=False)) or bool(
        OmegaConf.select(cfg, "actor_rollout_ref.actor.use_kl_loss", default=False)
    )


def need_critic(cfg: DictConfig) -> bool:
    """``critic.enable`` when set, otherwise true exactly for GAE."""
    enable = OmegaConf.select(cfg, "critic.enable", default=None)
    if enable is not None:
        return bool(enable)
    return OmegaConf.select(cfg, "algorithm.adv_estimator", default="gae") == "gae"


def check_kl_name(c: Checker, key: str) -> None:
    """A KL estimator name, optionally with upstream's trailing '+' (straight-through gradient)."""
    c.registered(key, "kl", strip_plus=True)


def train_strategy(c: Checker, key: str) -> Optional[str]:
    """``<role>.strategy``: a training engine of the live registry (a user's own engine registered before
    ``main_ppo`` runs counts). Returns the canonical name (``fsdp`` -> ``fsdp2``; the engine itself warns once
    that ``fsdp`` runs FSDP2), or None after reporting a problem. Rules written for fsdp2 / megatron test the
    canonical name, so a user's engine gets only the engine-independent checks."""
    value = c.registered(key, "engine")
    return live_registry("engine").canonical(value) if value is not None else None
