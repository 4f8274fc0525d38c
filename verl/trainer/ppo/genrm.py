"""Generative reward models in the trainer: when they are on, the router's life cycle, and their metrics.

Upstream's semantics (``verl/experimental/reward_loop``): with ``reward.reward_model.enable=true`` *and* a custom
reward function, the reward model is served for the function to query (``reward_router_address``) and the
function's score is the reward; without a custom function the reward model is discriminative and its score is the
reward. This module decides which, starts the router before the reward managers are built (they need its
address), and connects it to the judge's workers once those are up.
"""

from __future__ import annotations

from collections import Counter

from omegaconf import DictConfig, OmegaConf

from verl.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto

__all__ = ["GENRM_ROLE", "attach_judge", "is_generative", "start_router", "verdict_metrics"]

GENRM_ROLE = "genrm"  # the worker group's key (the discriminative model's is "reward_model")


def is_generative(cfg) -> bool:
    """Reward model on and a custom reward function set (either spelling): the generative route."""
    if not OmegaConf.select(cfg, "reward.reward_model.enable", default=False):
        return False
    return bool(OmegaConf.select(cfg, "reward.custom_reward_function.path", default=None)
                or OmegaConf.select(cfg, "custom_reward_function.path", default=None))


def start_router(cfg: DictConfig):
    """The judge's router, serving (requests wait for :func:`attach_judge`), and its tokenizer."""
    from verl.utils.tokenizer import load_tokenizer_and_processor
    from verl.workers.reward_model.genrm_router import GenRMRouter, JudgeDefaults

    rm = cfg.reward.reward_model
    tokenizer, _ = load_tokenizer_and_processor(
        OmegaConf.create({"path": rm.model_path, "trust_remote_code": bool(rm.get("trust_remote_code", False))}),
        section="reward.reward_model")
    return GenRMRouter(tokenizer, JudgeDefaults.from_config(rm.get("rollout"))), tokenizer


def attach_judge(router, worker_group) -> None:
    """Route the router's batches to the judge workers: padded to their data-parallel size, split over the ranks."""
    from verl.workers.reward_model.genrm_worker import pack_prompts, unpack_verdicts

    dp = int(getattr(worker_group, "dp_size", None) or worker_group.world_size)

    def backend(prompts, params):
        padded, pad = pad_dataproto_to_divisor(pack_prompts(prompts, params), dp)
        out: DataProto = unpad_dataproto(worker_group.generate_verdicts(padded), pad)
        return unpack_verdicts(out)

    router.attach(backend)


def verdict_metrics(extra: dict) -> dict[str, float]:
    """``reward/genrm/verdict_<status>``: how many responses' verdicts were ok, missing, malformed or out of
    range (the built-in GenRM scorer reports one status per response); empty when no such column."""
    from verl.utils.reward_score.genrm import VERDICT_KEY, VERDICT_STATUSES

    column = extra.get(VERDICT_KEY)
    if column is None:
        return {}
    counts = Counter(str(v) for v in column)
    return {f"reward/genrm/verdict_{s}": float(counts.get(s, 0)) for s in VERDICT_STATUSES}
