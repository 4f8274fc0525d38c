"""Small helpers shared by the agent loops: tool-response truncation and padding to fixed lengths."""

from __future__ import annotations

from typing import Sequence

import torch

TRUNCATION_SIDES = ("left", "middle", "right")


def truncate_text(text: str, max_length: int, side: str = "middle") -> str:
    """Cut ``text`` to about ``max_length`` characters, marking the cut so the model knows text is missing.

    ``left`` drops the beginning (keeps the tail), ``right`` drops the end, ``middle`` keeps both ends.
    """
    if side not in TRUNCATION_SIDES:
        raise ValueError(f"tool_response_truncate_side must be one of {TRUNCATION_SIDES}, got {side!r}")
    if max_length is None or max_length <= 0 or len(text) <= max_length:
        return text
    if side == "left":
        return "(truncated)..." + text[-max_length:]
    if side == "right":
        return text[:max_length] + "...(truncated)"
    half = max_length // 2
    return text[:half] + "...(truncated)..." + text[len(text) - (max_length - half) :]


def pad_rows(rows: Sequence[Sequence], length: int, pad_value, *, left: bool, dtype: torch.dtype) -> torch.Tensor:
    """Stack variable-length rows into a (len(rows), length) tensor, padding on the left or right."""
    out = torch.full((len(rows), length), pad_value, dtype=dtype)
    for i, row in enumerate(rows):
        row = list(row)[:length] if not left else list(row)[-length:] if length else []
        if not row:
            continue
        if left:
            out[i, length - len(row) :] = torch.tensor(row, dtype=dtype)
        else:
            out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out
