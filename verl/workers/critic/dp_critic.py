"""The data-parallel PPO critic: values for responses and the clipped value-loss update."""

from __future__ import annotations

import torch
import torch.distributed as dist

from verl.protocol import DataProto
from verl.trainer.ppo import core_algos
from verl.utils.py_functional import append_to_dict


class DataParallelPPOCritic:
    def __init__(self, config, critic_module: torch.nn.Module, critic_optimizer: torch.optim.Optimizer):
        self.config = config
        self.critic_module = critic_module
        self.critic_optimizer = critic_optimizer
        self.dp_size = dist.get_world_size() if dist.is_initialized() else 1

    def _forward(self, mb: dict) -> torch.Tensor:
        response_length = mb["responses"].size(-1)
        values = self.critic_module(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                                    position_ids=mb["position_ids"], use_cache=False)
        # The value of the state before each response token: positions -R-1 .. -2.
        return values[:, -response_length - 1 : -1]

    def _micro(self, data: DataProto, size: int, keys: list[str]):
        from verl.workers.actor.dp_actor import compute_device

        device = compute_device()
        td = data.batch.select(*keys)
        return [{k: td[i : i + size][k].to(device) for k in keys} for i in range(0, len(data), size)]

    @torch.no_grad()
    def compute_values(self, data: DataProto) -> torch.Tensor:
        self.critic_module.eval()
        size = self.config.get("forward_micro_batch_size_per_gpu") or self.config.get("ppo_micro_batch_size_per_gpu") or 8
        keys = ["responses", "input_ids", "attention_mask", "position_ids", "response_mask"]
        vals = []
        for mb in self._micro(data, size, keys):
            vals.append(self._forward(mb) * mb["response_mask"])
        return torch.cat(vals, dim=0).float().cpu()

    def update_critic(self, data: DataProto) -> dict:
        self.critic_module.train()
        cfg = self.config
        keys = ["responses", "input_ids", "attention_mask", "position_ids", "response_mask", "values", "returns"]
        metrics: dict = {}
        for _ in range(cfg.ppo_epochs):
            for mini in data.select(batch_keys=keys).split(cfg.ppo_mini_batch_size):
                mask = mini.batch["response_mask"].float()
                counts = torch.tensor([mask.sum().item(), (mask.sum(-1) > 0).sum().item()], dtype=torch.float64)
                if self.dp_size > 1:
                    dist.all_reduce(counts)
                info = {"dp_size": self.dp_size, "batch_num_tokens": counts[0].item(),
                        "global_batch_size": counts[1].item()}
                self.critic_optimizer.zero_grad(set_to_none=True)
                vf_loss_sum, clipfrac, n = 0.0, 0.0, 0
                for mb in self._micro(mini, cfg.ppo_micro_batch_size_per_gpu, keys):
                    vpreds = self._forward(mb)
                    vf_loss, vf_clipfrac = core_algos.compute_value_loss(
                        vpreds=vpreds, values=mb["values"], returns=mb["returns"],
                        response_mask=mb["response_mask"].float(), cliprange_value=cfg.cliprange_value,
                        loss_agg_mode=cfg.get("loss_agg_mode", "token-mean"), **info)
                    vf_loss.backward()
                    vf_loss_sum += vf_loss.item()
                    clipfrac += float(vf_clipfrac)
                    n += 1
                gn = torch.nn.utils.clip_grad_norm_(self.critic_module.parameters(), cfg.grad_clip)
                gn = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)
                if torch.isfinite(torch.tensor(gn)):
                    self.critic_optimizer.step()
                append_to_dict(metrics, {"critic/vf_loss": vf_loss_sum, "critic/vf_clipfrac": clipfrac / max(n, 1),
                                         "critic/grad_norm": gn})
        self.critic_optimizer.zero_grad(set_to_none=True)
        return metrics
