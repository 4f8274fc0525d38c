"""The PPO actor role: per-token log-probs of responses and the policy update, on any training engine.

The role owns what is PPO-specific (mini-batches and epochs, the policy-loss function with its entropy
and KL terms); the engine owns the model, micro-batching, packing, parallelism and the optimizer. Each
micro-batch's loss is scaled by global token / sequence counts (``global_batch_info``, computed by the
engine) so the update does not depend on how the batch was split.
"""

from __future__ import annotations

from typing import Any

import torch

from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.utils.py_functional import append_to_dict
from verl.workers.config import actor_config_from_omegaconf
from verl.workers.engine.base import BaseEngine, response_slice

_LOG_PROB_KEYS = ("responses", "input_ids", "attention_mask", "position_ids")


class PolicyLoss:
    """The engine's loss function for the actor: the configured policy loss (``policy_loss.loss_mode``), minus
    ``entropy_coeff`` * entropy, plus ``kl_loss_coef`` * KL to the reference when ``use_kl_loss``; with
    ``distillation`` (the enabled ``distillation`` section) the distillation term is added to that RL loss or
    replaces it (:mod:`verl.trainer.distillation.losses`)."""

    # Loss metrics are normalised over the global mini-batch in each micro-batch's share, so their
    # per-micro-batch values add up to the mini-batch value; ratios like clipfrac are averaged instead.
    summed_metrics = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/distillation/loss",
                      "actor/distillation/pg_loss")

    def __init__(self, config, distillation=None):
        self.config = config
        self.policy_loss_fn = core_algos.get_policy_loss_fn(config.policy_loss.get("loss_mode", "vanilla"))
        self.distillation = distillation

    @property
    def needs_entropy(self) -> bool:
        return self.config.entropy_coeff != 0 or bool(self.config.get("calculate_entropy", True))

    def __call__(self, outputs: dict, mb: dict) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        response_length = mb["responses"].size(-1)
        info = dict(mb["global_batch_info"])
        # What policy losses receive: the actor section as upstream's ActorConfig dataclass (verl.workers.config).
        loss_cfg = actor_config_from_omegaconf(cfg, {**info, "loss_scale_factor": cfg.get("loss_scale_factor")})
        loss_agg_mode = cfg.loss_agg_mode
        log_prob = response_slice(outputs["log_probs"], response_length)
        response_mask = mb["response_mask"].to(torch.float32)
        if self.distillation is not None:
            return self._with_distillation(outputs, mb, loss_cfg, log_prob, response_mask, info)
        return self._rl_loss(outputs, mb, loss_cfg, log_prob, response_mask, info)

    def _rl_loss(self, outputs, mb, loss_cfg, log_prob, response_mask, info):
        cfg = self.config
        loss_agg_mode = cfg.loss_agg_mode
        response_length = mb["responses"].size(-1)
        pg_loss, pg_metrics = self.policy_loss_fn(
            old_log_prob=mb["old_log_probs"], log_prob=log_prob, advantages=mb["advantages"],
            response_mask=response_mask, loss_agg_mode=loss_agg_mode, config=loss_cfg,
            rollout_is_weights=mb.get("rollout_is_weights"),
        )
        loss = pg_loss
        metrics = {"actor/pg_loss": pg_loss.detach().item(), **{k: float(v) for k, v in pg_metrics.items()}}
        if "entropy" in outputs:
            entropy = response_slice(outputs["entropy"], response_length)
            ent_loss = core_algos.agg_loss(entropy, response_mask, loss_agg_mode, **info)
            if cfg.entropy_coeff != 0:
                loss = loss - cfg.entropy_coeff * ent_loss
            metrics["actor/entropy"] = ent_loss.detach().item()
        if cfg.use_kl_loss:
            kld = core_algos.kl_penalty(log_prob, mb["ref_log_prob"], kl_penalty=cfg.kl_loss_type)
            kl_loss = core_algos.agg_loss(kld, response_mask, loss_agg_mode, **info)
            loss = loss + kl_loss * cfg.kl_loss_coef
            metrics["actor/kl_loss"] = kl_loss.detach().item()
            metrics["actor/kl_coef"] = cfg.kl_loss_coef
        return loss, metrics

    def _with_distillation(self, outputs, mb, loss_cfg, log_prob, response_mask, info):
        """Upstream's combination: with use_task_rewards the RL loss plus distillation_loss_coef times the
        distillation term; without, the distillation term alone (the RL loss is not computed, or computed for its
        metrics only when the distillation term is itself a policy gradient, as upstream logs them then)."""
        from verl.trainer.distillation.losses import distillation_loss, policy_loss_config_for

        dcfg = self.distillation.distillation_loss
        task = bool(dcfg.use_task_rewards)
        pg_form = bool(dcfg.use_policy_gradient)
        if task or pg_form:
            rl_loss, metrics = self._rl_loss(outputs, mb, loss_cfg, log_prob, response_mask, info)
        else:
            rl_loss, metrics = None, {}
        pg_cfg = policy_loss_config_for(self.config, dcfg, {**info, "loss_scale_factor":
                                                            self.config.get("loss_scale_factor")}) if pg_form else None
        d_loss, d_metrics = distillation_loss(
            dcfg, log_prob, mb["teacher_logprobs"], response_mask, self.config.loss_agg_mode, info,
            old_log_prob=mb["old_log_probs"], policy_loss_config=pg_cfg,
            rollout_is_weights=mb.get("rollout_is_weights"))
        metrics.update(d_metrics)
        metrics["actor/distillation/loss"] = d_loss.detach().item()
        coef = float(dcfg.distillation_loss_coef) if task else 1.0
        loss = d_loss * coef if not task else rl_loss + d_loss * coef
        return loss, metrics


