"""A causal LM's backbone with a small linear head read at every token: the critic's value model and the reward
model's score model. The engines treat it like the policy (FSDP2 wraps the backbone's blocks one by one, gradient
checkpointing and the input embeddings reach the backbone); subclasses name the head and read its output."""

from __future__ import annotations

import torch


class BackboneWithHead(torch.nn.Module):
    head_name: str  # the head's attribute, and so its name in state dicts and checkpoints

    def __init__(self, config, backbone: torch.nn.Module, no_split_modules):
        super().__init__()
        self.config = config
        self.model = backbone
        # FSDP2 wraps these block types one by one, as for the policy.
        self._no_split_modules = no_split_modules

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def gradient_checkpointing_enable(self, **kwargs):
        self.model.gradient_checkpointing_enable(**kwargs)

    def head_outputs(self, input_ids, attention_mask=None, position_ids=None, **kwargs) -> torch.Tensor:
        """The head at every position, fp32: (..., head outputs)."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False, **kwargs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        head = getattr(self, self.head_name)
        # The head runs in fp32 whatever the compute dtype: under FSDP2 mixed precision its weight arrives in bf16
        # (the root unit's parameters are cast too), and a bf16 head would round every value.
        bias = None if head.bias is None else head.bias.float()
        return torch.nn.functional.linear(hidden.float(), head.weight.float(), bias)
