"""Qwen3.5 Gated DeltaNet as a megatron-core attention-slot module (tensor parallel over heads, packed THD).

One column-parallel input projection yields, per tensor rank, [q, k, v, z, b, a] of the rank's heads (the
weight converter lays the HF ``in_proj_qkv/z/b/a`` out that way), so sequence parallelism needs a single
all-gather. The depthwise causal conv and the gated delta rule run on whole sequences of the rank's heads and
restart at every ``cu_seqlens`` boundary (fla's varlen kernels on CUDA, the pure-torch reference elsewhere:
:mod:`verl.models.qwen3_5.gated_deltanet`). The row-parallel output projection reduces over ranks. Under context
parallelism the conv reads its halo from the previous chunk's owner and the delta rule's state is relayed from
chunk to chunk across the CP ranks (:mod:`verl.models.qwen3_5.gated_deltanet_cp`, which states the cost).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule

from verl.models.qwen3_5.mcore.common import (
    cp_group_of,
    cp_shard_of,
    gated_rms_norm,
    maybe_checkpoint,
    packed_cu_seqlens,
    recomputes,
    tp_group_of,
    tp_shared_weight,
)
from verl.models.qwen3_5.gated_deltanet import causal_conv1d, gated_delta_rule, prenormalize_qk
from verl.models.qwen3_5.gated_deltanet_cp import cp_causal_conv1d, cp_gated_delta_rule


class Qwen35GatedDeltaNet(MegatronModule):
    """Called like megatron-core's SelfAttention: ``forward(hidden [S, B, H], attention_mask, ...,
    packed_seq_params=...) -> (output, bias=None)``."""

    def __init__(self, config, layer_number: int = 1, pg_collection=None, linear_cls=None, row_cls=None, **_):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.tp_group = tp_group_of(self, pg_collection)
        self.cp_group = cp_group_of(pg_collection)
        tp = self.tp_group.size() if self.tp_group is not None else 1
        c = config
        self.n_k, self.n_v = c.linear_num_key_heads // tp, c.linear_num_value_heads // tp
        self.d_k, self.d_v = c.linear_key_head_dim, c.linear_value_head_dim
        self.eps = c.layernorm_epsilon
        self.naive_l2norm = bool(getattr(c, "use_naive_l2norm", False))
        self.kernel = c.linear_conv_kernel_dim
        key_dim, value_dim = c.linear_num_key_heads * self.d_k, c.linear_num_value_heads * self.d_v
        self.sections = [self.n_k * self.d_k, self.n_k * self.d_k, self.n_v * self.d_v, self.n_v * self.d_v,
                         self.n_v, self.n_v]
        column = linear_cls or tensor_parallel.ColumnParallelLinear
        row = row_cls or tensor_parallel.RowParallelLinear
        self.in_proj = column(
            c.hidden_size, 2 * key_dim + 2 * value_dim + 2 * c.linear_num_value_heads, config=c,
            init_method=c.init_method, bias=False, gather_output=False, skip_bias_add=True, tp_group=self.tp_group,
        )
        conv_channels = 2 * self.n_k * self.d_k + self.n_v * self.d_v
        dtype = c.params_dtype
        device = None if c.use_cpu_initialization else torch.cuda.current_device()
        self.conv1d = torch.nn.Module()
        self.conv1d.weight = torch.nn.Parameter(torch.empty(conv_channels, 1, self.kernel, dtype=dtype, device=device))
        self.A_log = torch.nn.Parameter(torch.empty(self.n_v, dtype=dtype, device=device))
        self.dt_bias = torch.nn.Parameter(torch.empty(self.n_v, dtype=dtype, device=device))
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.ones(self.d_v, dtype=dtype, device=device))
        for p in (self.conv1d.weight, self.A_log, self.dt_bias):
            tensor_parallel.set_tensor_model_parallel_attributes(p, True, 0, 1)
        self.out_proj = row(
            c.linear_num_value_heads * self.d_v, c.hidden_size, config=c, init_method=c.output_layer_init_method,
            bias=False, input_is_parallel=True, skip_bias_add=True, tp_group=self.tp_group,
        )
        # selective recompute: "core_attn" recomputes conv + delta rule + output norm, "gdn_norm_out" the norm
        self.recompute_core = recomputes(c, "core_attn")
        self.recompute_norm = recomputes(c, "gdn_norm_out") and not self.recompute_core
        self.reset_gdn_parameters()

    @torch.no_grad()
    def reset_gdn_parameters(self):
        """Fresh-model init (checkpoints overwrite it): conv like nn.Conv1d, A in [1, 16), dt_bias ones."""
        bound = 1.0 / math.sqrt(self.kernel)
        self.conv1d.weight.uniform_(-bound, bound)
        self.A_log.copy_(torch.empty_like(self.A_log, dtype=torch.float32).uniform_(1, 16).log())
        self.dt_bias.fill_(1.0)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Distributed-checkpoint view: conv1d / A_log / dt_bias are split over tensor ranks along dim 0, the
        output norm is replicated. The fused in_proj and conv1d hold per-rank component blocks, so a distributed
        checkpoint resumes at the same tensor-parallel size (export to HF to change it)."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        own = {"conv1d.weight": self.conv1d.weight, "A_log": self.A_log, "dt_bias": self.dt_bias,
               "norm.weight": self.norm.weight}
        out = make_sharded_tensors_for_checkpoint(
            own, prefix, {"conv1d.weight": 0, "A_log": 0, "dt_bias": 0}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"],
        )
        for child in ("in_proj", "out_proj"):
            out.update(getattr(self, child).sharded_state_dict(f"{prefix}{child}.", sharded_offsets, metadata))
        return out

    def forward(self, hidden_states, attention_mask=None, inference_context=None, rotary_pos_emb=None,
                rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, **kwargs):
        if inference_context is not None:
            raise NotImplementedError("the local Qwen3.5 spec is for training; decode with the rollout engine")
        proj, _ = self.in_proj(hidden_states)  # [S, B, local] (sequence-gathered under SP)
        proj = proj.transpose(0, 1)  # [B, S, local]
        b_, s_ = proj.shape[:2]
        cu = packed_cu_seqlens(packed_seq_params)
        if cu is not None and b_ != 1:
            raise ValueError(f"packed (THD) input must be one row, got batch {b_}")
        max_len = getattr(packed_seq_params, "max_seqlen_q", None) if packed_seq_params is not None else None
        shard = cp_shard_of(packed_seq_params, self.cp_group) if self.cp_group is not None else None
        core = maybe_checkpoint(self.recompute_core, self._mix, proj, cu, max_len, shard)
        core = core.reshape(b_, s_, -1).transpose(0, 1).contiguous()  # [S, B, local]
        out, bias = self.out_proj(core)
        return out, bias

    def _mix(self, proj, cu, max_len, shard=None):
        """[B, S, local] projections -> [B, S, n_v, d_v] normed, gated delta-rule output of this rank's heads
        (``shard``: this CP rank's part of the packed row, under context parallelism)."""
        b_, s_ = proj.shape[:2]
        q, k, v, z, beta, a = torch.split(proj, self.sections, dim=-1)
        if shard is not None:
            mixed = cp_causal_conv1d(torch.cat([q, k, v], dim=-1), self.conv1d.weight[:, 0], None, shard,
                                     self.cp_group, "silu")
        else:
            mixed = causal_conv1d(torch.cat([q, k, v], dim=-1), self.conv1d.weight[:, 0], None, cu, "silu")
        q, k, v = torch.split(mixed, self.sections[:3], dim=-1)
        q = q.reshape(b_, s_, self.n_k, self.d_k)
        k = k.reshape(b_, s_, self.n_k, self.d_k)
        v = v.reshape(b_, s_, self.n_v, self.d_v)
        if self.n_v != self.n_k:  # each key head serves n_v / n_k consecutive value heads
            q = q.repeat_interleave(self.n_v // self.n_k, dim=2)
            k = k.repeat_interleave(self.n_v // self.n_k, dim=2)
        beta = beta.sigmoid()
        # log-decay in fp32: exp(A_log) overflows half precision
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        q, k, in_kernel = prenormalize_qk(q, k, self.naive_l2norm)
        if shard is not None:
            core = cp_gated_delta_rule(q, k, v, g, beta, shard, self.cp_group, use_qk_l2norm=in_kernel)
        else:
            core = gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, max_seqlen=max_len, use_qk_l2norm=in_kernel)
        weight = tp_shared_weight(self.norm.weight, self.tp_group)
        z = z.reshape(b_, s_, self.n_v, self.d_v)
        return maybe_checkpoint(self.recompute_norm, gated_rms_norm, core, z, weight, self.eps)
