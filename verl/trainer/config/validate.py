"""Semantic validation of a composed trainer config.

``validate_config`` runs before any worker starts. It gathers every problem it finds and
raises one :class:`ConfigValidationError` listing all of them, each naming the key to
change and how; soft issues are emitted as :class:`ConfigWarning`.
The batch-size rules mirror the ones upstream verl enforces in its trainer and config
dataclasses, so a config that passes here will not trip them later.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Iterable, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

__all__ = [
    "ConfigValidationError",
    "ConfigWarning",
    "compute_world_size",
    "need_critic",
    "need_reference_policy",
    "validate_config",
]

TRAIN_STRATEGIES = ("fsdp", "fsdp2", "megatron")
# Estimators whose baseline comes from the other samples of the same prompt (a warning with rollout.n=1).
GROUP_ESTIMATORS = ("grpo", "rloo", "opo", "grpo_passk", "rloo_vectorized", "grpo_vectorized",
                    "reinforce_plus_plus_baseline", "gdpo")
TRUNCATION = ("error", "left", "right", "middle")
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")


class ConfigValidationError(ValueError):
    """The config is inconsistent; ``problems`` lists one message per issue."""

    def __init__(self, problems: Iterable[str]):
        self.problems = list(problems)
        header = f"{len(self.problems)} problem(s) in the trainer config:"
        super().__init__("\n".join([header] + [f"  - {p}" for p in self.problems]))


class ConfigWarning(UserWarning):
    """A legal but probably unintended setting."""


_UNSET = object()


class _Checker:
    """Reads values defensively and records problems instead of stopping at the first."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.problems: list[str] = []
        self.notes: list[str] = []

    # -- reading ------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        try:
            value = OmegaConf.select(self.cfg, key, default=_UNSET, throw_on_missing=True)
        except MissingMandatoryValue:
            return _UNSET
        except OmegaConfBaseException as exc:
            self.fail(key, f"could not be resolved ({type(exc).__name__}: {exc})")
            return _UNSET
        if value is _UNSET:
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
        if value is _UNSET:
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
        if value is _UNSET or value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(key, f"must be a number, got {value if value is not _UNSET else 'nothing'!r}.")
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
        if value is _UNSET:
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
        """A value that must name an entry of a live registry (see :func:`_registry`)."""
        value = self.get(key)
        if value is _UNSET:
            self.fail(key, "is required but not set.")
            return None
        name = value[:-1] if strip_plus and isinstance(value, str) and value.endswith("+") else value
        reg = _registry(kind)
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
        return bool(value) if value is not _UNSET else default

    def micro_batch_pair(self, section: str, base: str, dynamic_key: str) -> None:
        """Exactly one of ``<base>`` (deprecated) and ``<base>_per_gpu`` unless dynamic batching."""
        if self.flag(f"{section}.{dynamic_key}"):
            return
        legacy, per_gpu = f"{section}.{base}", f"{section}.{base}_per_gpu"
        a, b = self.get(legacy), self.get(per_gpu)
        a = None if a is _UNSET else a
        b = None if b is _UNSET else b
        # critic.ppo_micro_batch_size_per_gpu defaults to an interpolation of the legacy key;
        # an inherited value is not a second, conflicting setting.
        if a is not None and b is not None and b == a and _is_interpolation(self.cfg, per_gpu):
            b = None
        if a is None and b is None:
            self.fail(per_gpu, f"must be set (or set `{section}.{dynamic_key}=true`): "
                               f"it is the number of samples per forward pass on one GPU.")
        elif a is not None and b is not None:
            self.fail(legacy, f"and `{per_gpu}` are both set; remove the deprecated `{legacy}`.")


def _is_interpolation(cfg: DictConfig, key: str) -> bool:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    try:
        return OmegaConf.is_config(node) and OmegaConf.is_interpolation(node, leaf)
    except Exception:
        return False


def _registry(kind: str):
    """The live registry behind a registry-backed key (imported here so plugins registered first count)."""
    if kind == "adv":
        from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY as reg
    elif kind == "policy_loss":
        from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as reg
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
    else:  # pragma: no cover - programming error
        raise KeyError(kind)
    return reg


