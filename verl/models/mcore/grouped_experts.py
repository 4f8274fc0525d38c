"""MoE experts for megatron-core's local (no Transformer Engine) spec: one grouped GEMM per projection.

megatron-core's local backend runs its experts as ``SequentialMLP``: a Python loop over the local experts, one
small GEMM pair each, after a host sync on ``tokens_per_expert``. With 64 local experts per GPU (Qwen3.5-35B-A3B
at EP=4) that loop made the Megatron update about 10x slower per token than a dense model of the same active size
(docs/advance/scale.md). Its grouped-GEMM experts (``TEGroupedMLP``, the legacy ``GroupedMLP``) need Transformer
Engine or the ``grouped_gemm`` extension, neither installable on the machines this project runs on.

:class:`GroupedGemmExperts` keeps ``SequentialMLP``'s parameters exactly (``local_experts.<i>.linear_fc1/fc2``:
checkpoints, the weight converter, the distributed optimizer and expert-parallel sharding see no difference) and
replaces the loop by ``torch._grouped_mm`` over the experts' weights stacked per forward (a contiguous copy of
the local expert weights per layer, kept for backward: e.g. ~384 MB per layer for 64 local experts of
Qwen3.5-35B-A3B in bf16). Gradients reach each expert's own parameters through the stack, each a contiguous
slice of one stacked gradient, in its parameter's layout. It serves gated SiLU (SwiGLU) experts without biases
and defers to ``SequentialMLP`` otherwise, with one warning where a CUDA run loses the fast path.
Expert tensor parallelism needs nothing more: megatron-core's expert linears skip their own communication
(``explicit_expert_comm``: the token dispatcher gathers the tokens over the expert-TP group before the experts and
reduce-scatters the partial sums after them), so each rank's experts compute on their local shards alone, which
is what the grouped GEMMs do (the fc1 shard's gate and up halves split in the middle, as ``MLP`` splits them).
On CUDA torch fuses the grouped GEMM for bf16; other dtypes (the fp32 parity tests) run torch's own per-group
loop, no slower than SequentialMLP's.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        logger.warning("MoE experts run megatron-core's SequentialMLP loop (one GEMM pair per local expert) instead "
                       "of one grouped GEMM: %s", reason)


# Experts whose stacked gradient is cast to main_grad's dtype at a time (a transient copy of this many experts'
# weights in fp32: 128 MB for 16 experts of Qwen3.5-35B-A3B's fc1).
_ACCUMULATE_CHUNK = 16


class _StackedExpertWeights(torch.autograd.Function):
    """One projection's local expert weights as one [E, out, in] tensor (a contiguous copy).

    Backward hands each expert its slice of the stacked gradient. Under megatron-core's DDP every parameter has
    an fp32 ``main_grad`` that DDP's per-parameter hook adds ``param.grad`` into: one add per expert weight and
    micro-batch (56k in one update of 8 layers at EP 2, 4 % of its device time and as many launches; 2 x H200,
    2026-11-28). Here the slices go into the ``main_grad``s with a few multi-tensor adds per projection instead,
    and ``grad_added_to_main_grad`` tells the hook to skip its own add, as megatron-core's fused weight-gradient
    accumulation does; the parameters still receive the slices (views, no copy), so the hook still runs and
    marks its buckets ready. Parameters without ``main_grad`` (no DDP: tests, a frozen reference) take the slices
    as ordinary gradients."""

    @staticmethod
    def forward(ctx, *weights: torch.Tensor) -> torch.Tensor:
        ctx.weights = weights  # leaf parameters: kept for their main_grad, not for their values
        return torch.stack(weights)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weights = ctx.weights
        # contiguous slices are handed to the parameters as they are; strided ones autograd would copy one by one
        grad = grad.contiguous()
        slices = grad.unbind(0)
        fused = all(getattr(w, "main_grad", None) is not None and hasattr(w, "grad_added_to_main_grad")
                    and not getattr(w, "zero_out_wgrad", False) for w in weights)
        if fused:
            for i in range(0, len(weights), _ACCUMULATE_CHUNK):
                part = weights[i: i + _ACCUMULATE_CHUNK]
                cast = grad[i: i + len(part)].to(part[0].main_grad.dtype)
                torch._foreach_add_([w.main_grad for w in part], list(cast.unbind(0)))
            for w in weights:
                w.grad_added_to_main_grad = True
        ctx.weights = None
        return slices


class GroupedGemmExperts(SequentialMLP):
    """``SequentialMLP`` with the per-expert loop replaced by two grouped GEMMs (see the module docstring)."""

    def _unsupported(self, x: torch.Tensor) -> str | None:
        c = self.config
        if self.num_local_experts < 2:
            return "one local expert"
        if any(getattr(getattr(e, n), "lora_enabled", False) for e in self.local_experts
               for n in ("linear_fc1", "linear_fc2")):
            return "LoRA adapters on the experts (each expert's adapter runs in its own linear)"
        if getattr(c, "fp8", None) or getattr(c, "fp4", None):
            return "fp8/fp4 experts"
        if c.moe_apply_probs_on_input:
            return "moe_apply_probs_on_input"
        if not c.gated_linear_unit or c.activation_func is not F.silu:
            return "experts other than gated SiLU (SwiGLU)"
        if c.add_bias_linear:
            return "expert biases"
        if getattr(c, "activation_func_clamp_value", None) is not None or getattr(c, "glu_linear_offset", 0):
            return "clamped / offset GLU"
        if x.shape[-1] % 8 or self.config.moe_ffn_hidden_size % 8:
            return "hidden sizes not multiples of 8 (grouped GEMM alignment)"
        return None

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        x = permuted_local_hidden_states
        reason = self._unsupported(x)
        if reason is not None:
            if x.device.type == "cuda" and self.num_local_experts > 1:
                _warn_once(reason)
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        # [E, out, in]: the experts' weights stacked as stored (one contiguous copy); the grouped GEMM reads its
        # transpose as a view. Stacking the transposes instead made the copy strided and, in backward, each
        # expert's gradient a strided slice that autograd copied into the parameter's layout: one more kernel
        # per expert weight and micro-batch (54k in one update of 8 layers at EP 2, 6 % of its device time;
        # 2 x H200, 2026-11-28).
        w1 = _StackedExpertWeights.apply(*[e.linear_fc1.weight for e in self.local_experts])
        w2 = _StackedExpertWeights.apply(*[e.linear_fc2.weight for e in self.local_experts])
        offs = torch.cumsum(torch.as_tensor(tokens_per_expert, device=x.device), 0).to(torch.int32)
        h = torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)
        gate, up = torch.chunk(h, 2, dim=-1)
        # megatron-core's MLP order: activation, then the routing probability per token, back to the input dtype
        h = (F.silu(gate) * up * permuted_probs.unsqueeze(-1)).to(x.dtype)
        return torch._grouped_mm(h, w2.transpose(1, 2), offs=offs), None
