"""The default reward manager: score each response with a rule function, one sample at a time."""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import signal
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from verl.utils.reward_score import default_compute_score
from verl.workers.reward_manager.registry import register

if TYPE_CHECKING:
    from verl import DataProto


class _TimeLimit:
    """Context manager raising TimeoutError after ``seconds`` via SIGALRM.

    Signals can only be installed on the main thread; elsewhere (or with no limit) it does nothing, so
    scoring still runs, just unbounded.
    """

    def __init__(self, seconds: float | None):
        self.seconds = seconds if seconds and seconds > 0 else None
        self._saved = None

    def _alarm(self, signum, frame):
        raise TimeoutError(f"compute_score took longer than {self.seconds}s")

    def __enter__(self):
        if self.seconds is not None:
            try:
                self._saved = signal.signal(signal.SIGALRM, self._alarm)
            except ValueError:
                self.seconds = None
            else:
                signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc):
        if self.seconds is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._saved)
        return False


def _fn_name(fn) -> str:
    own = getattr(fn, "__qualname__", None)  # custom-reward partials carry a descriptive one
    if own:
        return own
    inner = getattr(fn, "func", fn)  # plain functools.partial
    return getattr(inner, "__qualname__", None) or getattr(inner, "__name__", None) or repr(inner)


def _as_float(value) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, np.ndarray) and value.size == 1:
        value = value.item()
    if isinstance(value, numbers.Real):
        return float(value)
    return None


