"""Causal attention that never crosses packed-sequence boundaries, and the Qwen3.5 gated attention forward.

``varlen_causal_attention`` uses flash-attn's varlen kernel when it is installed and the tensors live on
CUDA; otherwise it lays the sequences out as right-padded rows and runs causal SDPA, which is exact for real
tokens (every padded key sits after every real query of its row, so the causal mask already hides it).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from verl.models.transformers.gated_deltanet import batch_to_packed, packed_to_batch


@functools.lru_cache(maxsize=None)
def _flash_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:
        return None
    return flash_attn_varlen_func


def varlen_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    dropout: float = 0.0,
) -> torch.Tensor:
    """q: (T, Hq, D), k/v: (T, Hkv, D) packed tokens; returns (T, Hq, D)."""
    flash = _flash_varlen()
    if flash is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        cu = cu_seqlens.to(torch.int32)
        return flash(q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=dropout, softmax_scale=scale, causal=True)
    qb, index = packed_to_batch(q, cu_seqlens, max_seqlen)
    kb, _ = packed_to_batch(k, cu_seqlens, max_seqlen)
    vb, _ = packed_to_batch(v, cu_seqlens, max_seqlen)
    out = F.scaled_dot_product_attention(
        qb.transpose(1, 2),
        kb.transpose(1, 2),
        vb.transpose(1, 2),
        is_causal=True,
        dropout_p=dropout,
        scale=scale,
        enable_gqa=qb.shape[2] != kb.shape[2],
    )
    return batch_to_packed(out.transpose(1, 2), index)


def _rotary_helper(module):
    # The rotary helper is a plain function of the module's own modeling file (dense or MoE); reuse it.
    import importlib

    from verl.models.transformers.monkey_patch import modeling_module_name

    return importlib.import_module(modeling_module_name(module)).apply_rotary_pos_emb


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
    from verl.models.transformers import qwen3_5 as q35

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
