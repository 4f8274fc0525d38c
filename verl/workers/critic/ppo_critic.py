"""The PPO critic role: values of response tokens and the clipped value-loss update, on any training engine."""

from __future__ import annotations

import torch

from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.utils.py_functional import append_to_dict
from verl.workers.engine.base import BaseEngine, response_slice


class ValueLoss:
    """The engine's loss function for the critic: PPO's clipped value loss (``cliprange_value``)."""

    summed_metrics = ("critic/vf_loss",)

    def __init__(self, config):
        self.config = config

    def __call__(self, outputs: dict, mb: dict):
        cfg = self.config
        vpreds = response_slice(outputs["values"], mb["responses"].size(-1))
        vf_loss, vf_clipfrac = core_algos.compute_value_loss(
            vpreds=vpreds, values=mb["values"], returns=mb["returns"], response_mask=mb["response_mask"].float(),
            cliprange_value=cfg.cliprange_value, loss_agg_mode=cfg.get("loss_agg_mode", "token-mean"),
            **mb["global_batch_info"])
        return vf_loss, {"critic/vf_loss": vf_loss.detach().item(), "critic/vf_clipfrac": float(vf_clipfrac)}


class PPOCritic:
    def __init__(self, config, engine: BaseEngine):
        self.config = config
        self.engine = engine

    def _meta(self, training: bool) -> dict:
        cfg = self.config
        if training:
            size, budget = cfg.get("ppo_micro_batch_size_per_gpu"), cfg.get("ppo_max_token_len_per_gpu")
        else:
            size = cfg.get("forward_micro_batch_size_per_gpu") or cfg.get("ppo_micro_batch_size_per_gpu") or 8
            budget = cfg.get("forward_max_token_len_per_gpu") or cfg.get("ppo_max_token_len_per_gpu")
        return {"micro_batch_size": size, "use_dynamic_bsz": bool(cfg.get("use_dynamic_bsz", False)),
                "max_token_len": budget}

    @torch.no_grad()
    def compute_values(self, data: DataProto) -> torch.Tensor:
        """(B, R) values of the state before each response token (zero outside the response), on CPU."""
        keys = ["responses", "input_ids", "attention_mask", "position_ids", "response_mask"]
        view = data.select(batch_keys=keys)
        view.meta_info = self._meta(training=False)
        values = self.engine.infer_batch(view, outputs=("values",))["values"]
        return response_slice(values, data.batch["responses"].size(-1)) * data.batch["response_mask"]

    def update_critic(self, data: DataProto) -> dict:
        cfg = self.config
        keys = ["responses", "input_ids", "attention_mask", "position_ids", "response_mask", "values", "returns"]
        loss_fn = ValueLoss(cfg)
        metrics: dict = {}
        for _ in range(cfg.ppo_epochs):
            for mini in data.select(batch_keys=keys).split(cfg.ppo_mini_batch_size):
                mini.meta_info = self._meta(training=True)
                step = self.engine.train_batch(mini, loss_fn, outputs=("values",))
                step["critic/grad_norm"] = step.pop("grad_norm")
                append_to_dict(metrics, step)
        return metrics