@register("naive")
class NaiveRewardManager:
    """Decode every response, score it with ``compute_score``, and put the score on its last valid token.

    Args:
        tokenizer: decodes prompt/response ids for the scorer.
        num_examine: how many decoded samples per data source to print each call (for eyeballing).
        compute_score: ``f(data_source, solution_str, ground_truth, extra_info) -> float | dict``;
            defaults to :func:`verl.utils.reward_score.default_compute_score`.
        reward_fn_key: non-tensor key holding each sample's data source.
        compute_score_timeout: optional per-sample limit in seconds; a sample over it scores 0.0.
        reward_router_address, reward_model_tokenizer: a generative reward model's chat endpoint and tokenizer
            (``reward.reward_model`` with a custom function); when set, ``compute_score`` receives both as keyword
            arguments, as upstream's reward loop passes them.

    An ``async def`` scoring function runs on all rows of a batch at once (each on its own worker thread with its
    own event loop), so its requests (a judge model's, say) are in flight together.
    """

    max_concurrent_rows = 64

    def __init__(
        self,
        tokenizer,
        num_examine: int,
        compute_score=None,
        reward_fn_key: str = "data_source",
        compute_score_timeout: float | None = None,
        reward_router_address: str | None = None,
        reward_model_tokenizer=None,
        **kwargs: Any,
    ) -> None:
        self.tokenizer = tokenizer
        self.num_examine = num_examine
        self.compute_score = compute_score or default_compute_score
        self.reward_fn_key = reward_fn_key
        self.compute_score_timeout = compute_score_timeout
        self.router_kwargs = ({"reward_router_address": reward_router_address,
                               "reward_model_tokenizer": reward_model_tokenizer}
                              if reward_router_address is not None else {})
        self.is_async = inspect.iscoroutinefunction(self.compute_score)
        self.extra_kwargs = kwargs  # other managers' options; unused here but accepted for config symmetry

    def _non_tensor(self, data: DataProto, key: str, row: int, required: bool = True):
        column = data.non_tensor_batch.get(key)
        if column is None:
            if not required:
                return None
            raise KeyError(
                f"NaiveRewardManager: the batch has no non-tensor key {key!r} (needed for row {row}); "
                f"it has {sorted(data.non_tensor_batch)}. Keep it in the dataset rows"
                + (" or set reward_fn_key / data.reward_fn_key" if key == self.reward_fn_key else "")
            )
        return column[row]

    def _score_one(self, row: int, data_source, response_str: str, ground_truth, extra_info) -> tuple[float, dict]:
        name = _fn_name(self.compute_score)
        try:
            call = dict(data_source=data_source, solution_str=response_str, ground_truth=ground_truth,
                        extra_info=extra_info, **self.router_kwargs)
            if self.is_async:
                result = asyncio.run(asyncio.wait_for(self.compute_score(**call), self.compute_score_timeout or None))
            else:
                with _TimeLimit(self.compute_score_timeout):
                    result = self.compute_score(**call)
        except (TimeoutError, asyncio.TimeoutError):
            print(
                f"[NaiveRewardManager] {name} exceeded {self.compute_score_timeout}s on row {row} "
                f"(data_source={data_source!r}); scoring it 0.0"
            )
            return 0.0, {}
        except Exception as err:
            raise RuntimeError(
                f"NaiveRewardManager: reward function {name} raised {type(err).__name__} on row {row} "
                f"(data_source={data_source!r}): {err}"
            ) from err
        if isinstance(result, dict):
            if "score" not in result:
                raise ValueError(
                    f"NaiveRewardManager: reward function {name} returned a dict without 'score' on row {row} "
                    f"(data_source={data_source!r}); its keys were {sorted(result)}"
                )
            score = _as_float(result["score"])
            extras = dict(result)
        else:
            score, extras = _as_float(result), {}
        if score is None:
            bad = result["score"] if isinstance(result, dict) else result
            raise TypeError(
                f"NaiveRewardManager: reward function {name} returned {type(bad).__name__} {bad!r} on row {row} "
                f"(data_source={data_source!r}); it must return a number or a dict with a numeric 'score'"
            )
        if not math.isfinite(score):
            # A NaN/inf reward would make every advantage of its group NaN, then the update: refuse it here,
            # where the function and the row are known.
            raise ValueError(
                f"NaiveRewardManager: reward function {name} returned {score} on row {row} "
                f"(data_source={data_source!r}, response {response_str[:80]!r}); a reward must be a finite number"
            )
        return score, extras

    def __call__(self, data: DataProto, return_dict: bool = False) -> torch.Tensor | dict[str, Any]:
        keys = set(data.batch.keys())
        if "rm_scores" in keys:  # a reward model already scored this batch
            if not return_dict:
                return data.batch["rm_scores"]
            meta = getattr(data, "meta_info", None) or {}
            extra = {k: data.non_tensor_batch[k] for k in meta.get("reward_extra_keys", [])}
            return {"reward_tensor": data.batch["rm_scores"], "reward_extra_info": extra}
        for needed in ("prompts", "responses", "attention_mask"):
            if needed not in keys:
                raise KeyError(f"NaiveRewardManager: the batch has no tensor {needed!r}; it has {sorted(keys)}")

        prompts = data.batch["prompts"]
        responses = data.batch["responses"]
        attention_mask = data.batch["attention_mask"]
        prompt_len = prompts.shape[-1]
        reward_tensor = torch.zeros(responses.shape, dtype=torch.float32, device=responses.device)
        per_row_extras: list[dict] = []
        printed: dict[Any, int] = defaultdict(int)

        rows = []
        for i in range(len(data)):
            prompt_mask = attention_mask[i, :prompt_len].bool()
            response_mask = attention_mask[i, prompt_len:].bool()
            prompt_str = self.tokenizer.decode(prompts[i][prompt_mask].tolist(), skip_special_tokens=True)
            response_str = self.tokenizer.decode(responses[i][response_mask].tolist(), skip_special_tokens=True)

            data_source = self._non_tensor(data, self.reward_fn_key, i)
            reward_model = self._non_tensor(data, "reward_model", i)
            if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
                raise KeyError(
                    f"NaiveRewardManager: row {i} (data_source={data_source!r}) has no reward_model['ground_truth']; "
                    f"got reward_model={reward_model!r}"
                )
            ground_truth = reward_model["ground_truth"]
            extra_info = self._non_tensor(data, "extra_info", i, required=False)
            extra_info = dict(extra_info) if isinstance(extra_info, dict) else {}
            extra_info["num_turns"] = self._non_tensor(data, "__num_turns__", i, required=False)
            extra_info["rollout_reward_scores"] = self._non_tensor(data, "reward_scores", i, required=False) or {}
            rows.append((i, data_source, response_str, ground_truth, extra_info, prompt_str, response_mask))

        if self.is_async and len(rows) > 1:
            with ThreadPoolExecutor(max_workers=min(len(rows), self.max_concurrent_rows)) as pool:
                scored = list(pool.map(lambda r: self._score_one(*r[:5]), rows))
        else:
            scored = [self._score_one(*r[:5]) for r in rows]

        for (i, data_source, response_str, ground_truth, _, prompt_str, response_mask), (score, extras) in zip(
                rows, scored, strict=True):
            per_row_extras.append(extras)
            valid = torch.nonzero(response_mask).flatten()
            # An empty response has no token to carry the score; position 0 is masked out downstream anyway.
            last = int(valid[-1]) if len(valid) else 0
            reward_tensor[i, last] = score

            if printed[data_source] < self.num_examine:
                printed[data_source] += 1
                print("[prompt]", prompt_str)
                print("[response]", response_str)
                print("[ground_truth]", ground_truth)
                for key, value in (extras or {"score": score}).items():
                    print(f"[{key}]", value)

        # One list entry per row for every key any row reported, so the lists line up with the batch.
        extra_keys = list(dict.fromkeys(k for extras in per_row_extras for k in extras))
        reward_extra_info = {k: [extras.get(k) for extras in per_row_extras] for k in extra_keys}
        if return_dict:
            return {"reward_tensor": reward_tensor, "reward_extra_info": reward_extra_info}
        return reward_tensor
