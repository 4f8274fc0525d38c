"""Building the trainer's reward function from config and applying it to a batch.

Config locations (both understood, the newer one wins when it sets a value):

* custom scorer: ``reward.custom_reward_function.{path,name,reward_kwargs}`` (verl >= 0.6) or the older
  top-level ``custom_reward_function.{path,name,reward_kwargs}``;
* manager: ``reward.reward_manager.{name,source,module.path}`` or the older ``reward_model.reward_manager``
  (a plain name); default ``naive``.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any

from verl.utils.reward_score import get_default_compute_score
from verl.utils.config import cfg_get, to_plain

if TYPE_CHECKING:
    from verl import DataProto

__all__ = ["get_custom_reward_fn", "load_reward_manager", "compute_reward", "extract_reward"]


def _custom_fn_section(config):
    newer = cfg_get(cfg_get(config, "reward"), "custom_reward_function")
    if cfg_get(newer, "path"):
        return newer, "reward.custom_reward_function"
    return cfg_get(config, "custom_reward_function"), "custom_reward_function"


def _merge_kwargs_call(raw_fn, fixed_kwargs, *args, **kwargs):
    return raw_fn(*args, **{**kwargs, **fixed_kwargs})


async def _merge_kwargs_call_async(raw_fn, fixed_kwargs, *args, **kwargs):
    return await raw_fn(*args, **{**kwargs, **fixed_kwargs})


def get_custom_reward_fn(config):
    """The user's scoring function from ``custom_reward_function.path``, with ``reward_kwargs`` bound; else None.

    Raises:
        FileNotFoundError: the file does not exist.
        RuntimeError: importing the file failed.
        AttributeError: the file has no function of the configured name.
    """
    section, where = _custom_fn_section(config)
    path = cfg_get(section, "path")
    if not path:
        return None
    name = cfg_get(section, "name", "compute_score")
    from verl.utils.dataset.rl_dataset import _load_object_from_path

    raw_fn = _load_object_from_path(path, name, f"{where} (path={path!r}, name={name!r})")
    if not callable(raw_fn):
        raise TypeError(f"{where}: {name!r} in {path!r} is a {type(raw_fn).__name__}, not a function")
    fixed_kwargs = dict(to_plain(cfg_get(section, "reward_kwargs", {})))
    wrapper = _merge_kwargs_call_async if inspect.iscoroutinefunction(raw_fn) else _merge_kwargs_call
    fn = functools.partial(wrapper, raw_fn, fixed_kwargs)
    fn.__qualname__ = f"{name} (from {path})"  # error messages of reward managers name the user function
    return fn


def _manager_cls(config):
    from verl.workers.reward_manager import get_reward_manager_cls

    section = cfg_get(cfg_get(config, "reward"), "reward_manager")
    if section is not None and not isinstance(section, str):
        name = cfg_get(section, "name", "naive")
        source = cfg_get(section, "source", "register")
        if source == "importlib":
            module_path = cfg_get(cfg_get(section, "module"), "path")
            if not module_path:
                raise ValueError("reward.reward_manager.source='importlib' needs reward.reward_manager.module.path")
            from verl.utils.dataset.rl_dataset import _load_object_from_path

            return _load_object_from_path(module_path, name, "reward.reward_manager.module")
        if source != "register":
            raise ValueError(f"reward.reward_manager.source={source!r} is not supported; use 'register' or 'importlib'")
        return get_reward_manager_cls(name)
    name = section if isinstance(section, str) else cfg_get(cfg_get(config, "reward_model"), "reward_manager", "naive")
    return get_reward_manager_cls(name)


def load_reward_manager(config, tokenizer, num_examine: int, **reward_kwargs: Any):
    """Instantiate the configured reward manager with the custom (or default) scoring function."""
    manager_cls = _manager_cls(config)
    compute_score = get_custom_reward_fn(config) or get_default_compute_score(getattr(manager_cls, "__name__", None))
    reward_fn_key = cfg_get(cfg_get(config, "data"), "reward_fn_key", "data_source")
    if "experiment_name" in inspect.signature(manager_cls).parameters:  # the gdpo manager hands it to the scorer
        reward_kwargs.setdefault("experiment_name", cfg_get(cfg_get(config, "trainer"), "experiment_name"))
    return manager_cls(
        tokenizer=tokenizer,
        num_examine=num_examine,
        compute_score=compute_score,
        reward_fn_key=reward_fn_key,
        **reward_kwargs,
    )


def _accepts_return_dict(reward_fn) -> bool:
    try:
        params = inspect.signature(reward_fn).parameters
    except (TypeError, ValueError):
        return True
    return "return_dict" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def compute_reward(data: DataProto, reward_fn) -> tuple[Any, dict[str, Any]]:
    """Run ``reward_fn`` on ``data``: ``(token_level_scores [B, response_len], extra-info lists by key)``.

    Errors from the reward function propagate (a silently unscored batch would train on garbage); a result
    without scores is the reward manager's mistake, reported as a reward error.
    """
    if not _accepts_return_dict(reward_fn):
        return _finite_scores(reward_fn(data), reward_fn), {}
    result = reward_fn(data, return_dict=True)
    if isinstance(result, dict):
        if "reward_tensor" not in result:
            from verl.utils.user_errors import UserFacingError

            raise UserFacingError(
                "Reward", f"the reward manager ({_name(reward_fn)}) returned a dict without 'reward_tensor' "
                f"(its keys: {sorted(result)})",
                "With return_dict=True a reward manager returns {'reward_tensor': token-level scores [batch, "
                "response length], 'reward_extra_info': {key: list per row}}; fix reward.reward_manager or "
                "reward.custom_reward_function.")
        return _finite_scores(result["reward_tensor"], reward_fn), dict(result.get("reward_extra_info") or {})
    return _finite_scores(result, reward_fn), {}


def _name(reward_fn) -> str:
    return getattr(reward_fn, "__qualname__", None) or type(reward_fn).__qualname__


def _finite_scores(scores, reward_fn):
    """``scores`` unchanged; a NaN/inf anywhere (from any reward manager, a reward model's ``rm_scores`` included)
    is a reward error naming the manager and the first rows holding one."""
    import torch

    if isinstance(scores, torch.Tensor) and scores.is_floating_point() and not bool(torch.isfinite(scores).all()):
        from verl.utils.user_errors import UserFacingError

        rows = (~torch.isfinite(scores)).reshape(len(scores), -1).any(-1).nonzero().flatten().tolist()
        values = [scores[r][~torch.isfinite(scores[r])][0].item() for r in rows[:5]]
        raise UserFacingError(
            "Reward", f"the reward manager ({_name(reward_fn)}) gave a non-finite score on row"
            f"{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows[:5]))}{' ...' if len(rows) > 5 else ''} "
            f"of the batch ({', '.join(map(str, values))})",
            "A reward must be a finite number: NaN/inf would turn the group's advantages and the update into NaN. "
            "Fix reward.custom_reward_function / the reward manager.")
    return scores


def extract_reward(batch: DataProto):
    """Scores already written into the batch by a reward model/loop: ``(rm_scores, extra infos)``."""
    reward_tensor = batch.batch["rm_scores"]
    keys = (getattr(batch, "meta_info", None) or {}).get("reward_extra_keys", [])
    return reward_tensor, {key: batch.non_tensor_batch[key] for key in keys}
