"""Qwen3.5 full attention (q/k RMSNorm, partial rotary, sigmoid output gate) over packed tokens; replaces
``Qwen3_5Attention.forward`` / ``Qwen3_5MoeAttention.forward`` on patched instances."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from verl.models.transformers.packed_attention import varlen_causal_attention


def _rotary_helper(module):
    # The rotary helper is a plain function of the model's modeling file (dense or MoE, named by its spec); reuse it.
    from verl.models.transformers.patching import modeling_module

    return modeling_module(module).apply_rotary_pos_emb


def gated_attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    packed=None,
    attention_mask: Optional[torch.Tensor] = None,
    **kwargs,
):
    """Qwen3.5 full attention (q/k RMSNorm, partial rotary, sigmoid output gate) over packed tokens.

    hidden_states: (B, T, H). With ``packed`` (B == 1) attention is block-diagonal causal over its
    sequences; without it each row is one sequence. Returns (output, None) like the HF module.
    """
    if kwargs.get("past_key_values") is not None:  # cached decoding: stock path with its KV cache and mask
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, **kwargs)
    from verl.models.qwen3_5 import hf_forward as q35

    b, t, _ = hidden_states.shape
    hd = self.head_dim
    q_and_gate = self.q_proj(hidden_states).view(b, t, -1, 2 * hd)
    q, gate = q_and_gate[..., :hd], q_and_gate[..., hd:]
    q = self.q_norm(q)
    k = self.k_norm(self.k_proj(hidden_states).view(b, t, -1, hd))
    v = self.v_proj(hidden_states).view(b, t, -1, hd)
    cos, sin = position_embeddings
    # unsqueeze_dim=2 because q/k are (B, T, heads, D) here.
    q, k = _rotary_helper(self)(q, k, cos, sin, unsqueeze_dim=2)

    sp = q35.current_sp_group(packed)
    if sp is not None:
        world = torch.distributed.get_world_size(sp)
        if k.shape[2] % world != 0:
            # Too few KV heads to split: give every query head its own copy first.
            rep = q.shape[2] // k.shape[2]
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        q, k, v = (q35.seq_to_heads(z, sp) for z in (q, k, v))
    dropout = self.attention_dropout if self.training else 0.0
    if packed is not None:
        out = varlen_causal_attention(q[0], k[0], v[0], packed.cu_seqlens, packed.max_seqlen, self.scaling, dropout)
        out = out.unsqueeze(0)
    else:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            dropout_p=dropout,
            scale=self.scaling,
            enable_gqa=q.shape[2] != k.shape[2],
        ).transpose(1, 2)
    if sp is not None:
        out = q35.heads_to_seq(out, sp)
    out = out.reshape(b, t, -1) * torch.sigmoid(gate.reshape(b, t, -1))
    return self.o_proj(out), None
