"""Public entry point (seed name) for Qwen3.5's FSDP forwards, which live in :mod:`verl.models.qwen3_5`.

The layer forwards (packed rows, padding, Ulysses SP, VL) are :mod:`verl.models.qwen3_5.hf_forward`; the
causal-LM head backends (``forward_with_normal_backend`` and the fused log-prob ``forward_with_torch_backend`` /
``forward_with_triton_backend``) are shared by every architecture and live in
:mod:`verl.models.transformers.fused_forward`. ``apply_monkey_patch`` installs them.
"""

from verl.models.qwen3_5.hf_forward import (  # noqa: F401
    decoder_layer_forward,
    fast_pos_embed_interpolate,
    text_model_forward,
    vision_forward,
    vision_interp_indices_weights,
    vl_model_forward,
)
from verl.models.transformers.fused_forward import (  # noqa: F401
    CausalLMOutputForPPO,
    forward_with_normal_backend,
    forward_with_torch_backend,
    forward_with_triton_backend,
)
from verl.models.transformers.packed_attention import PackedSeqInfo  # noqa: F401

__all__ = [
    "CausalLMOutputForPPO", "PackedSeqInfo", "decoder_layer_forward", "fast_pos_embed_interpolate",
    "forward_with_normal_backend", "forward_with_torch_backend", "forward_with_triton_backend",
    "text_model_forward", "vision_forward", "vision_interp_indices_weights", "vl_model_forward",
]
