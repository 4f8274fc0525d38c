"""A value model: a causal LM's backbone with a scalar head in place of the vocabulary projection."""

from __future__ import annotations

import torch


class ValueModel(torch.nn.Module):
    def __init__(self, causal_lm: torch.nn.Module):
        super().__init__()
        self.config = causal_lm.config
        self.model = causal_lm.get_decoder() if hasattr(causal_lm, "get_decoder") else causal_lm.model
        hidden = getattr(self.config, "hidden_size", None) or self.config.get_text_config().hidden_size
        self.value_head = torch.nn.Linear(hidden, 1, bias=False)
        torch.nn.init.zeros_(self.value_head.weight)  # start from V=0 so early advantages are the raw returns
        # FSDP2 wraps these block types one by one, as for the policy.
        self._no_split_modules = getattr(causal_lm, "_no_split_modules", None)

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def gradient_checkpointing_enable(self, **kwargs):
        self.model.gradient_checkpointing_enable(**kwargs)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False, **kwargs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        # The head runs in fp32 whatever the compute dtype: under FSDP2 mixed precision its weight arrives in bf16
        # (the root unit's parameters are cast too), and a bf16 scalar head would round every value.
        return torch.nn.functional.linear(hidden.float(), self.value_head.weight.float()).squeeze(-1)
