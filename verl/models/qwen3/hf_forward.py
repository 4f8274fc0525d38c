"""Qwen3's packed forward for the FSDP actor: every text forward runs on one packed row.

* packed input ``(1, T)`` with ``attention_mask=None``: sequences start wherever the position id is 0;
* padded input ``(B, L)`` with a 2D ``attention_mask``: the real tokens are gathered into one packed row and the
  hidden states scattered back, so pad tokens never reach real ones;
* unpadded ``(B, L)``: each row is one sequence.

The row's boundaries (:class:`PackedSeqInfo`) reach every attention block through the decoder layer's keyword
arguments (the stock layer passes them on), and attention is
:func:`~verl.models.transformers.packed_attention.varlen_causal_attention`, which never crosses them. Cached
decoding (``generate``) runs the stock forwards.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from verl.models.transformers.packed_attention import PackedSeqInfo, cu_seqlens_from_starts, varlen_causal_attention
from verl.models.transformers.patching import modeling_module


def _wants_cache(past_key_values, use_cache) -> bool:
    return past_key_values is not None or bool(use_cache)


def _packed_row(embeds: torch.Tensor, attention_mask: Optional[torch.Tensor], position_ids: Optional[torch.Tensor]):
    """(row (1, T, H), positions (1, T), boundaries, real-token mask (B, L) or None) of a batch."""
    b, length, _ = embeds.shape
    if attention_mask is not None and attention_mask.dim() == 2:
        real = attention_mask.bool()
        seen = real.long().cumsum(-1)
        if position_ids is None:
            position_ids = (seen - 1).clamp(min=0)
        first = real & (seen == 1)  # each padded row is one sequence
        return embeds[real].unsqueeze(0), position_ids[real].unsqueeze(0), cu_seqlens_from_starts(first[real]), real
    if position_ids is None:
        position_ids = torch.arange(length, device=embeds.device).expand(b, length)
    starts = position_ids == 0
    starts[:, 0] = True  # every row starts a sequence
    flat = embeds.reshape(1, b * length, -1)
    return flat, position_ids.reshape(1, -1), cu_seqlens_from_starts(starts.reshape(-1)), None


def text_model_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                       inputs_embeds=None, use_cache=None, **kwargs):
    """Replacement for ``Qwen3Model.forward`` (see the module docstring)."""
    if _wants_cache(past_key_values, use_cache):
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, past_key_values=past_key_values,
                                  inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    row, positions, (cu, max_len), real = _packed_row(embeds, attention_mask, position_ids)
    packed = PackedSeqInfo(cu_seqlens=cu, max_seqlen=max_len)
    hidden = row
    rotary = self.rotary_emb(hidden, positions)
    for layer in self.layers[: self.config.num_hidden_layers]:
        hidden = layer(hidden, position_embeddings=rotary, position_ids=positions, packed=packed)
    hidden = self.norm(hidden)
    if real is not None:
        out = hidden.new_zeros(*real.shape, hidden.shape[-1])
        out[real] = hidden[0]
        hidden = out
    else:
        hidden = hidden.reshape(*embeds.shape[:2], -1)
    return BaseModelOutputWithPast(last_hidden_state=hidden)


def attention_forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None,
                      packed: Optional[PackedSeqInfo] = None, **kwargs):
    """Replacement for ``Qwen3Attention.forward``: q/k RMSNorm, rotary, then causal attention within each packed
    sequence. Without ``packed`` (the stock model called it, e.g. cached decoding) the stock forward runs."""
    if packed is None:
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask,
                                  past_key_values=past_key_values, **kwargs)
    b, t, _ = hidden_states.shape
    hd = self.head_dim
    q = self.q_norm(self.q_proj(hidden_states).view(b, t, -1, hd))
    k = self.k_norm(self.k_proj(hidden_states).view(b, t, -1, hd))
    v = self.v_proj(hidden_states).view(b, t, -1, hd)
    cos, sin = position_embeddings
    rotary = modeling_module(self).apply_rotary_pos_emb
    q, k = rotary(q, k, cos, sin, unsqueeze_dim=2)  # q/k are (B, T, heads, D) here
    dropout = self.attention_dropout if self.training else 0.0
    out = varlen_causal_attention(q[0], k[0], v[0], packed.cu_seqlens, packed.max_seqlen, self.scaling, dropout)
    return self.o_proj(out.reshape(b, t, -1)), None
