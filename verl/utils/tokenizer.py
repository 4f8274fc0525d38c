"""Where a role's model lives on disk, and the tokenizer / multimodal processor that go with it.

Shared by every training engine (FSDP, Megatron), the rollout and the trainer's dataset."""

from __future__ import annotations

from typing import Optional

__all__ = ["controller_tokenizer_and_processor", "load_tokenizer_and_processor", "local_model_path"]


def local_model_path(model_cfg, section: str = "actor_rollout_ref.model") -> str:
    """A local directory, or a hub id fetched into (or found in) the HF cache (verl/utils/model_path.py);
    ``section`` names the config section in errors (``model`` for the SFT trainer)."""
    from verl.utils.model_path import model_config_dir

    return model_config_dir(model_cfg, "path", what=f"{section}.path")


def controller_tokenizer_and_processor(cfg):
    """The trainer's own tokenizer / processor (datasets, reward): remote code in the tokenizer files is trusted
    when upstream's ``data.trust_remote_code`` says so, or the model's ``trust_remote_code`` (the workers load
    the same files under that key, so a run that trusts the model need not repeat it for the data)."""
    model = cfg.actor_rollout_ref.model
    trust = bool(cfg.data.get("trust_remote_code", False)) or bool(model.get("trust_remote_code", False))
    return load_tokenizer_and_processor(model, trust_remote_code=trust)


def load_tokenizer_and_processor(model_cfg, section: str = "actor_rollout_ref.model",
                                 trust_remote_code: Optional[bool] = None):
    """Tokenizer (must have a chat template) and, for VL checkpoints, the processor. ``tokenizer_path``,
    when set, is resolved like ``path`` (local directory or hub id)."""
    from transformers import AutoTokenizer

    from verl.utils.model_path import model_config_dir
    from verl.utils.processor import load_processor

    key = "tokenizer_path" if model_cfg.get("tokenizer_path") else "path"
    tok_path = model_config_dir(model_cfg, key, what=f"{section}.{key}")
    trust = bool(model_cfg.get("trust_remote_code", False)) if trust_remote_code is None else trust_remote_code
    tokenizer = AutoTokenizer.from_pretrained(tok_path, trust_remote_code=trust)
    custom = model_cfg.get("custom_chat_template")
    if custom:
        tokenizer.chat_template = custom
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer at {tok_path} has no chat template; set {section}.custom_chat_template "
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
