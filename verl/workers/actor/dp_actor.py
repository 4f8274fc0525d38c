"""The data-parallel PPO actor: per-token log-probs of responses and the policy update, on an FSDP2 model.

The same class serves as the reference policy (no optimizer). Batches arrive already split by
data-parallel rank; this module splits them further into mini-batches (one optimizer step each) and
micro-batches (one forward/backward each, gradients accumulated), scaling each micro-batch's loss by
global token / sequence counts so the update does not depend on how the batch was split.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.utils import torch_functional as verl_F
from verl.utils.device import get_device_name
from verl.utils.py_functional import append_to_dict
from verl.utils.seqlen_balancing import get_reverse_idx, rearrange_micro_batches
from verl.workers.actor.inputs import pack_micro_batch, unpack_to_responses

logger = logging.getLogger(__name__)


def compute_device() -> torch.device:
    name = get_device_name()
    if name == "cpu":
        return torch.device("cpu")
    from verl.utils.device import get_torch_device

    return torch.device(name, get_torch_device().current_device())


class LossConfig:
    """Attribute view over the actor config plus ``global_batch_info``, as core_algos' loss functions expect."""

    def __init__(self, cfg, global_batch_info: dict):
        self._cfg = cfg
        self.global_batch_info = global_batch_info

    def __getattr__(self, name):
        return getattr(self._cfg, name)

    def get(self, name, default=None):
        if name == "global_batch_info":
            return self.global_batch_info
        return self._cfg.get(name, default)


