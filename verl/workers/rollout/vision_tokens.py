"""Vision placeholder tokens of a prompt, shared by the hf rollout's two generation paths (``generate`` and the
decode engine)."""

from __future__ import annotations

import torch

from verl.workers.rollout.base import GenerationRequest


def expand_vision_tokens(request: GenerationRequest, config) -> list[int]:
    """The request's prompt ids with one ``<|image_pad|>`` per image grown to that image's token count.

    Dataset rows hand engines the prompt before vision-token expansion (``raw_prompt_ids``, which vLLM expands
    itself); HF ``generate`` needs it expanded to match ``pixel_values``. Already expanded prompts (agent loops)
    pass through unchanged.
    """
    ids = list(request.prompt_token_ids)
    outs = (request.multi_modal_data or {}).get("processor_outputs") or {}
    if outs.get("video_grid_thw") is not None:
        return _video_prompt(request, ids, outs["video_grid_thw"], config)
    grid = outs.get("image_grid_thw")
    image_id = getattr(config, "image_token_id", None)
    if grid is None or image_id is None:
        return ids
    merge = config.vision_config.spatial_merge_size
    counts = [int(n) for n in (torch.as_tensor(grid).prod(-1) // (merge * merge)).tolist()]
    found = sum(t == image_id for t in ids)
    if found == sum(counts):
        return ids
    if found != len(counts):
        raise ValueError(
            f"prompt has {found} image tokens, but its {len(counts)} images need {len(counts)} (one per image, "
            f"unexpanded) or {sum(counts)} (expanded)"
        )
    expanded, k = [], 0
    for t in ids:
        if t == image_id:
            expanded.extend([image_id] * counts[k])
            k += 1
        else:
            expanded.append(t)
    return expanded


def _video_prompt(request: GenerationRequest, ids: list[int], grid, config) -> list[int]:
    """A prompt with videos as the processor expanded it.

    A video placeholder grows into per-frame-pair timestamp text plus vision tokens (Qwen3-VL style), text only
    the processor writes; so rows with videos carry their expanded prompt (``expanded_prompt_token_ids``, the
    dataset's ``input_ids``) and the engine uses it.
    """
    video_id = getattr(config, "video_token_id", None)
    merge = config.vision_config.spatial_merge_size
    need = int((torch.as_tensor(grid).prod(-1) // (merge * merge)).sum())
    if video_id is None:
        raise ValueError("the request has videos but the model config has no video_token_id")
    if sum(t == video_id for t in ids) == need:
        return ids
    full = request.expanded_prompt_token_ids
    if full is None or sum(int(t) == video_id for t in full) != need:
        raise ValueError(
            f"the prompt's videos need {need} video tokens, but neither the prompt nor its "
            "expanded_prompt_token_ids hold them; pass the processor-expanded prompt for video rows"
        )
    return [int(t) for t in full]


def vision_placeholder_ids(config) -> list[int]:
    """Token ids that stand for image / video patches: never sampled."""
    return [t for t in (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None))
            if t is not None]
