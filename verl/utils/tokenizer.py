"""Where a role's model lives on disk, and the tokenizer / multimodal processor that go with it.

Shared by every training engine (FSDP, Megatron), the rollout and the trainer's dataset."""

from __future__ import annotations

import os

__all__ = ["load_tokenizer_and_processor", "local_model_path"]


def local_model_path(model_cfg) -> str:
    path = os.path.expanduser(str(model_cfg.path))
    if model_cfg.get("use_shm", False):
        from verl.utils.fs import copy_to_shm

        path = copy_to_shm(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"actor_rollout_ref.model.path={model_cfg.path!r} is not a directory. Point it at a local Hugging Face "
            "checkpoint (config.json + weights); no model hub is contacted."
        )
    return path


def load_tokenizer_and_processor(model_cfg):
    """Tokenizer (must have a chat template) and, for VL checkpoints, the processor."""
    from transformers import AutoTokenizer

    from verl.utils.processor import load_processor

    path = local_model_path(model_cfg)
    tok_path = os.path.expanduser(str(model_cfg.get("tokenizer_path") or path))
    trust = bool(model_cfg.get("trust_remote_code", False))
    tokenizer = AutoTokenizer.from_pretrained(tok_path, trust_remote_code=trust)
    custom = model_cfg.get("custom_chat_template")
    if custom:
        tokenizer.chat_template = custom
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer at {tok_path} has no chat template; set actor_rollout_ref.model.custom_chat_template "
            "or use a checkpoint whose tokenizer_config.json defines one"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    processor = None
    try:
        # Like AutoProcessor, but image-only where the video processor needs the missing torchvision.
        processor = load_processor(tok_path, trust_remote_code=trust)
        if processor is tokenizer or not hasattr(processor, "image_processor"):
            processor = None
    except (OSError, ValueError, TypeError, KeyError):
        processor = None  # text-only checkpoints have no processor config
    if processor is not None and custom:
        processor.chat_template = custom
    return tokenizer, processor
