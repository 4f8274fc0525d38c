"""Qwen3.5 gated full attention as a megatron-core attention-slot module.

q/k RMSNorm (zero-centred) per head, partial rotary on the first ``rotary_percent`` of each head, grouped KV
heads, and a sigmoid output gate: ``o_proj(attn * sigmoid(gate))``. The column-parallel ``linear_qkv`` holds, per
tensor rank, the rank's query heads as HF lays them out (``[q_h; gate_h]`` per head), then its KV heads.

Packed THD batches never attend across sequences: in bf16/fp16 on CUDA one varlen kernel covers the row
(flash-attn's, else torch's ``varlen_attn``); otherwise torch SDPA runs once per packed sequence (a Python loop:
launch overhead grows with the number of sequences in a micro-batch; one warning on CUDA says so). Under context parallelism the rank holds two chunks of every sequence;
keys and values are all-gathered over the CP group and each chunk attends causally to its sequence's prefix
(:func:`verl.models.mcore.context_parallel.cp_causal_attention`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule

from verl.models.mcore.context_parallel import cp_causal_attention
from verl.models.transformers.packed_attention import select_backend, varlen_causal_attention
from verl.models.qwen3_5.mcore.common import (
    ZeroCenteredRMSNorm,
    apply_partial_rope,
    cp_group_of,
    cp_shard_of,
    maybe_checkpoint,
    packed_cu_seqlens,
    recomputes,
    tp_group_of,
)

logger = logging.getLogger(__name__)
_warned = False


def _warn_slow_path():
    global _warned
    if not _warned:
        _warned = True
        logger.warning("Qwen3.5 mcore local spec: packed full attention runs torch SDPA per sequence (fp32, or neither "
                       "flash-attn nor torch's varlen attention available); expect extra launch overhead with many "
                       "short sequences per batch")


def packed_causal_attention(q, k, v, cu_seqlens, scale):
    """q [T, Hq, D], k/v [T, Hkv, D] of one packed row -> [T, Hq, D]; causal within each sequence only.

    Half precision on CUDA: one varlen kernel over the whole row (flash-attn's, else torch's own ``varlen_attn``,
    the FSDP path's choice: :mod:`verl.models.transformers.packed_attention`). Otherwise (fp32, CPU, or neither
    kernel importable) torch SDPA once per sequence."""
    fast = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    if fast and select_backend(fast=True) in ("flash_attn", "torch_varlen"):
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        return varlen_causal_attention(q, k, v, cu_seqlens, int(lengths.max()), scale)
    if q.is_cuda:
        _warn_slow_path()
    bounds = cu_seqlens.tolist()
    out = torch.empty_like(q)
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                           enable_gqa=ks.shape[1] != qs.shape[1])
        out[start:end] = o[0].transpose(0, 1)
    return out


class Qwen35GatedAttention(MegatronModule):
    def __init__(self, config, layer_number: int = 1, pg_collection=None, linear_cls=None, row_cls=None, **_):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.tp_group = tp_group_of(self, pg_collection)
        self.cp_group = cp_group_of(pg_collection)
        tp = self.tp_group.size() if self.tp_group is not None else 1
        c = config
        self.d = c.kv_channels
        self.n_q, self.n_kv = c.num_attention_heads // tp, c.num_query_groups // tp
        column = linear_cls or tensor_parallel.ColumnParallelLinear
        row = row_cls or tensor_parallel.RowParallelLinear
        self.linear_qkv = column(
            c.hidden_size, (2 * c.num_attention_heads + 2 * c.num_query_groups) * self.d, config=c,
            init_method=c.init_method, bias=c.add_qkv_bias, gather_output=False, skip_bias_add=False,
            tp_group=self.tp_group,
        )
        # megatron-core sums q/k layernorm grads over tensor ranks by these names when qk_layernorm is set
        self.q_layernorm = ZeroCenteredRMSNorm(c, self.d, c.layernorm_epsilon)
        self.k_layernorm = ZeroCenteredRMSNorm(c, self.d, c.layernorm_epsilon)
        for norm in (self.q_layernorm, self.k_layernorm):
            norm.weight.sequence_parallel = False
        self.recompute_core = recomputes(c, "core_attn")
        self.linear_proj = row(
            c.num_attention_heads * self.d, c.hidden_size, config=c, init_method=c.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=True, tp_group=self.tp_group,
        )

    def forward(self, hidden_states, attention_mask=None, inference_context=None, rotary_pos_emb=None,
                rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, **kwargs):
        """``rotary_pos_emb``: cos and sin stacked, [2, S, B, 1, rotary_dim], from the model's position ids."""
        if inference_context is not None:
            raise NotImplementedError("the local Qwen3.5 spec is for training; decode with the rollout engine")
        qkv, _ = self.linear_qkv(hidden_states)  # [S, B, local]
        s_, b_ = qkv.shape[:2]
        qg, k, v = torch.split(qkv, [2 * self.n_q * self.d, self.n_kv * self.d, self.n_kv * self.d], dim=-1)
        qg = qg.reshape(s_, b_, self.n_q, 2 * self.d)
        q, gate = qg[..., : self.d], qg[..., self.d :]
        q = self.q_layernorm(q)
        k = self.k_layernorm(k.reshape(s_, b_, self.n_kv, self.d))
        v = v.reshape(s_, b_, self.n_kv, self.d)
        if rotary_pos_emb is not None:
            cos, sin = rotary_pos_emb
            q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        cu = packed_cu_seqlens(packed_seq_params)
        if cu is not None and b_ != 1:
            raise ValueError(f"packed (THD) input must be one row, got batch {b_}")
        if self.cp_group is not None:
            # The shard is resolved outside the checkpointed function (it reads the host-side boundaries once).
            shard = cp_shard_of(packed_seq_params, self.cp_group)
            out = maybe_checkpoint(self.recompute_core, self._core_cp, q, k, v, shard)
        else:
            out = maybe_checkpoint(self.recompute_core, self._core, q, k, v, cu, attention_mask)
        out = out * torch.sigmoid(gate)
        out, bias = self.linear_proj(out.reshape(s_, b_, -1))
        return out, bias

    def _core_cp(self, q, k, v, shard):
        """This CP rank's queries [S_local, 1, Hq, D] against its sequences' all-gathered keys/values."""
        if q.is_cuda:
            _warn_slow_path()
        return cp_causal_attention(q[:, 0], k[:, 0], v[:, 0], shard, self.cp_group, self.d ** -0.5).unsqueeze(1)

    def _core(self, q, k, v, cu, attention_mask):
        """q [S, B, Hq, D], k/v [S, B, Hkv, D] -> [S, B, Hq, D] causal attention (per sequence when packed)."""
        s_ = q.shape[0]
        scale = self.d ** -0.5
        if cu is not None:
            return packed_causal_attention(q[:, 0], k[:, 0], v[:, 0], cu, scale).unsqueeze(1)
        qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [B, H, S, D]
        mask = None
        if attention_mask is not None:  # megatron convention: True = masked out
            causal = torch.ones(s_, s_, dtype=torch.bool, device=q.device).tril()
            mask = causal & ~attention_mask.bool()
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=mask is None, scale=scale,
                                             enable_gqa=self.n_kv != self.n_q)
        return out.permute(2, 0, 1, 3)  # [S, B, H, D]
