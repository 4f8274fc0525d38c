"""Tiny Qwen2.5-, Llama- and Qwen3-shaped causal LMs built here with ``save_pretrained`` (no hub access).

Shapes vLLM's CPU kernels accept (head_dim 32). Qwen2.5 keeps its q/k/v biases (``Qwen2Config`` has them by
default), the case a Qwen3.5-only weight sync could not cover. The project's tiny tokenizer is saved next to
each model so ``main_ppo`` can use the directory as ``actor_rollout_ref.model.path``.
"""

from __future__ import annotations

from pathlib import Path

import torch

GENERIC_KINDS = ("qwen2_5", "llama", "qwen3")


def _config(kind: str, tie: bool):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    from verl.models.tiny import tiny_vocab

    vocab = tiny_vocab()
    common = dict(
        vocab_size=(len(vocab) + 15) // 16 * 16, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
        tie_word_embeddings=tie, pad_token_id=vocab["<|endoftext|>"], eos_token_id=vocab["<|im_end|>"],
        bos_token_id=None,
    )
    if kind == "qwen2_5":
        return Qwen2Config(**common, architectures=["Qwen2ForCausalLM"])
    if kind == "llama":
        return LlamaConfig(**common, architectures=["LlamaForCausalLM"])
    if kind == "qwen3":
        return Qwen3Config(**common, head_dim=32, architectures=["Qwen3ForCausalLM"])
    raise ValueError(f"unknown kind {kind!r}; choose one of {GENERIC_KINDS}")


def build_generic_lm(path: str | Path, kind: str, tie: bool = True, seed: int = 0, dtype=torch.bfloat16):
    """Save a tiny ``kind`` model (and the tiny tokenizer) at ``path``; returns the fp32 model of the same weights."""
    from transformers import AutoModelForCausalLM

    from verl.models.tiny import build_tiny_tokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(kind, tie), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)  # non-zero biases: a sync that drops them shows in the scores
            elif p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.to(dtype).save_pretrained(str(path))
    build_tiny_tokenizer(str(path))
    return model.float()
