"""Model FLOPs per training step, for MFU logging (``FlopsCounter``) and benchmarks.

Conventions (all counts are *useful* FLOPs, one multiply-add = 2 FLOPs):

* training = forward x 3 (backward costs two forwards: grads w.r.t. activations and weights);
* dense matmuls: 2 * (weight elements) per token; the input embedding is a lookup (0 FLOPs),
  the LM head is a ``hidden x vocab`` matmul;
* full (softmax) attention, causal, per sequence of length ``s``: ``QK^T`` and ``PV`` over the
  ``s (s + 1) / 2`` visible pairs -> ``2 * 2 * heads * head_dim * s (s + 1) / 2`` forward FLOPs;
* Gated DeltaNet (Qwen3.5 ``linear_attention`` layers): projections ``in_proj_qkv``,
  ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``out_proj`` as dense matmuls; the depthwise
  causal conv1d costs ``kernel`` MACs per channel per token; the chunked delta rule
  (chunk ``C`` = :data:`GDN_CHUNK_SIZE`, per value head with key dim ``dk``, value dim ``dv``,
  state ``dk x dv``) costs, per chunk of ``C`` tokens, in multiply-adds:

      C^2 dk      (K K^T, beta-scaled)          + C^3 / 3   (triangular inverse)
    + C^2 (dk+dv) (W = T beta K, U = T beta V)  + C dk dv   (U - W S)
    + C^2 (dk+dv) (intra-chunk Q K^T and its product with the new values) + C dk dv (Q S)
    + C dk dv     (state update S += K^T U)

  i.e. per token and head ``3 dk dv + C (3 dk + 2 dv) + C^2 / 3`` MACs. Gates, norms and
  activations (elementwise) are ignored everywhere.
* MoE: router ``hidden x experts``; routed experts count the ``top_k`` SwiGLU MLPs a token
  visits; Qwen3.5-MoE's shared expert (SwiGLU) and its scalar gate are counted on every token.

Vision towers of VL configs are not counted (only their ``text_config``).

Which formula a config gets is its model spec's choice (``ModelSpec.flops_fn``), read through
:mod:`verl.utils.model_specs` (verl.models hands its spec table over on import, so this module imports no model
code): each architecture package has its own (e.g. ``verl.models.qwen3_5.flops``), the generic llama / mistral /
qwen2 / qwen3 families get :func:`dense_decoder_forward_flops`, others none (0, with a warning from
:class:`FlopsCounter`). The helpers below are the shared building blocks of those formulas.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import torch

from verl.utils.model_specs import model_spec_of

__all__ = [
    "FlopsCounter",
    "GDN_CHUNK_SIZE",
    "count_flops",
    "dense_decoder_forward_flops",
    "forward_flops",
    "gdn_delta_rule_macs_per_token",
    "get_device_flops",
]

# Chunk length of the chunked Gated-DeltaNet kernels (fla's chunk_gated_delta_rule uses 64).
GDN_CHUNK_SIZE = 64

# Dense bf16 tensor-core peak per device, FLOP/s (no sparsity).
_DEVICE_FLOPS = {
    "CPU": 448e9,
    "H100": 989e12,  # SXM (the name reads "NVIDIA H100 80GB HBM3")
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H800": 989e12,
    "H200": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "B200": 2.25e15,
    "GB200": 2.5e15,
    "L40S": 362.05e12,
    "L40": 181.05e12,
    "A40": 149.7e12,
    "L20": 119.5e12,
}
# "B" is the bare number, as in upstream verl.
_UNITS = {"B": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}


def get_device_flops(unit: str = "T", device_name: Optional[str] = None) -> float:
    """Peak bf16 FLOP/s of ``device_name`` (default: the current CUDA device, else ``"CPU"``).

    ``unit`` is one of B (bare number), K, M, G, T (default), P. Unknown devices give ``inf``
    (so MFU reads 0 rather than a wrong number).
    """
    if unit not in _UNITS:
        raise ValueError(f"unit must be one of {list(_UNITS)}, got {unit!r}")
    if device_name is None:
        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    # Longest key first, so "H200" wins over "H20" and "GB200" over "B200".
    for key in sorted(_DEVICE_FLOPS, key=len, reverse=True):
        if key in device_name:
            return _DEVICE_FLOPS[key] / _UNITS[unit]
    return float("inf")


# ----------------------------------------------------------------------------- building blocks


def text_config(config):
    return getattr(config, "text_config", None) or config


def head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def swiglu_params(hidden: int, inter: int) -> int:
    return 3 * hidden * inter  # gate_proj, up_proj, down_proj


def causal_attention_fwd(batch_seqlens, n_heads: int, head_dim: int) -> int:
    """Forward FLOPs of one causal softmax-attention layer (QK^T and PV on visible pairs)."""
    pairs = sum(s * (s + 1) // 2 for s in batch_seqlens)
    return 2 * 2 * n_heads * head_dim * pairs


def gdn_delta_rule_macs_per_token(dk: int, dv: int, chunk: int = GDN_CHUNK_SIZE) -> float:
    """Multiply-adds per token and value head of the chunked delta rule (module docstring)."""
    return 3 * dk * dv + chunk * (3 * dk + 2 * dv) + chunk * chunk / 3


# ----------------------------------------------------------------------------- model formulas


def dense_decoder_forward_flops(config, batch_seqlens) -> float:
    """llama / mistral / qwen2 / qwen3: GQA attention + SwiGLU MLP on every layer."""
    cfg = text_config(config)
    hd = head_dim(cfg)
    q = cfg.num_attention_heads * hd
    kv = cfg.num_key_value_heads * hd
    h = cfg.hidden_size
    attn = h * (q + 2 * kv) + q * h
    macs_per_token = cfg.num_hidden_layers * (attn + swiglu_params(h, cfg.intermediate_size)) + h * cfg.vocab_size
    flops = 2 * macs_per_token * sum(batch_seqlens)
    flops += cfg.num_hidden_layers * causal_attention_fwd(batch_seqlens, cfg.num_attention_heads, hd)
    return flops


def _forward_fn(config) -> Optional[Callable]:
    """The FLOPs formula of ``config``'s model, as its model spec names it (``ModelSpec.flops_fn``)."""
    spec = model_spec_of(config)
    return None if spec is None else spec.resolve("flops_fn")


