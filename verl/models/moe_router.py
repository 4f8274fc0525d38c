"""MoE router safety for RL: the HF load-balancing auxiliary loss is off unless asked for.

Hugging Face MoE models (Qwen3.5-MoE, Qwen3-MoE, Mixtral, ...) collect every layer's router logits and compute
a load-balancing loss whenever ``config.output_router_logits`` is true, and some checkpoints ship it true.
In RL that is wrong twice over: the logits of every token of every layer are kept alive for nothing in the
rollout and log-prob passes, and a trainer that adds ``router_aux_loss_coef * aux_loss`` keeps pushing the
router towards uniform load, a gradient that has nothing to do with the reward and silently shifts which
experts the policy uses (the rollout engine then samples from a policy the advantages never saw).

So :func:`configure_moe_router` (called once on every loaded model) sets ``output_router_logits=False``.
``actor_rollout_ref.model.enable_router_aux_loss=true`` opts back in, for the actor only: router logits are
then requested only in forwards that train (module in train mode with grad enabled), and the loss
``router_aux_loss_coef * aux_loss`` (the coefficient from the HF config; change it with
``model.override_config.router_aux_loss_coef``) reaches the router through the logits' backward, so no loss
code has to know about it. Each micro-batch contributes its own aux loss with the full coefficient.
The SFT trainer's ``model.enable_router_aux_loss`` opts in the same way for supervised fine-tuning, where
load balancing is usually wanted (it stays off by default there too, so a run says when it trains the router).
"""

from __future__ import annotations

import logging

import torch

__all__ = ["ROUTER_TRAINING_ROLES", "configure_moe_router", "router_configs"]

logger = logging.getLogger(__name__)


def router_configs(config) -> list:
    """The HF config objects of ``config`` (itself and its ``text_config``) that carry a router switch."""
    found = []
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is not None and hasattr(cfg, "output_router_logits") and all(cfg is not f for f in found):
            found.append(cfg)
    return found


class _AddAuxLossGrad(torch.autograd.Function):
    """Identity on ``logits`` whose backward also sends gradient ``coef`` into ``aux_loss``: training on the
    logits then trains on ``loss + coef * aux_loss`` without the loss knowing about it."""

    @staticmethod
    def forward(ctx, logits, aux_loss, coef: float):
        ctx.save_for_backward(aux_loss)
        ctx.coef = coef
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, grad_logits):
        (aux_loss,) = ctx.saved_tensors
        return grad_logits, torch.full_like(aux_loss, ctx.coef), None


def _training_forward(module) -> bool:
    return module.training and torch.is_grad_enabled()


# Roles whose model may train its router with the load-balancing loss: the RL actor and the SFT model.
ROUTER_TRAINING_ROLES = ("actor", "sft")


def configure_moe_router(model: torch.nn.Module, model_cfg, role: str) -> bool:
    """Router logits off for ``model``; on in training forwards of the actor or the SFT model only when
    ``model_cfg.enable_router_aux_loss``. Returns whether the aux loss trains. Dense models: no-op."""
    configs = router_configs(getattr(model, "config", None))
    enable = bool(model_cfg.get("enable_router_aux_loss", False)) if model_cfg is not None else False
    if not configs:
        return False
    for cfg in configs:
        if getattr(cfg, "output_router_logits", False):
            logger.info("%s: the checkpoint sets output_router_logits=true; turned off for RL", role)
        cfg.output_router_logits = False
    if not enable or role not in ROUTER_TRAINING_ROLES:  # the reference policy and the critic never train one
        return False
    coef = float(getattr(configs[-1], "router_aux_loss_coef", 0.0) or 0.0)

    def request_router_logits(module, args, kwargs):
        if _training_forward(module):
            kwargs["output_router_logits"] = True
        return args, kwargs

    def add_aux_loss(module, args, kwargs, output):
        if not _training_forward(module):
            return output
        aux = getattr(output, "aux_loss", None)
        logits = getattr(output, "logits", None)
        if aux is None:
            return output
        if logits is None:
            raise RuntimeError("enable_router_aux_loss needs the model's logits in training forwards; it cannot "
                               "be combined with use_fused_kernels")
        output.logits = _AddAuxLossGrad.apply(logits, aux.to(logits.dtype), coef)
        return output

    model.register_forward_pre_hook(request_router_logits, with_kwargs=True)
    model.register_forward_hook(add_aux_loss, with_kwargs=True)
    logger.info("%s: router aux loss on (coefficient %s) in training forwards", role, coef)
    return True
