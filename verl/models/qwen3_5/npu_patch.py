"""Ascend NPU fast paths for Qwen3.5 / Qwen3.5-MoE, through torch_npu's fused operators.

Replaced (class-level, dense and MoE modeling files): zero-centred RMSNorm and the gated RMSNorm of Gated
DeltaNet (``npu_rms_norm``), SiLU-gated MLPs incl. the MoE shared expert (``npu_swiglu``), the partial rotary
embedding (``npu_rotary_mul``) and the routed experts (``npu_grouped_matmul`` over expert-sorted tokens).
The maths is unchanged, so these compose with the packed/Ulysses forwards in ``qwen3_5.py`` (which look the
rotary helper up in the modeling module at call time). torch_npu is imported only when patches are applied.
"""

from __future__ import annotations

import importlib
import logging
from typing import Iterable

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_ORIGINALS: dict[tuple[object, str], object] = {}  # (owner, attribute) -> original, for revert_npu_patches


def _npu():
    return importlib.import_module("torch_npu")


def is_torch_npu_available() -> bool:
    try:
        _npu()
    except Exception:
        return False
    return True


# ----------------------------------------------------------------------------------------------------------------
# Replacement forwards
# ----------------------------------------------------------------------------------------------------------------


def zero_centered_rms_norm_forward(self, x):
    """Qwen3.5 RMSNorm scales by (1 + weight); the fused op takes that as its gamma. Computed in fp32."""
    gamma = 1.0 + self.weight.float()
    return _npu().npu_rms_norm(x.float(), gamma, epsilon=self.eps)[0].type_as(x)


def gated_rms_norm_forward(self, hidden_states, gate=None):
    """Gated DeltaNet output norm: rmsnorm(x) * weight * silu(gate)."""
    dtype = hidden_states.dtype
    normed = _npu().npu_rms_norm(hidden_states.float(), self.weight.float(), epsilon=self.variance_epsilon)[0]
    if gate is not None:
        normed = normed * F.silu(gate.float())
    return normed.to(dtype)


def swiglu_mlp_forward(self, x):
    """down(silu(gate(x)) * up(x)) with the product fused: npu_swiglu splits its input's last dim in halves."""
    fused_in = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
    return self.down_proj(_npu().npu_swiglu(fused_in, dim=-1))


def partial_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, **unused):
    """Rotary on the first ``cos.shape[-1]`` channels (Qwen3.5 uses a partial rotary factor); rest pass through."""
    npu = _npu()
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rot = cos.shape[-1]

    def rotate(x):
        turned = npu.npu_rotary_mul(x[..., :rot], cos, sin).to(x.dtype)
        return torch.cat([turned, x[..., rot:]], dim=-1) if rot < x.shape[-1] else turned

    return rotate(q), rotate(k)


class GroupedMatmul(torch.autograd.Function):
    """y_g = x_g @ w[g] for consecutive row groups of ``x`` (group ends given cumulatively).

    Backward: dx_g = dy_g @ w[g]^T (same row grouping), dw[g] = x_g^T @ dy_g (grouping on the reduced axis).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor):
        ctx.save_for_backward(x, weight, group_ends)
        return _npu().npu_grouped_matmul(
            [x], [weight], group_list=group_ends, split_item=2, group_type=0, group_list_type=0
        )[0]

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, group_ends = ctx.saved_tensors
        npu = _npu()
        grad_out = grad_out.contiguous()
        dx = npu.npu_grouped_matmul(
            [grad_out], [weight.transpose(1, 2).contiguous()], group_list=group_ends, split_item=2, group_type=0,
            group_list_type=0,
        )[0]
        dw = npu.npu_grouped_matmul(
            [x.t().contiguous()], [grad_out], group_list=group_ends, split_item=3, group_type=2, group_list_type=0
        )[0]
        return dx, dw.reshape(weight.shape), None


def moe_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Routed experts over fused weights (gate_up_proj [E, 2I, H], down_proj [E, H, I]).

    Every (token, slot) assignment is sorted by expert so each expert's rows are contiguous, run as two
    grouped matmuls with a fused SwiGLU between them, weighted by the router and summed back per token.
    """
    n_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    flat_expert = top_k_index.reshape(-1)
    order = torch.argsort(flat_expert, stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat_expert, minlength=self.num_experts)
    group_ends = counts.cumsum(0).to(torch.int64)

    rows = hidden_states.index_select(0, token_of)
    gate_up = GroupedMatmul.apply(rows, self.gate_up_proj.transpose(1, 2), group_ends)
    act = _npu().npu_swiglu(gate_up, dim=-1)
    down = GroupedMatmul.apply(act, self.down_proj.transpose(1, 2), group_ends)
    down = down * top_k_weights.reshape(-1)[order, None].to(down.dtype)
    out = torch.zeros(n_tokens, hidden, dtype=down.dtype, device=down.device)
    return out.index_add(0, token_of, down).to(hidden_states.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Installation
# ----------------------------------------------------------------------------------------------------------------


def _targets(model_type: str):
    """(owner, attribute, replacement) triples for one Qwen3.5 family (``ModelSpec.family``: which modeling file)."""
    if model_type == "qwen3_5":
        mod = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
        prefix, mlps = "Qwen3_5", ("Qwen3_5MLP",)
    elif model_type == "qwen3_5_moe":
        mod = importlib.import_module("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
        prefix, mlps = "Qwen3_5Moe", ("Qwen3_5MoeMLP",)
    else:
        raise ValueError(f"no NPU patches for model type {model_type!r}")
    out = [
        (getattr(mod, f"{prefix}RMSNorm"), "forward", zero_centered_rms_norm_forward),
        (getattr(mod, f"{prefix}RMSNormGated"), "forward", gated_rms_norm_forward),
        (mod, "apply_rotary_pos_emb", partial_rotary_pos_emb),
    ]
    out += [(getattr(mod, name), "forward", swiglu_mlp_forward) for name in mlps]
    experts = getattr(mod, f"{prefix}Experts", None)
    if experts is not None:
        out.append((experts, "forward", moe_experts_forward))
    return out


def apply_npu_patches(model_types: Iterable[str] = ("qwen3_5", "qwen3_5_moe"), force: bool = False) -> list[str]:
    """Install the NPU forwards; returns the patched ``Owner.attribute`` names.

    Does nothing (returns []) when torch_npu cannot be imported, unless ``force`` (tests inject a fake).
    Idempotent: originals are recorded once and :func:`revert_npu_patches` restores them.
    """
    if not force and not is_torch_npu_available():
        return []
    patched = []
    for model_type in model_types:
        for owner, attr, fn in _targets(model_type):
            key = (owner, attr)
            if key not in _ORIGINALS:
                _ORIGINALS[key] = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
            setattr(owner, attr, fn)
            patched.append(f"{getattr(owner, '__name__', owner)}.{attr}")
    logger.info("applied %d NPU patches", len(patched))
    return patched


def apply_npu_patches_for_spec(spec) -> list[str]:
    """What the model spec names (``ModelSpec.npu_patch``): patch the spec's family (which modeling file, dense
    or MoE). Called at model load on Ascend hosts only
    (:func:`verl.models.transformers.npu_patch.apply_npu_patches_for_model`)."""
    return apply_npu_patches((spec.family,))


def revert_npu_patches() -> None:
    """Restore every forward replaced by :func:`apply_npu_patches`."""
    for (owner, attr), original in list(_ORIGINALS.items()):
        setattr(owner, attr, original)
    _ORIGINALS.clear()
