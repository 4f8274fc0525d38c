"""Upstream verl features this project leaves out, so their keys and values are refused by name.

Two tables: config subtrees that belong to a left-out feature (any key below them is refused naming the
feature), and values of registry-backed keys that name a left-out implementation (refused at validation
with the feature named, instead of a bare "not registered"). docs/start/migrating.md lists the same
features for users.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Optional

__all__ = ["FEATURE_KEY_PATTERNS", "FEATURE_VALUES", "feature_for_key", "feature_for_value", "feature_for_group"]

# glob over dotted keys -> what the feature is.
FEATURE_KEY_PATTERNS: dict[str, str] = {
    "*.veomni": "the VeOmni training engine",
    "*.veomni.*": "the VeOmni training engine",
    "*.turbo_config": "FSDP-Turbo (Huawei's fsdp_turbo training engine, upstream's strategy=fsdp_turbo)",
    "*.turbo_config.*": "FSDP-Turbo (Huawei's fsdp_turbo training engine, upstream's strategy=fsdp_turbo)",
    "*.torchtitan": "the TorchTitan training engine",
    "*.torchtitan.*": "the TorchTitan training engine",
    "*.engine_kwargs.trtllm": "the TRT-LLM rollout engine",
    "*.engine_kwargs.trtllm.*": "the TRT-LLM rollout engine",
    "transfer_queue": "the TransferQueue data plane",
    "transfer_queue.*": "the TransferQueue data plane",
    "trainer.v1.*": "the v1 (fully asynchronous) trainer",
    "*.qat": "quantization-aware training (QAT)",
    "*.qat.*": "quantization-aware training (QAT)",
}

# (config key glob, value) -> what the value selects upstream.
FEATURE_VALUES: dict[tuple[str, str], str] = {
    ("*.rollout.name", "trtllm"): "the TRT-LLM rollout engine",
    ("*.rollout.name", "sglang"): "the SGLang rollout engine",
    ("*.strategy", "veomni"): "the VeOmni training engine",
    ("*.strategy", "torchtitan"): "the TorchTitan training engine",
    ("*.strategy", "fsdp_turbo"): "FSDP-Turbo (Huawei's fsdp_turbo training engine)",
    ("*.kl_loss_type", "full"): "the full-vocabulary KL (it needs full-vocabulary logits)",
    ("algorithm.kl_penalty", "full"): "the full-vocabulary KL (it needs full-vocabulary logits)",
    ("distillation.distillation_loss.loss_mode", "forward_kl_topk"):
        "upstream's top-k forward-KL distillation loss (it needs the teacher's top-k log-probs per token; the "
        "teacher here scores the sampled tokens only)",
    ("*.multi_turn.format", "gpt-oss"): "the gpt-oss (Harmony) tool-call format",
    ("*.multi_turn.format", "glm"): "the GLM tool-call format",
    ("*.multi_turn.format", "seed"): "the Seed tool-call format",
    ("*.multi_turn.format", "minimax"): "the MiniMax tool-call format",
    ("*.multi_turn.format", "kimi"): "the Kimi tool-call format",
    ("*.multi_turn.format", "deepseek_v4"): "the DeepSeek-V4 tool-call format",
    ("*.multi_turn.format", "gemma4"): "the Gemma 4 tool-call format",
    ("*.multi_turn.format", "llama3_json"): "the Llama 3 JSON tool-call format",
}

# config group -> {choice: feature}, for `model_engine=veomni` and the like.
FEATURE_GROUP_CHOICES: dict[str, dict[str, str]] = {
    "model_engine": {"veomni": "the VeOmni training engine", "torchtitan": "the TorchTitan training engine"},
    "actor": {"mlite_actor": "the Megatron-lite training engine (upstream's verl_mlite plugin)"},
}


def feature_for_key(key: str) -> Optional[str]:
    """The left-out feature a dotted key belongs to, if any."""
    for pattern, feature in FEATURE_KEY_PATTERNS.items():
        if fnmatch.fnmatchcase(key, pattern):
            return feature
    return None


def feature_for_value(key: str, value: Any) -> Optional[str]:
    if not isinstance(value, str):
        return None
    for (pattern, val), feature in FEATURE_VALUES.items():
        if val == value and fnmatch.fnmatchcase(key, pattern):
            return feature
    return None


def feature_for_group(group: str, choice: str) -> Optional[str]:
    choices = FEATURE_GROUP_CHOICES.get(group.split("@")[0].lstrip("+~"), {})
    return choices.get(choice) or choices.get("*")
