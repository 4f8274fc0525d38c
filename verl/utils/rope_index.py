"""Multimodal rotary (mRoPE) position ids, computed with the model's own ``get_rope_index``.

Model-independent: the method is looked up on the transformers class named by the checkpoint's architecture, so
every Qwen-VL style model (Qwen2-VL to Qwen3.5) is covered without a table here. It lives among the utilities
because the datasets, the rollout and the agent loop all need it and none of them may import another.
"""

from __future__ import annotations

from types import MethodType, SimpleNamespace
from typing import Any, Optional

import torch

def rope_indexer_from_config(model_config) -> Optional[Any]:
    """An object exposing the model's own ``get_rope_index`` without building its weights.

    The method only reads ``self.config`` (and ``self.get_vision_position_ids``), so it is bound to a light
    namespace carrying the config. Returns None for text-only configs.
    """
    if getattr(model_config, "vision_config", None) is None:
        return None
    import transformers

    arch = (getattr(model_config, "architectures", None) or [""])[0]
    model_cls = getattr(transformers, arch.replace("ForConditionalGeneration", "Model"), None)
    if model_cls is None or not hasattr(model_cls, "get_rope_index"):
        raise ValueError(f"cannot find the base model class with get_rope_index for architecture {arch!r}")
    shim = SimpleNamespace(config=model_config)
    for name in ("get_rope_index", "get_vision_position_ids"):
        if hasattr(model_cls, name):
            setattr(shim, name, MethodType(getattr(model_cls, name), shim))
    return shim


def compute_position_ids(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    multi_modal_inputs: Optional[dict[str, torch.Tensor]] = None,
    rope_indexer=None,
    image_token_id: Optional[int] = None,
    video_token_id: Optional[int] = None,
) -> torch.Tensor:
    """Position ids for one padded row ``(1, L)``.

    Text models: ``(1, L)`` cumulative positions over attended tokens. mRoPE models (``rope_indexer`` given):
    ``(1, 4, L)``, row 0 the text positions and rows 1..3 the t/h/w positions from the model's own
    ``get_rope_index`` (upstream's layout; Qwen3.5 splits 4-row position ids the same way).
    """
    text_pos = (torch.cumsum(attention_mask, dim=-1) - 1).clamp(min=0).long()
    if rope_indexer is None:
        return text_pos
    mm = multi_modal_inputs or {}
    # transformers >= 5.3 derives modality spans from mm_token_type_ids (0 text, 1 image, 2 video).
    mm_token_type_ids = torch.zeros_like(input_ids, dtype=torch.int)
    if image_token_id is not None:
        mm_token_type_ids[input_ids == image_token_id] = 1
    if video_token_id is not None:
        mm_token_type_ids[input_ids == video_token_id] = 2
    vision_pos, _ = rope_indexer.get_rope_index(
        input_ids=input_ids,
        mm_token_type_ids=mm_token_type_ids,
        image_grid_thw=mm.get("image_grid_thw"),
        video_grid_thw=mm.get("video_grid_thw"),
        attention_mask=attention_mask,
    )
    vision_pos = vision_pos.transpose(0, 1)  # (3, 1, L) -> (1, 3, L)
    return torch.cat([text_pos.unsqueeze(1), vision_pos.to(text_pos.dtype)], dim=1)