def _loss_agg_modes() -> tuple[str, ...]:
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


# --------------------------------------------------------------------------- sections


def _check_trainer(c: _Checker) -> Optional[int]:
    nnodes = c.integer("trainer.nnodes", minimum=1)
    per_node = c.integer("trainer.n_gpus_per_node", minimum=1)
    c.integer("trainer.total_epochs", minimum=1)
    c.integer("trainer.total_training_steps", minimum=1, allow_none=True)
    launcher = c.choice("trainer.launcher", ("ray", "local"))
    if launcher == "local" and nnodes is not None and nnodes != 1:
        c.fail("trainer.nnodes", f"is {nnodes} but trainer.launcher=local runs on one node; use launcher=ray.")
    mode = c.choice("trainer.resume_mode", ("auto", "disable", "resume_path"))
    if mode == "resume_path" and not c.get("trainer.resume_from_path"):
        c.fail("trainer.resume_from_path", "must point at a checkpoint when trainer.resume_mode=resume_path.")
    c.choice("trainer.device", ("cuda", "npu", "cpu"))
    c.integer("trainer.critic_warmup", minimum=0)
    if nnodes is None or per_node is None:
        return None
    return nnodes * per_node


def _check_data(c: _Checker) -> None:
    c.integer("data.train_batch_size", minimum=1)
    c.integer("data.max_prompt_length", minimum=1)
    c.integer("data.max_response_length", minimum=1)
    c.choice("data.truncation", TRUNCATION)
    if c.get("data.val_batch_size") not in (None, _UNSET):
        c.warn("data.val_batch_size is deprecated and ignored: validation data goes to the engine as one batch.")


def _check_model(c: _Checker, prefix: str) -> None:
    rank = c.integer(f"{prefix}.lora_rank", minimum=0)
    if rank:
        c.number(f"{prefix}.lora_alpha", low=0, low_open=True)
    c.choice(f"{prefix}.fused_kernel_options.impl_backend", ("torch", "triton"))


def _check_optim(c: _Checker, prefix: str, strategy: Optional[str]) -> None:
    c.number(f"{prefix}.lr", low=0)
    c.number(f"{prefix}.lr_warmup_steps_ratio", low=0, high=1)
    if strategy in ("fsdp", "fsdp2"):
        c.choice(f"{prefix}.lr_scheduler_type", ("constant", "cosine"))
        c.choice(f"{prefix}.warmup_style", ("constant", "cosine"), allow_none=True,
                 hint=f" It is deprecated; prefer {prefix}.lr_scheduler_type.")


def _check_checkpoint(c: _Checker, prefix: str) -> None:
    for key in ("save_contents", "load_contents"):
        value = c.get(f"{prefix}.{key}")
        if value in (None, _UNSET):
            continue
        bad = [v for v in value if v not in CHECKPOINT_CONTENTS]
        if bad:
            c.fail(f"{prefix}.{key}", f"has unknown entries {bad}; allowed: {', '.join(CHECKPOINT_CONTENTS)}.")


def _parallel_dp_size(c: _Checker, section: str, strategy: str, world: int) -> Optional[int]:
    """Data-parallel size of an actor/critic section, or None after reporting a problem."""
    if strategy == "megatron":
        keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
        sizes = [c.integer(f"{section}.megatron.{k}", minimum=1) for k in keys]
        if None in sizes:
            return None
        model_parallel = sizes[0] * sizes[1] * sizes[2]
        if c.get(f"{section}.megatron.virtual_pipeline_model_parallel_size") not in (None, _UNSET) and sizes[1] < 2:
            c.fail(f"{section}.megatron.virtual_pipeline_model_parallel_size",
                   "needs pipeline_model_parallel_size > 1; set it to null.")
        if world % model_parallel:
            c.fail(f"{section}.megatron.tensor_model_parallel_size",
                   f"* pipeline * context parallel size ({model_parallel}) must divide the world size ({world}).")
            return None
        return world // model_parallel
    sp = c.integer(f"{section}.ulysses_sequence_parallel_size", minimum=1)
    if sp is None:
        return None
    if world % sp:
        c.fail(f"{section}.ulysses_sequence_parallel_size", f"({sp}) must divide the world size ({world}).")
        return None
    return world // sp


