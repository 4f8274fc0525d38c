"""Gated DeltaNet (Qwen3.5 linear attention) for packed and padded batches.

Two numerically interchangeable implementations live here:

* a pure-torch one (boundary-aware depthwise conv + chunked gated delta rule) that runs anywhere and is the
  CPU test oracle, and
* the fla kernels (``fla.modules`` causal conv and ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``),
  selected only when CUDA is in use and fla imports.

Packed layout: one row ``(1, T, ...)`` holding several sequences back to back, described by ``cu_seqlens``
(int32, ``[0, l0, l0+l1, ..., T]``). Both the conv window and the recurrent state restart at every boundary.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.nn.functional as F

from verl.models.transformers.packed_attention import batch_to_packed, packed_to_batch, seq_ids_from_cu_seqlens

# "torch" forces the reference path (e.g. to compare against fla on GPU); "auto" uses fla when possible.
GDN_BACKEND_ENV = "VERL_GDN_BACKEND"


@functools.lru_cache(maxsize=None)
def _fla_functions():
    """Import fla lazily; returns (conv_fn, chunk_rule_fn) or None when fla is unusable."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:
        return None
    conv = None
    # The conv entry point moved between fla releases; both take x as (B, T, D) and weight as (D, W).
    for mod_name in ("fla.modules.convolution", "fla.modules.conv", "fla.modules"):
        try:
            mod = __import__(mod_name, fromlist=["causal_conv1d"])
            conv = getattr(mod, "causal_conv1d")
            break
        except Exception:
            continue
    return conv, chunk_gated_delta_rule


def gdn_backend(device_type: str) -> str:
    """What the Gated DeltaNet forwards run on a ``device_type`` tensor: ``fla`` (delta rule and, when this fla
    release has it, the varlen conv), ``torch`` (the reference: CPU, fla absent or failing to import, or
    ``VERL_GDN_BACKEND=torch``). An installed fla that does not import counts as absent, as it runs."""
    if os.environ.get(GDN_BACKEND_ENV, "auto").lower() == "torch":
        return "torch"
    return "fla" if device_type == "cuda" and _fla_functions() is not None else "torch"


def fla_conv_available() -> bool:
    """Whether the fla release that imports also has its varlen causal conv (else the conv runs in torch)."""
    fns = _fla_functions()
    return fns is not None and fns[0] is not None


def use_fla(device: torch.device) -> bool:
    return gdn_backend(device.type) == "fla"


# ----------------------------------------------------------------------------------------------------------------
# Sequence bookkeeping
# ----------------------------------------------------------------------------------------------------------------


def torch_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    activation: Optional[str] = "silu",
) -> torch.Tensor:
    """Depthwise causal conv on ``x`` (B, T, D) with ``weight`` (D, W); restarts at every packed boundary.

    Written as a sum of W shifted copies so a tap whose source token belongs to another sequence can be
    masked out exactly (a single F.conv1d over the packed row would leak the previous sequence's tail).
    """
    batch, total, _ = x.shape
    width = weight.shape[-1]
    xf = x.to(weight.dtype)
    seq = None
    if cu_seqlens is not None:
        seq = seq_ids_from_cu_seqlens(cu_seqlens, total)
    out = xf * weight[:, width - 1]
    for shift in range(1, width):
        if shift >= total:
            break
        src = F.pad(xf[:, : total - shift], (0, 0, shift, 0))  # src[t] = x[t - shift], zeros before t=0
        if seq is not None:
            same = F.pad(seq[shift:] == seq[:-shift], (shift, 0), value=False)
            src = src * same.to(src.dtype)[None, :, None]
        out = out + src * weight[:, width - 1 - shift]
    if bias is not None:
        out = out + bias
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}")
    return out.to(x.dtype)


def causal_conv1d(x, weight, bias=None, cu_seqlens=None, activation="silu"):
    """Dispatch: fla's varlen conv on CUDA when available, the torch reference otherwise."""
    if use_fla(x.device):
        conv = _fla_functions()[0]
        if conv is not None:
            if cu_seqlens is not None and x.shape[0] != 1:
                raise ValueError("varlen conv expects a single packed row")
            out = conv(
                x=x,
                weight=weight,
                bias=bias,
                activation=activation,
                cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(torch.int32),
            )
            return out[0] if isinstance(out, tuple) else out
    return torch_causal_conv1d(x, weight, bias, cu_seqlens, activation)


