"""A throwaway single-process engine (plain HF model, padded forward, AdamW) that follows the engine
interface, used only to exercise the SFT trainer before the real engines land."""

import os

import torch

from verl.workers.engine import BaseEngine


class ToyEngine(BaseEngine):
    def initialize(self):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(self.model_config.path),
                                                          dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.optimizer_config.lr,
                                     weight_decay=self.optimizer_config.weight_decay)
        warm = max(int(self.optimizer_config.lr_warmup_steps), 0)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / (warm + 1)))

    def forward_backward_batch(self, data, loss_fn=None, forward_only=False, outputs=("log_probs",)):
        mb = data.meta_info["micro_batch_size"]
        all_lp = []
        for chunk in data.split(mb):
            b = chunk.batch
            with torch.set_grad_enabled(not forward_only):
                logits = self.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                                    position_ids=b["position_ids"]).logits
                labels = torch.roll(b["input_ids"], -1, dims=1)
                lp = torch.log_softmax(logits.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
                if not forward_only:
                    loss, _ = loss_fn({"log_probs": lp}, dict(b.items()))
                    loss.backward()
            all_lp.append(lp.detach())
        return {"outputs": {"log_probs": torch.cat(all_lp)}, "metrics": {}}

    def optimizer_zero_grad(self):
        self.opt.zero_grad()

    def optimizer_step(self):
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optimizer_config.clip_grad)
        self.opt.step()
        return float(norm)

    def lr_scheduler_step(self):
        lr = self.opt.param_groups[0]["lr"]
        self.sched.step()
        return lr

    def get_per_tensor_param(self, bucket_megabytes=512, layered=False):
        yield from self.model.state_dict().items()

    def save_checkpoint(self, local_path, global_step=0, max_ckpt_to_keep=None):
        os.makedirs(local_path, exist_ok=True)
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(), "sched": self.sched.state_dict()},
                   os.path.join(local_path, "toy.pt"))

    def load_checkpoint(self, local_path):
        state = torch.load(os.path.join(local_path, "toy.pt"), weights_only=False)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.sched.load_state_dict(state["sched"])
