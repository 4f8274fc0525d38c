"""``checkpoint.strict``: does an HF export hold exactly the tensors of the checkpoint it was trained from?

Upstream verl passes ``<role>.checkpoint.strict`` (default true) to its Megatron engine's HF export (``hf_model``
in ``checkpoint.save_contents``). There, strict means: a tensor the export produces that the source checkpoint
(``model.path``) does not have is an error, and so is a source tensor the export never wrote; non-strict skips
the unknown tensors with a warning and writes what it has. That is what lets upstream's Qwen3.5 scripts export
models whose checkpoints carry multi-token-prediction (``mtp.*``) weights the trained model never builds.

Upstream's FSDP engine writes the HF model's own state dict and does not read the key; the FSDP engine here
does the same, so only the Megatron export calls :func:`reconcile_export`.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Mapping, Optional

logger = logging.getLogger(__name__)

__all__ = ["reconcile_export", "source_tensor_names"]

_SHOWN = 5  # names quoted per list in an error; the counts say how many more there are


def source_tensor_names(model_dir: str) -> Optional[set[str]]:
    """Tensor names of the safetensors checkpoint in ``model_dir`` (its index when there is one, else the file
    headers), or None when it holds no safetensors (nothing to compare against: the export is not checked)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as fh:
            return set(json.load(fh).get("weight_map", {}))
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        return None
    from safetensors import safe_open

    names: set[str] = set()
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as handle:
            names.update(handle.keys())
    return names


def _some(names: list[str]) -> str:
    head = ", ".join(names[:_SHOWN])
    return head + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def reconcile_export(tensors: Mapping[str, object], source: Optional[set[str]], strict: bool,
                     key: str) -> dict:
    """The tensors to write. ``source`` (from :func:`source_tensor_names`; None skips the check) is what the
    export should match; ``key`` names the role's ``checkpoint.strict`` in messages."""
    if source is None:
        return dict(tensors)
    unknown = sorted(set(tensors) - source)
    unwritten = sorted(source - set(tensors))
    if not unknown and not unwritten:
        return dict(tensors)
    parts = []
    if unwritten:
        parts.append(f"{len(unwritten)} tensor(s) of the source checkpoint are not produced ({_some(unwritten)})")
    if unknown:
        parts.append(f"{len(unknown)} produced tensor(s) are not in the source checkpoint ({_some(unknown)})")
    what = "; ".join(parts)
    if strict:
        raise RuntimeError(f"HF export does not match the source checkpoint with {key}=true: {what}. Set "
                           f"{key}=false to write the tensors the source has (e.g. when the source carries MTP "
                           "weights the trained model does not build).")
    logger.warning("%s=false: %s; the unknown ones are skipped, the rest written.", key, what)
    return {name: t for name, t in tensors.items() if name in source}