# ----------------------------------------------------------------------------------------------------------------
# Gated delta rule
# ----------------------------------------------------------------------------------------------------------------


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # Same formula as fla / transformers (rsqrt of squared norm plus eps) so all backends agree.
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def prenormalize_qk(q: torch.Tensor, k: torch.Tensor, naive: bool):
    """(q, k, use_qk_l2norm for the kernel). ``naive`` (MindSpeed's ``use_naive_l2norm``, a Megatron
    override_transformer_config key of upstream's Qwen3.5 scripts): the L2 norm runs here in plain fp32 torch and
    the kernel gets unit-norm q/k; otherwise the kernel normalises them itself (fla's fused norm on CUDA)."""
    if not naive:
        return q, k, True
    return l2_normalize(q.float()).to(q.dtype), l2_normalize(k.float()).to(k.dtype), False


def recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None):
    """Token-by-token reference, (B, T, H, K/V) layout. Slow; only used to validate the chunked form."""
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    q, k, v, g, beta = (z.float() for z in (q, k, v, g, beta))
    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.float()
    outs = []
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, i])
        correction = (v[:, i] - predicted) * beta[:, i][..., None]
        state = state + k[:, i][..., None] * correction[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, i] * scale))
    return torch.stack(outs, 1), state


def chunked_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, chunk_size: int = 64):
    """Chunk-parallel gated delta rule on independent rows, (B, T, H, K/V) layout, computed in fp32.

    Within a chunk, with c_i the cumulative log-decay up to position i and S0 the incoming state, the written
    values u satisfy (I + A) u = beta*v - beta*exp(c)*k S0 where A_ij = beta_i exp(c_i - c_j) k_i.k_j (j < i);
    the outputs are exp(c) q S0 + (q k^T * exp(c_i - c_j))_{j<=i} u and the outgoing state is
    exp(c_last) S0 + sum_j exp(c_last - c_j) k_j u_j^T. Only the state crosses chunks.
    """
    in_dtype = v.dtype
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    # (B, H, T, D) fp32 for the matmuls below.
    q, k, v = (z.float().transpose(1, 2) for z in (q, k, v))
    g, beta = (z.float().transpose(1, 2) for z in (g, beta))
    q = q * scale
    pad = (-t) % chunk_size
    if pad:
        q, k, v = (F.pad(z, (0, 0, 0, pad)) for z in (q, k, v))
        g, beta = (F.pad(z, (0, pad)) for z in (g, beta))
    n_chunks = (t + pad) // chunk_size
    q, k, v = (z.reshape(b, h, n_chunks, chunk_size, -1) for z in (q, k, v))
    g, beta = (z.reshape(b, h, n_chunks, chunk_size) for z in (g, beta))

    cum = g.cumsum(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # Mask before exp so upper-triangle differences (which may be large and positive) never overflow.
    rel = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    a_mat = (k_beta @ k.transpose(-1, -2)) * rel
    system = a_mat.tril(-1) + torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    u_from_v = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    u_from_state = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * rel
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()

    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.float()
    outs = []
    for i in range(n_chunks):
        u = u_from_v[:, :, i] - u_from_state[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + qk[:, :, i] @ u)
        state = state * chunk_decay[:, :, i, None, None] + k_to_end[:, :, i].transpose(-1, -2) @ u
    out = torch.cat(outs, dim=2)[:, :, :t]
    return out.transpose(1, 2).to(in_dtype), state


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: Optional[torch.Tensor] = None,
    max_seqlen: Optional[int] = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
):
    """Gated delta rule over (B, T, H, D) inputs; with ``cu_seqlens`` (B must be 1) every sequence starts
    from ``initial_state`` (one [H, K, V] state per sequence, or per row without ``cu_seqlens``; zeros when
    None). q/k must already have as many heads as v. Returns the output, or (output, final fp32 states) with
    ``output_final_state`` (context parallelism carries a sequence's state from one chunk to the next)."""
    if use_fla(q.device):
        rule = _fla_functions()[1]
        out, final = rule(
            q,
            k,
            v,
            g=g,
            beta=beta,
            initial_state=initial_state,
            output_final_state=output_final_state,
            cu_seqlens=None if cu_seqlens is None else cu_seqlens.long(),
            use_qk_l2norm_in_kernel=use_qk_l2norm,
        )
        return (out, final) if output_final_state else out
    if use_qk_l2norm:
        q, k = l2_normalize(q.float()), l2_normalize(k.float())
    if cu_seqlens is None:
        out, final = chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, initial_state=initial_state)
        return (out, final) if output_final_state else out
    if q.shape[0] != 1:
        raise ValueError("packed gated delta rule expects a single row")
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    # Lay the sequences out as right-padded rows: padded slots follow every real token, so they cannot
    # influence it, and each row starts from its own state. The padding (zero k, v, beta and log-decay 0) leaves
    # the state unchanged, so a row's final state is its sequence's.
    rows, index = zip(*(packed_to_batch(z[0], cu_seqlens, max_seqlen) for z in (q, k, v, g, beta)))
    out, final = chunked_gated_delta_rule(*rows, chunk_size=min(chunk_size, max(16, max_seqlen)),
                                          initial_state=initial_state)
    out = batch_to_packed(out, index[0]).unsqueeze(0).to(v.dtype)
    return (out, final) if output_final_state else out


