"""A value model: a causal LM's backbone with a scalar head in place of the vocabulary projection."""

from __future__ import annotations

import torch

from verl.models.backbone_head import BackboneWithHead


class ValueModel(BackboneWithHead):
    head_name = "value_head"

    def __init__(self, causal_lm: torch.nn.Module):
        backbone = causal_lm.get_decoder() if hasattr(causal_lm, "get_decoder") else causal_lm.model
        super().__init__(causal_lm.config, backbone, getattr(causal_lm, "_no_split_modules", None))
        hidden = getattr(self.config, "hidden_size", None) or self.config.get_text_config().hidden_size
        self.value_head = torch.nn.Linear(hidden, 1, bias=False)
        torch.nn.init.zeros_(self.value_head.weight)  # start from V=0 so early advantages are the raw returns

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, **kwargs):
        return self.head_outputs(input_ids, attention_mask, position_ids, **kwargs).squeeze(-1)