class DataParallelPPOActor:
    def __init__(self, config, actor_module: torch.nn.Module, actor_optimizer: Optional[torch.optim.Optimizer] = None,
                 use_remove_padding: bool = False, use_fused_kernels: bool = False, ulysses_sp_size: int = 1):
        self.config = config
        self.actor_module = actor_module
        self.actor_optimizer = actor_optimizer
        self.use_remove_padding = use_remove_padding
        self.use_fused_kernels = use_fused_kernels
        self.ulysses_sp_size = ulysses_sp_size
        self.dp_size = (dist.get_world_size() // ulysses_sp_size) if dist.is_initialized() else 1
        self.device = compute_device()

    # ------------------------------------------------------------------ forward
    def _forward_micro_batch(self, micro_batch: dict, temperature: float, calculate_entropy: bool = False):
        """Returns (entropy or None, log_probs), each (batch, response_length)."""
        responses = micro_batch["responses"]
        response_length = responses.size(-1)
        mm_inputs = micro_batch.get("multi_modal_inputs") or {}
        if self.use_remove_padding:
            packed = pack_micro_batch(micro_batch, sp_size=self.ulysses_sp_size)
            out = self.actor_module(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None,
                                    use_cache=False, **mm_inputs, **self._fused_kwargs(temperature))
            log_probs, entropy = self._token_stats(out, packed.labels, temperature, calculate_entropy)
            log_probs = unpack_to_responses(log_probs, packed, response_length)
            entropy = unpack_to_responses(entropy, packed, response_length) if entropy is not None else None
            return entropy, log_probs
        position_ids = micro_batch["position_ids"]
        if position_ids.dim() == 3:  # mRoPE (B, C, L) -> (C, B, L), the layout Qwen-VL models take
            position_ids = position_ids.transpose(0, 1)
        out = self.actor_module(input_ids=micro_batch["input_ids"], attention_mask=micro_batch["attention_mask"],
                                position_ids=position_ids, use_cache=False, **mm_inputs,
                                **self._fused_kwargs(temperature))
        labels = torch.roll(micro_batch["input_ids"], shifts=-1, dims=-1)
        log_probs, entropy = self._token_stats(out, labels, temperature, calculate_entropy)
        log_probs = log_probs[:, -response_length - 1 : -1]
        entropy = entropy[:, -response_length - 1 : -1] if entropy is not None else None
        return entropy, log_probs

    def _fused_kwargs(self, temperature: float) -> dict:
        return {"temperature": temperature, "return_dict": True} if self.use_fused_kernels else {}

    def _token_stats(self, out, labels: torch.Tensor, temperature: float, calculate_entropy: bool):
        """Log-prob of ``labels`` (the next token at every position) and entropy, from model outputs."""
        if self.use_fused_kernels:
            return out.log_probs, (out.entropy if calculate_entropy else None)
        from verl.utils.model_output import get_logits

        logits = get_logits(out).float() / temperature  # tuple outputs (logits, ...) too
        log_probs = verl_F.logprobs_from_logits(logits, labels)
        entropy = verl_F.entropy_from_logits(logits) if calculate_entropy else None
        return log_probs, entropy

    def _micro_batches(self, data: DataProto, micro_batch_size: Optional[int], use_dynamic_bsz: bool,
                       max_token_len: Optional[int], keys: list[str]):
        """Split ``data`` into micro-batches; returns (list of dicts, restore indices or None)."""
        has_mm = "multi_modal_inputs" in data.non_tensor_batch
        batch = data.batch.select(*keys)
        if use_dynamic_bsz:
            micro_tds, idx = rearrange_micro_batches(batch, max_token_len=max_token_len * self.ulysses_sp_size)
            groups = idx
        else:
            n = len(data)
            groups = [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]
            micro_tds = [batch[g[0] : g[-1] + 1] for g in groups]
            idx = None
        micro = []
        for td, g in zip(micro_tds, groups):
            # Batches travel on CPU between controller and workers; compute happens on the model's device.
            mb = {k: td[k].to(self.device) for k in td.keys()}
            if has_mm:
                mm = _merge_mm_inputs([data.non_tensor_batch["multi_modal_inputs"][i] for i in g])
                mb["multi_modal_inputs"] = {k: v.to(self.device) for k, v in mm.items()}
            micro.append(mb)
        return micro, idx

    # ------------------------------------------------------------------ log-prob
    @torch.no_grad()
    def compute_log_prob(self, data: DataProto, calculate_entropy: bool = False):
        """Per-token log-probs (and entropies) of ``data``'s responses under the current weights."""
        self.actor_module.eval()
        meta = data.meta_info
        temperature = meta["temperature"]
        keys = ["responses", "input_ids", "attention_mask", "position_ids"]
        micro, idx = self._micro_batches(data, meta.get("micro_batch_size"), meta.get("use_dynamic_bsz", False),
                                         meta.get("max_token_len"), keys)
        lps, ents = [], []
        for mb in micro:
            ent, lp = self._forward_micro_batch(mb, temperature, calculate_entropy)
            lps.append(lp)
            if ent is not None:
                ents.append(ent)
        log_probs = torch.cat(lps, dim=0).float().cpu()
        entropys = torch.cat(ents, dim=0).float().cpu() if ents else None
        if idx is not None:
            rev = torch.tensor(get_reverse_idx([i for g in idx for i in g]), dtype=torch.long)
            log_probs = log_probs[rev]
            entropys = entropys[rev] if entropys is not None else None
        return log_probs, entropys

    # ------------------------------------------------------------------ update
    def update_policy(self, data: DataProto) -> dict[str, Any]:
        self.actor_module.train()
        cfg = self.config
        temperature = data.meta_info["temperature"]
        keys = ["responses", "response_mask", "input_ids", "attention_mask", "position_ids", "old_log_probs",
                "advantages"]
        if cfg.use_kl_loss:
            keys.append("ref_log_prob")
        if "rollout_is_weights" in data.batch.keys():
            keys.append("rollout_is_weights")
        non_tensor_keys = ["multi_modal_inputs"] if "multi_modal_inputs" in data.non_tensor_batch else []
        data = data.select(batch_keys=keys, non_tensor_batch_keys=non_tensor_keys)
        mini_batch_size = cfg.ppo_mini_batch_size  # already per data-parallel rank, in responses
        mini_batches = data.split(mini_batch_size)
        metrics: dict[str, list] = {}
        loss_agg_mode = cfg.loss_agg_mode
        for _epoch in range(cfg.ppo_epochs):
            for mini in mini_batches:
                global_info = self._global_batch_info(mini.batch["response_mask"])
                loss_cfg = LossConfig(cfg, global_info)
                micro, _ = self._micro_batches(mini, cfg.ppo_micro_batch_size_per_gpu, cfg.use_dynamic_bsz,
                                               cfg.get("ppo_max_token_len_per_gpu"), keys)
                self.actor_optimizer.zero_grad(set_to_none=True)
                mini_metrics: dict[str, float] = {}
                for mb in micro:
                    step_metrics = self._micro_step(mb, temperature, loss_cfg, loss_agg_mode, global_info)
                    for k, v in step_metrics.items():
                        mini_metrics[k] = mini_metrics.get(k, 0.0) + v
                grad_norm = self._optimizer_step()
                mini_metrics = {k: v / (1 if k in _SUMMED else len(micro)) for k, v in mini_metrics.items()}
                mini_metrics["actor/grad_norm"] = grad_norm
                append_to_dict(metrics, mini_metrics)
        self.actor_optimizer.zero_grad(set_to_none=True)
        return metrics

    def _global_batch_info(self, response_mask: torch.Tensor) -> dict:
        """Token and sequence counts of the whole mini-batch across data-parallel ranks.

        The ranks of one Ulysses SP group hold the same rows, so the sum over all ranks counts each row sp
        times; dividing by sp gives the count over data-parallel groups."""
        counts = torch.tensor([response_mask.sum().item(), (response_mask.sum(-1) > 0).sum().item()],
                              dtype=torch.float64)
        if self.dp_size > 1:
            dist.all_reduce(counts)
            counts /= self.ulysses_sp_size
        return {"dp_size": self.dp_size, "batch_num_tokens": counts[0].item(),
                "global_batch_size": counts[1].item(), "loss_scale_factor": self.config.get("loss_scale_factor")}

    def _micro_step(self, mb: dict, temperature: float, loss_cfg, loss_agg_mode: str, global_info: dict) -> dict:
        cfg = self.config
        response_mask = mb["response_mask"].to(torch.float32)
        entropy_coeff = cfg.entropy_coeff
        calculate_entropy = entropy_coeff != 0 or cfg.get("calculate_entropy", True)
        entropy, log_prob = self._forward_micro_batch(mb, temperature, calculate_entropy=calculate_entropy)
        policy_loss_fn = core_algos.get_policy_loss_fn(cfg.policy_loss.get("loss_mode", "vanilla"))
        pg_loss, pg_metrics = policy_loss_fn(
            old_log_prob=mb["old_log_probs"], log_prob=log_prob, advantages=mb["advantages"],
            response_mask=response_mask, loss_agg_mode=loss_agg_mode, config=loss_cfg,
            rollout_is_weights=mb.get("rollout_is_weights"),
        )
        loss = pg_loss
        out = {"actor/pg_loss": pg_loss.detach().item(), **{k: float(v) for k, v in pg_metrics.items()}}
        if entropy is not None:
            ent_loss = core_algos.agg_loss(entropy, response_mask, loss_agg_mode, **global_info)
            if entropy_coeff != 0:
                loss = loss - entropy_coeff * ent_loss
            out["actor/entropy"] = ent_loss.detach().item()
        if cfg.use_kl_loss:
            kld = core_algos.kl_penalty(log_prob, mb["ref_log_prob"], kl_penalty=cfg.kl_loss_type)
            kl_loss = core_algos.agg_loss(kld, response_mask, loss_agg_mode, **global_info)
            loss = loss + kl_loss * cfg.kl_loss_coef
            out["actor/kl_loss"] = kl_loss.detach().item()
            out["actor/kl_coef"] = cfg.kl_loss_coef
        loss.backward()
        return out

    def _optimizer_step(self) -> float:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.actor_module.parameters(), max_norm=self.config.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        if not torch.isfinite(torch.tensor(grad_norm)):
            logger.warning("grad_norm is not finite (%s); skipping this optimizer step", grad_norm)
            self.actor_optimizer.zero_grad(set_to_none=True)
        else:
            self.actor_optimizer.step()
        return grad_norm


# Loss metrics are already normalised over the global mini-batch in each micro-batch's share, so their
# per-micro-batch values add up to the mini-batch value; ratios like clipfrac are averaged instead.
_SUMMED = {"actor/pg_loss", "actor/kl_loss", "actor/entropy"}


def _merge_mm_inputs(rows: list[dict]) -> dict:
    """Concatenate per-row processor outputs (pixel_values, image_grid_thw, ...) along dim 0."""
    rows = [r for r in rows if r]
    if not rows:
        return {}
    keys = rows[0].keys()
    return {k: torch.cat([r[k] for r in rows if k in r], dim=0) for k in keys}