def _check_actor(c: _Checker, world: Optional[int]) -> None:
    a = "actor_rollout_ref.actor"
    strategy = c.choice(f"{a}.strategy", TRAIN_STRATEGIES)
    mini = c.integer(f"{a}.ppo_mini_batch_size", minimum=1)
    c.integer(f"{a}.ppo_epochs", minimum=1)
    for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        c.number(f"{a}.{key}", low=0, low_open=True)
    c.number(f"{a}.clip_ratio_c", low=1, low_open=True)
    c.choice(f"{a}.loss_agg_mode", _loss_agg_modes())
    c.registered(f"{a}.policy_loss.loss_mode", "policy_loss")
    c.number(f"{a}.entropy_coeff")
    if c.flag(f"{a}.use_kl_loss"):
        _check_kl_name(c, f"{a}.kl_loss_type")
        c.number(f"{a}.kl_loss_coef", low=0)
    _check_optim(c, f"{a}.optim", strategy)
    _check_checkpoint(c, f"{a}.checkpoint")

    if strategy in ("fsdp", "fsdp2"):
        sp = c.get(f"{a}.ulysses_sequence_parallel_size", 1)
        if isinstance(sp, int) and sp > 1 and not c.flag(f"{a}.use_remove_padding"):
            c.fail(f"{a}.ulysses_sequence_parallel_size",
                   f"is {sp} but sequence parallelism needs `actor_rollout_ref.model.use_remove_padding=true`.")

    if c.flag(f"{a}.use_dynamic_bsz"):
        c.integer(f"{a}.ppo_max_token_len_per_gpu", minimum=1)
        return
    c.micro_batch_pair(a, "ppo_micro_batch_size", "use_dynamic_bsz")
    train_bs = c.get("data.train_batch_size")
    n = c.get("actor_rollout_ref.rollout.n")
    if not all(isinstance(v, int) and v > 0 for v in (train_bs, n)) or mini is None or strategy is None:
        return
    if train_bs < mini:
        c.fail(f"{a}.ppo_mini_batch_size",
               f"({mini}) must be <= data.train_batch_size ({train_bs}); lower it or raise the batch size.")
    elif train_bs % mini:
        c.fail(f"{a}.ppo_mini_batch_size",
               f"({mini}) must divide data.train_batch_size ({train_bs}) so every PPO step gets whole mini-batches.")
    if world is None:
        return
    dp = _parallel_dp_size(c, a, strategy, world)
    if dp is None:
        return
    per_gpu = c.get(f"{a}.ppo_micro_batch_size_per_gpu")
    if strategy == "megatron":
        if not isinstance(per_gpu, int):
            return  # already reported by micro_batch_pair
        minimal = dp * per_gpu
    else:
        minimal = world
    if (train_bs * n) % minimal:
        c.fail("data.train_batch_size",
               f"* rollout.n = {train_bs * n} must be divisible by {minimal} "
               f"({'data-parallel size * ppo_micro_batch_size_per_gpu' if strategy == 'megatron' else 'world size'}).")
    mini_total = mini * n
    if mini_total % dp:
        c.fail(f"{a}.ppo_mini_batch_size",
               f"* rollout.n = {mini_total} must be divisible by the data-parallel size ({dp}).")
    elif isinstance(per_gpu, int) and per_gpu > 0 and (mini_total // dp) % per_gpu:
        c.fail(f"{a}.ppo_micro_batch_size_per_gpu",
               f"({per_gpu}) must divide the per-GPU mini-batch ({mini_total // dp} = "
               f"ppo_mini_batch_size * rollout.n / data-parallel size).")
    legacy = c.get(f"{a}.ppo_micro_batch_size")
    if isinstance(legacy, int) and legacy > 0:
        if mini % legacy:
            c.fail(f"{a}.ppo_micro_batch_size", f"({legacy}) must divide ppo_mini_batch_size ({mini}).")
        sp = c.get(f"{a}.ulysses_sequence_parallel_size", 1) if strategy != "megatron" else 1
        if isinstance(sp, int) and legacy * sp < world:
            c.fail(f"{a}.ppo_micro_batch_size",
                   f"({legacy}) * ulysses_sequence_parallel_size ({sp}) must be >= the world size ({world}).")


def _check_kl_name(c: _Checker, key: str) -> None:
    c.registered(key, "kl", strip_plus=True)


def _check_rollout(c: _Checker, world: Optional[int]) -> None:
    r = "actor_rollout_ref.rollout"
    name = c.registered(f"{r}.name", "rollout")
    c.choice(f"{r}.mode", ("async",), hint=" The sync rollout mode was removed upstream.")
    n = c.integer(f"{r}.n", minimum=1)
    c.number(f"{r}.temperature", low=0)
    c.number(f"{r}.top_p", low=0, high=1, low_open=True)
    c.integer(f"{r}.top_k", minimum=-1)
    c.number(f"{r}.gpu_memory_utilization", low=0, high=1, low_open=True)
    c.integer(f"{r}.val_kwargs.n", minimum=1)
    if c.flag(f"{r}.val_kwargs.do_sample"):
        temp = c.get(f"{r}.val_kwargs.temperature")
        if not isinstance(temp, (int, float)) or temp <= 0:
            c.fail(f"{r}.val_kwargs.temperature",
                   f"is {temp!r} but val_kwargs.do_sample=true needs a temperature > 0 "
                   "(or set val_kwargs.do_sample=false for greedy validation).")
    max_len = c.get(f"{r}.max_model_len")
    prompt, response = c.get(f"{r}.prompt_length"), c.get(f"{r}.response_length")
    if isinstance(max_len, int) and isinstance(prompt, int) and isinstance(response, int):
        if max_len < prompt + response:
            c.fail(f"{r}.max_model_len", f"({max_len}) is smaller than prompt_length + response_length "
                                         f"({prompt} + {response}); raise it or set it to null.")
    if name in ("vllm", "sglang") and world is not None and c.flag("actor_rollout_ref.hybrid_engine", True):
        sizes = [c.integer(f"{r}.{k}", minimum=1) for k in
                 ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size")]
        if None not in sizes and world % (sizes[0] * sizes[1] * sizes[2]):
            c.fail(f"{r}.tensor_model_parallel_size",
                   f"* data_parallel_size * pipeline_model_parallel_size ({sizes[0] * sizes[1] * sizes[2]}) "
                   f"must divide the world size ({world}).")
    c.micro_batch_pair(r, "log_prob_micro_batch_size", "log_prob_use_dynamic_bsz")

    mt = f"{r}.multi_turn"
    if c.flag(f"{mt}.enable"):  # the parser and agent-loop registries load the agent loop: only when it runs
        c.registered(f"{mt}.format", "tool_parser")
        c.registered(f"{r}.agent.default_agent_loop", "agent_loop")
    c.choice(f"{mt}.tool_response_truncate_side", ("left", "right", "middle"))
    c.choice(f"{mt}.tokenization_sanity_check_mode", ("strict", "ignore_strippable", "disable"))
    c.integer(f"{mt}.max_parallel_calls", minimum=1)
    c.integer(f"{r}.agent.num_workers", minimum=1)
    if n == 1 and c.get("algorithm.adv_estimator") in GROUP_ESTIMATORS:
        c.warn(f"algorithm.adv_estimator={c.get('algorithm.adv_estimator')} compares samples of the same prompt, "
               "but actor_rollout_ref.rollout.n=1: every advantage will be zero. Set rollout.n > 1.")


def _check_algorithm(c: _Checker) -> None:
    g = "algorithm"
    adv = c.registered(f"{g}.adv_estimator", "adv")
    c.number(f"{g}.gamma", low=0, high=1)
    c.number(f"{g}.lam", low=0, high=1)
    if c.flag(f"{g}.use_kl_in_reward"):
        _check_kl_name(c, f"{g}.kl_penalty")
        kind = c.choice(f"{g}.kl_ctrl.type", ("fixed", "adaptive"))
        c.number(f"{g}.kl_ctrl.kl_coef", low=0)
        if kind == "adaptive":
            c.integer(f"{g}.kl_ctrl.horizon", minimum=1)
            c.number(f"{g}.kl_ctrl.target_kl", low=0, low_open=True)
        if c.flag("actor_rollout_ref.actor.use_kl_loss"):
            c.warn("Both algorithm.use_kl_in_reward and actor_rollout_ref.actor.use_kl_loss are on: "
                   "the KL to the reference policy is penalised twice.")
    keys, weights = c.get(f"{g}.gdpo_reward_keys"), c.get(f"{g}.gdpo_reward_weights")
    if adv == "gdpo":
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
            c.fail(f"{g}.gdpo_reward_keys", f"is {keys!r} but adv_estimator=gdpo needs a non-empty list of the "
                                            "reward keys to normalise separately, e.g. [accuracy,format].")
        elif weights is not None and (not isinstance(weights, list) or len(weights) != len(keys)):
            c.fail(f"{g}.gdpo_reward_weights", f"is {weights!r}; give one weight per gdpo_reward_keys entry "
                                               f"({len(keys)}) or null for equal weights.")
    elif adv is not None:
        for key, value in (("gdpo_reward_keys", keys), ("gdpo_reward_weights", weights)):
            if value not in (None, _UNSET):
                c.fail(f"{g}.{key}", f"is set but only algorithm.adv_estimator=gdpo reads it (got {adv}); "
                                     "set it to null or switch the estimator.")
    enable = c.get("critic.enable")
    if adv == "gae" and enable is False:
        c.fail("critic.enable", "is false but algorithm.adv_estimator=gae needs a value model; "
                                "set critic.enable=null or pick a critic-free estimator such as grpo.")
    elif adv is not None and adv != "gae" and enable is True:
        c.warn(f"critic.enable=true trains a critic that algorithm.adv_estimator={adv} never uses.")


def _check_ref(c: _Checker) -> None:
    if not need_reference_policy(c.cfg):
        return
    f = "actor_rollout_ref.ref"
    c.choice(f"{f}.strategy", TRAIN_STRATEGIES)
    c.micro_batch_pair(f, "log_prob_micro_batch_size", "log_prob_use_dynamic_bsz")


def _check_critic(c: _Checker, world: Optional[int]) -> None:
    try:
        used = need_critic(c.cfg)
    except OmegaConfBaseException:
        used = True
    if not used:
        return
    k = "critic"
    strategy = c.choice(f"{k}.strategy", TRAIN_STRATEGIES)
    c.number(f"{k}.cliprange_value", low=0, low_open=True)
    if not _is_interpolation(c.cfg, f"{k}.loss_agg_mode"):  # inherited values were checked on the actor
        c.choice(f"{k}.loss_agg_mode", _loss_agg_modes())
    _check_optim(c, f"{k}.optim", strategy)
    _check_model(c, f"{k}.model")
    _check_checkpoint(c, f"{k}.checkpoint")
    if strategy in ("fsdp", "fsdp2"):
        sp = c.get(f"{k}.ulysses_sequence_parallel_size", 1)
        if isinstance(sp, int) and sp > 1 and not c.flag(f"{k}.model.use_remove_padding"):
            c.fail(f"{k}.ulysses_sequence_parallel_size",
                   f"is {sp} but sequence parallelism needs `critic.model.use_remove_padding=true`.")
        if world is not None and isinstance(sp, int) and sp > 0 and world % sp:
            c.fail(f"{k}.ulysses_sequence_parallel_size", f"({sp}) must divide the world size ({world}).")
    if c.flag(f"{k}.use_dynamic_bsz"):
        return
    c.micro_batch_pair(k, "ppo_micro_batch_size", "use_dynamic_bsz")
    mini = c.integer(f"{k}.ppo_mini_batch_size", minimum=1)
    train_bs = c.get("data.train_batch_size")
    if isinstance(train_bs, int) and mini is not None and train_bs < mini:
        c.fail(f"{k}.ppo_mini_batch_size", f"({mini}) must be <= data.train_batch_size ({train_bs}).")
    legacy = c.get(f"{k}.ppo_micro_batch_size")
    if isinstance(legacy, int) and legacy > 0 and mini and mini % legacy:
        c.fail(f"{k}.ppo_micro_batch_size", f"({legacy}) must divide critic.ppo_mini_batch_size ({mini}).")


def _check_reward(c: _Checker) -> None:
    source = c.choice("reward.reward_manager.source", ("register", "importlib"))
    manager = c.registered("reward.reward_manager.name", "reward_manager") if source == "register" else None
    kwargs = c.get("reward.reward_kwargs")
    if manager is not None and isinstance(kwargs, dict) and kwargs:
        init = _registry("reward_manager").get_or_raise(manager).__init__
        params = inspect.signature(init).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            unknown = sorted(k for k in kwargs if k not in params)
            if unknown:
                c.fail("reward.reward_kwargs", f"has {unknown}, which reward manager {manager!r} does not take "
                                               f"(it takes {sorted(k for k in params if k != 'self')}); "
                                               "remove them or pick the manager they belong to.")
    if source == "importlib" and not c.get("reward.reward_manager.module.path"):
        c.fail("reward.reward_manager.module.path", "must name a Python file when reward_manager.source=importlib.")
    if c.flag("reward.reward_model.enable"):
        c.fail("reward.reward_model.enable", "is true, but model-based rewards (a reward model scoring responses) "
                                             "are not implemented in this project; score with a reward function "
                                             "(reward.custom_reward_function.path) and set it to false.")
    legacy, current = c.get("custom_reward_function.path"), c.get("reward.custom_reward_function.path")
    if legacy and current and legacy != current:
        c.fail("custom_reward_function.path", f"({legacy!r}) conflicts with reward.custom_reward_function.path "
                                              f"({current!r}); keep only the latter.")


def _check_key_status(c: _Checker) -> None:
    """Upstream keys that are not implemented here (key_status.txt) keep their defaults."""
    from .key_status import check_key_status

    problems, notes = check_key_status(c.cfg)
    c.problems.extend(problems)
    c.notes.extend(notes)


def _check_profiler(c: _Checker) -> None:
    from verl.utils.profiler.config import check_profiler_config

    c.problems.extend(check_profiler_config(c.cfg))


def _check_out_of_scope(c: _Checker) -> None:
    """Upstream features selected by a combination of keys rather than by one key."""
    strategies = {c.get("actor_rollout_ref.actor.strategy"), c.get("critic.strategy")}
    if "megatron" in strategies and c.get("trainer.device") == "npu":
        c.fail("trainer.device", "is npu with a megatron strategy, which upstream runs through MindSpeed (Megatron "
                                 "on Ascend): this project does not implement MindSpeed. Use an FSDP strategy "
                                 "(model_engine=dp) on NPU.")


def _check_recipes(c: _Checker) -> None:
    """DAPO (filter_groups, gen_batch_size, the dapo reward manager's overlong buffer) and rollout correction."""
    from verl.trainer.ppo import rollout_corr

    c.integer("data.gen_batch_size", minimum=1, allow_none=True)
    fg = "algorithm.filter_groups"
    if c.flag(f"{fg}.enable"):
        c.integer(f"{fg}.max_num_gen_batches")
        if not isinstance(c.get(f"{fg}.metric"), str) or not c.get(f"{fg}.metric"):
            c.fail(f"{fg}.metric", "must name the score ('reward') or a per-sample reward_extra_info key (e.g. 'acc').")
        if c.get("actor_rollout_ref.rollout.n") == 1:
            c.warn("algorithm.filter_groups.enable=true with rollout.n=1: a group of one response cannot be "
                   "filtered, every prompt is kept.")
    rc = "algorithm.rollout_correction"
    c.choice(f"{rc}.rollout_is", rollout_corr.IS_LEVELS, allow_none=True)
    if c.get(f"{rc}.rollout_is") is not None:
        try:
            rollout_corr.parse_is_threshold(c.get(f"{rc}.rollout_is_threshold"))
        except ValueError as err:
            c.fail(f"{rc}.rollout_is_threshold", f"is invalid: {err}.")
    rs = c.get(f"{rc}.rollout_rs")
    if rs is not None:
        try:
            options = rollout_corr.parse_rs(rs)
            rollout_corr.parse_rs_thresholds(options, c.get(f"{rc}.rollout_rs_threshold"))
        except ValueError as err:
            c.fail(f"{rc}.rollout_rs", f"/ rollout_rs_threshold are invalid: {err}.")
    c.choice(f"{rc}.loss_type", rollout_corr.BYPASS_LOSS_TYPES)
    if c.flag(f"{rc}.bypass_mode"):
        mode = c.get("actor_rollout_ref.actor.policy_loss.loss_mode")
        if mode not in ("vanilla", "bypass_mode"):
            c.fail(f"{rc}.bypass_mode", f"replaces the policy loss, but actor.policy_loss.loss_mode={mode!r}; "
                                        "use loss_mode=vanilla or turn bypass_mode off.")
    elif c.get(f"{rc}.loss_type") == "reinforce":
        c.fail(f"{rc}.loss_type", "=reinforce applies only with rollout_correction.bypass_mode=true.")
    if c.get("actor_rollout_ref.rollout.multi_turn.function_tool_path") and not c.flag(
            "actor_rollout_ref.rollout.multi_turn.enable"):
        c.warn("actor_rollout_ref.rollout.multi_turn.function_tool_path is set but multi_turn.enable=false: "
               "no agent loop offers the tools.")
    if c.flag("critic.model.enable_router_aux_loss"):
        c.fail("critic.model.enable_router_aux_loss", "is for the actor only; the critic's router gets no aux loss.")
    kwargs = c.get("reward.reward_kwargs") or {}
    if not isinstance(kwargs, dict):
        return
    name = c.get("reward.reward_manager.name")
    if name != "dapo" and ({"overlong_buffer_cfg", "max_resp_len"} & set(kwargs)):
        c.fail("reward.reward_kwargs.overlong_buffer_cfg", f"is read only by the dapo reward manager (got "
                                                          f"reward.reward_manager.name={name!r}); set it to dapo.")
    ob = kwargs.get("overlong_buffer_cfg") or {}
    if name == "dapo" and isinstance(ob, dict) and ob.get("enable"):
        max_len, buf = kwargs.get("max_resp_len"), ob.get("len")
        if not isinstance(max_len, int) or max_len < 1:
            c.fail("reward.reward_kwargs.max_resp_len", "must be set (usually data.max_response_length) when "
                                                        "overlong_buffer_cfg.enable=true.")
        elif not isinstance(buf, int) or not 0 < buf <= max_len:
            c.fail("reward.reward_kwargs.overlong_buffer_cfg.len", f"must be in 1..max_resp_len ({max_len}).")


def _check_megatron(c: _Checker) -> None:
    """Roles on strategy=megatron: engine settings, parallel sizes against the model, unsupported features.
    The rules live with the engine (no megatron-core import)."""
    from verl.workers.engine.megatron.validation import megatron_problems

    c.problems.extend(megatron_problems(c.cfg))


def validate_config(cfg: DictConfig) -> None:
    """Check a composed trainer config; raise :class:`ConfigValidationError` listing every problem.

    Soft issues (e.g. KL applied both in the reward and in the loss) are reported with
    ``warnings.warn(..., ConfigWarning)`` and do not fail validation.
    """
    c = _Checker(cfg)
    world = _check_trainer(c)
    _check_data(c)
    _check_model(c, "actor_rollout_ref.model")
    _check_algorithm(c)
    _check_actor(c, world)
    _check_ref(c)
    _check_rollout(c, world)
    _check_critic(c, world)
    _check_megatron(c)
    _check_reward(c)
    _check_out_of_scope(c)
    _check_profiler(c)
    _check_key_status(c)
    _check_recipes(c)
    for note in c.notes:
        warnings.warn(note, ConfigWarning, stacklevel=2)
    if c.problems:
        # The same key can be reached from two rules; report it once.
        raise ConfigValidationError(dict.fromkeys(c.problems))