class PPOActor:
    """The policy (``engine.role == "actor"``) or the frozen reference policy (``"ref"``) on one engine."""

    def __init__(self, config, engine: BaseEngine, distillation=None):
        self.config = config
        self.engine = engine
        # the enabled distillation section (None: off); the update then also reads teacher_logprobs
        self.distillation = distillation

    @property
    def router_replay_mode(self) -> str:
        return getattr(self.engine, "router_replay_mode", "disabled")

    @torch.no_grad()
    def compute_log_prob(self, data: DataProto, calculate_entropy: bool = False, record_routes: bool = False,
                         calculate_sum_pi_squared: bool = False):
        """Per-token log-probs (and entropies) of ``data``'s responses under the current weights, (B, R) on CPU.
        ``calculate_sum_pi_squared``: also sum_v pi(v)^2 per token, returned after the routes (if any).

        ``data.meta_info`` carries ``temperature`` and the micro-batching (``micro_batch_size`` or
        ``use_dynamic_bsz`` + ``max_token_len``). ``record_routes`` (router replay R2): also return the experts
        the forward routed every token to, (B, L, moe_layers, top_k) like ``input_ids``; otherwise a batch's
        ``routed_experts`` (R3: the rollout's) are replayed when the engine's router_replay mode is on."""
        response_length = data.batch["responses"].size(-1)
        non_tensor = ["multi_modal_inputs"] if "multi_modal_inputs" in data.non_tensor_batch else []
        keys = list(_LOG_PROB_KEYS)
        if not record_routes and self.router_replay_mode != "disabled" and "routed_experts" in data.batch.keys():
            keys.append("routed_experts")
        view = data.select(batch_keys=keys, non_tensor_batch_keys=non_tensor)
        view.meta_info = dict(data.meta_info)
        outputs = ("log_probs", "entropy") if calculate_entropy else ("log_probs",)
        if record_routes:
            outputs = outputs + ("routed_experts",)
        if calculate_sum_pi_squared:
            outputs = outputs + ("sum_pi_squared",)
        out = self.engine.infer_batch(view, outputs=outputs)
        log_probs = response_slice(out["log_probs"], response_length)
        entropy = response_slice(out["entropy"], response_length) if calculate_entropy else None
        result = (log_probs, entropy)
        if record_routes:
            result += (out["routed_experts"],)
        if calculate_sum_pi_squared:
            result += (response_slice(out["sum_pi_squared"], response_length),)
        return result

    def update_policy(self, data: DataProto) -> dict[str, Any]:
        """``ppo_epochs`` passes over ``data`` in mini-batches of ``ppo_mini_batch_size`` (per rank, in
        responses); one optimizer step each. Returns lists of per-mini-batch metrics."""
        cfg = self.config
        keys = ["responses", "response_mask", "input_ids", "attention_mask", "position_ids", "old_log_probs",
                "advantages"]
        if cfg.use_kl_loss:
            keys.append("ref_log_prob")
        if "rollout_is_weights" in data.batch.keys():
            keys.append("rollout_is_weights")
        if self.router_replay_mode != "disabled":
            # R2: recorded by the old-log-prob pass; R3: recorded by the rollout. Either way the update's
            # forwards route every token as that pass did.
            if "routed_experts" not in data.batch.keys():
                raise ValueError(f"router_replay.mode={self.router_replay_mode} but the batch has no routed_experts "
                                 "(R3 needs actor_rollout_ref.rollout.enable_rollout_routing_replay=true; R2 records "
                                 "them in the old-log-prob pass, which bypass mode skips)")
            keys.append("routed_experts")
        if self.distillation is not None:
            keys.append("teacher_logprobs")
        non_tensor = ["multi_modal_inputs"] if "multi_modal_inputs" in data.non_tensor_batch else []
        meta = {"temperature": data.meta_info["temperature"],
                "micro_batch_size": cfg.get("ppo_micro_batch_size_per_gpu"),
                "use_dynamic_bsz": bool(cfg.get("use_dynamic_bsz", False)),
                "max_token_len": cfg.get("ppo_max_token_len_per_gpu")}
        data = data.select(batch_keys=keys, non_tensor_batch_keys=non_tensor)
        loss_fn = PolicyLoss(cfg, distillation=self.distillation)
        outputs = ("log_probs", "entropy") if loss_fn.needs_entropy else ("log_probs",)
        metrics: dict[str, list] = {}
        for _epoch in range(cfg.ppo_epochs):
            for mini in data.split(cfg.ppo_mini_batch_size):
                mini.meta_info = dict(meta)
                step = self.engine.train_batch(mini, loss_fn, outputs=outputs)
                step["actor/grad_norm"] = step.pop("grad_norm")
                for key in [k for k in step if k.startswith("mtp_losses/")]:
                    step["actor/" + key] = step.pop(key)  # upstream's trainer prefixes the actor's metrics
                append_to_dict(metrics, step)
        return metrics