def forward_flops(config, batch_seqlens) -> float:
    """Forward FLOPs of one pass over sequences of lengths ``batch_seqlens`` (0 if the model spec names no
    formula: Qwen3.5 has its own, llama / mistral / qwen2 / qwen3 the dense-decoder one)."""
    func = _forward_fn(config)
    return 0.0 if func is None else float(func(config, list(batch_seqlens)))


def count_flops(config, batch_seqlens) -> float:
    """Training (forward + backward) FLOPs: 3x :func:`forward_flops`."""
    return 3 * forward_flops(config, batch_seqlens)


class FlopsCounter:
    """Achieved model TFLOP/s of training steps, for MFU.

    Example::

        counter = FlopsCounter(hf_config)
        achieved, promised = counter.estimate_flops(seqlens, delta_time)  # both in TFLOP/s
        mfu = achieved / promised
    """

    def __init__(self, config):
        self.config = config
        if _forward_fn(config) is None:
            warnings.warn(
                f"no FLOPs formula for model_type {getattr(config, 'model_type', None)!r} (its model spec names "
                "none, or verl.models was never imported); MFU will read 0.",
                stacklevel=2,
            )

    def estimate_flops(self, batch_seqlens, delta_time: float, **kwargs) -> tuple[float, float]:
        """``(achieved TFLOP/s, device peak TFLOP/s)`` for one step over ``batch_seqlens`` taking
        ``delta_time`` seconds. Extra keyword arguments (e.g. ``images_seqlens``) are accepted
        for upstream compatibility and ignored: vision towers are not counted."""
        achieved = count_flops(self.config, batch_seqlens) / delta_time / 1e12
        return achieved, get_device_flops()