# ----------------------------------------------------------------------------------------------------------------
# Layer forward (replaces Qwen3_5GatedDeltaNet.forward / Qwen3_5MoeGatedDeltaNet.forward on patched instances)
# ----------------------------------------------------------------------------------------------------------------


def gated_deltanet_forward(self, hidden_states: torch.Tensor, packed=None, attention_mask=None, **kwargs):
    """Qwen3.5 linear-attention block without a cache.

    ``packed`` is a :class:`verl.models.qwen3_5.hf_forward.PackedSeqInfo` (or None: every row is one
    sequence). ``attention_mask`` (B, L) is only honoured for direct calls with padding: pad positions are
    zeroed, which keeps them out of the conv window and the state (zero k contributes no update).
    """
    if kwargs.get("cache_params") is not None:  # cached decoding: the stock forward owns conv/recurrent states
        return type(self).forward(self, hidden_states, attention_mask=attention_mask, **kwargs)
    from verl.models.qwen3_5 import hf_forward as q35  # local import: the Ulysses helpers live with the layer forwards

    if attention_mask is not None and attention_mask.dim() == 2:
        hidden_states = hidden_states * attention_mask[..., None].to(hidden_states.dtype)
    sp = q35.current_sp_group(packed)
    b, t, _ = hidden_states.shape
    n_k, n_v = self.num_k_heads, self.num_v_heads
    dk, dv = self.head_k_dim, self.head_v_dim

    qkv = self.in_proj_qkv(hidden_states)
    z = self.in_proj_z(hidden_states)
    beta = self.in_proj_b(hidden_states).sigmoid()
    # Decay in log space, kept in fp32 (A_log.exp() overflows half precision).
    g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden_states).float() + self.dt_bias.float())

    if sp is not None:
        # Ulysses: trade the sequence shard for a head shard so the conv and recurrence see whole sequences.
        qkv, beta, g = q35.gdn_scatter_heads(self, qkv, beta, g, sp)
        n_k, n_v = n_k // sp.size(), n_v // sp.size()
    conv_w = q35.gdn_local_conv_weight(self, sp)
    cu = packed.cu_seqlens if packed is not None else None
    max_len = packed.max_seqlen if packed is not None else None
    mixed = causal_conv1d(qkv, conv_w, None if self.conv1d.bias is None else self.conv1d.bias, cu, "silu")
    tq = mixed.shape[1]
    q, k, v = torch.split(mixed, [n_k * dk, n_k * dk, n_v * dv], dim=-1)
    q, k, v = q.reshape(b, tq, n_k, dk), k.reshape(b, tq, n_k, dk), v.reshape(b, tq, n_v, dv)
    if n_v != n_k:
        # Grouped value heads: each key head serves n_v // n_k consecutive value heads.
        q = q.repeat_interleave(n_v // n_k, dim=2)
        k = k.repeat_interleave(n_v // n_k, dim=2)
    core = gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, max_seqlen=max_len, use_qk_l2norm=True)
    if sp is not None:
        core = q35.gdn_gather_heads(core, sp)
    core = self.norm(core.reshape(-1, dv), z.reshape(-1, dv)).reshape(b, t, -1)
    return self.out_proj(core)
