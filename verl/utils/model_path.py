"""``model.path``: a local checkpoint directory or a Hugging Face Hub id (``Qwen/Qwen3.5-9B``).

A hub id goes to Hugging Face's own downloader (``huggingface_hub.snapshot_download``), which fetches the
checkpoint where a hub is reachable and reuses the local HF cache otherwise (``HF_HUB_OFFLINE=1`` makes it
use only the cache). The result is always a local directory, because the rollout engines and the weight
sync read files. When neither works, the error says what to do in one paragraph.
"""

from __future__ import annotations

import os
import re

from verl.utils.user_errors import UserFacingError

__all__ = ["is_hub_id", "model_config_dir", "resolve_model_path"]

# `name` or `org/name`, as the Hub spells repository ids (no leading dot/slash, no `..`).
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$")

# What a trainer needs from a checkpoint; skips other formats (.bin twins, .gguf, onnx, ...).
_ALLOW = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py", "tokenizer*"]


def is_hub_id(path: str) -> bool:
    return bool(_HUB_ID.match(path)) and ".." not in path and not os.path.exists(path)


def resolve_model_path(path, use_shm: bool = False, what: str = "actor_rollout_ref.model.path",
                       revision: str | None = None) -> str:
    """A local directory holding the checkpoint named by ``path`` (downloaded into the HF cache if needed)."""
    raw = str(path)
    local = os.path.expanduser(raw)
    if not os.path.isdir(local):
        if not is_hub_id(raw):
            raise UserFacingError(
                "Model", f"{what}={raw!r} is not a directory and not a Hugging Face Hub id",
                "Point it at a local Hugging Face checkpoint (config.json + weights) or at a hub id like "
                "Qwen/Qwen3.5-9B.")
        local = _download(raw, what, revision)
    if use_shm:
        from verl.utils.fs import copy_to_shm

        local = copy_to_shm(local)
    return local


def _download(repo_id: str, what: str, revision: str | None) -> str:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as err:  # pragma: no cover - transformers depends on huggingface_hub
        raise UserFacingError("Model", f"{what}={repo_id!r} is a hub id but huggingface_hub is not installed",
                              "Install huggingface_hub or point the key at a local directory.") from err
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=_ALLOW)
    except Exception as err:  # noqa: BLE001 - hub errors come in many types; all end in the same advice
        reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}".rstrip(": ")
        where = "it is not in the local Hugging Face cache and HF_HUB_OFFLINE is set" if offline else (
            "it could not be fetched from the Hugging Face Hub and is not in the local cache")
        raise UserFacingError(
            "Model", f"{what}={repo_id!r} looks like a Hugging Face Hub id, but {where} ({reason})",
            f"Where a hub is reachable, download it once (`huggingface-cli download {repo_id}`) so the cache "
            f"has it and run with HF_HUB_OFFLINE=1, or point {what} at a local checkpoint directory; "
            "check the id's spelling and HF_TOKEN for gated models.") from err


def model_config_dir(model_cfg, key: str = "path", what: str | None = None, use_shm: bool | None = None) -> str:
    """The local directory of a model section's ``key`` (``path``, ``tokenizer_path``), a plain dict or a
    DictConfig: :func:`resolve_model_path` with the section's ``use_shm`` unless ``use_shm`` is given."""
    get = model_cfg.get if hasattr(model_cfg, "get") else (lambda k, d=None: getattr(model_cfg, k, d))
    what = what or f"actor_rollout_ref.model.{key}"
    value = get(key, None)
    if value is None or str(value) == "":
        raise UserFacingError("Model", f"{what} is not set", "Point it at a local Hugging Face checkpoint "
                              "directory or at a hub id like Qwen/Qwen3.5-9B.")
    if use_shm is None:
        use_shm = bool(get("use_shm", False))
    return resolve_model_path(value, use_shm=use_shm, what=what)
