"""Tiny, deterministic Qwen3.5 checkpoints (dense, MoE, VL), built locally with ``save_pretrained``.

The shapes keep both layer types (3 Gated DeltaNet + 1 full attention per block of four) so every
Qwen3.5-specific code path is exercised, just small enough for a 2-core CPU. The tokenizer is the shared one of
:mod:`verl.models.tiny`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from verl.models.tiny import build_tiny_tokenizer, pad_vocab, tiny_vocab


def tiny_text_config_kwargs(**overrides) -> dict:
    """Keyword arguments for a Qwen3_5TextConfig / Qwen3_5MoeTextConfig of demo size."""
    vocab = tiny_vocab()
    kw = dict(
        vocab_size=pad_vocab(len(vocab)),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        pad_token_id=vocab["<|endoftext|>"],
        eos_token_id=vocab["<|im_end|>"],
        bos_token_id=None,
    )
    kw.update(overrides)
    n = kw["num_hidden_layers"]
    if len(kw["layer_types"]) != n:
        kw["layer_types"] = [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(n)]
    return kw


# The tiny vision tower sees 4x4 patches merged 2x2, so one merged token covers 8x8 pixels. Images are
# resized to between 2x2 and 4x4 merged tokens (16x16 .. 32x32 pixels): 4 to 16 image tokens per image.
TINY_VL_IMAGE_PROCESSOR = dict(
    patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=32 * 32
)


def build_tiny_vl_processor(tokenizer, path: str | os.PathLike | None = None, **image_overrides):
    """The processor of a tiny Qwen3.5-VL model: the PIL image processor sized for its vision tower plus
    ``tokenizer`` (whose chat template renders ``<|vision_start|><|image_pad|><|vision_end|>`` per image).

    It is transformers' Qwen3VLProcessor (what AutoProcessor maps ``qwen3_5`` to). Its video processor needs
    torchvision, so without torchvision the processor is built without one (images only; see
    :mod:`verl.utils.processor`). The saved files are the usual ``processor_config.json`` /
    ``preprocessor_config.json``, loadable with :func:`verl.utils.processor.load_processor`.
    """
    import transformers as tf

    from verl.utils.processor import without_video_processor

    image_processor = tf.Qwen2VLImageProcessorPil(**{**TINY_VL_IMAGE_PROCESSOR, **image_overrides})
    try:
        video_processor = tf.Qwen3VLVideoProcessor(
            patch_size=image_processor.patch_size, merge_size=image_processor.merge_size,
            temporal_patch_size=image_processor.temporal_patch_size,
        )
        processor = tf.Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                        video_processor=video_processor, chat_template=tokenizer.chat_template)
    except ImportError:  # no torchvision
        processor = without_video_processor(tf.Qwen3VLProcessor)(
            image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template
        )
    if path is not None:
        processor.save_pretrained(str(path))
    return processor


def _tiny_vl_model(kind: str, moe_kw: dict, overrides: dict):
    """A tiny random Qwen3.5 (MoE) vision-language model: one vision block, mRoPE over the text."""
    import transformers as tf

    vocab = tiny_vocab()
    text = tiny_text_config_kwargs(**({**moe_kw, **overrides} if kind == "vl_moe" else overrides))
    text["tie_word_embeddings"] = False  # VL checkpoints keep a separate lm_head
    # mRoPE splits the rotary half-dim (head_dim * partial_rotary_factor / 2 = 2) across t/h/w sections.
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    }
    if kind == "vl_moe":
        text.pop("intermediate_size", None)
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        in_channels=3,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=text["hidden_size"],
        num_position_embeddings=64,
    )
    cfg_cls = tf.Qwen3_5Config if kind == "vl" else tf.Qwen3_5MoeConfig
    cfg = cfg_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    arch = "Qwen3_5ForConditionalGeneration" if kind == "vl" else "Qwen3_5MoeForConditionalGeneration"
    cfg.architectures = [arch]
    return getattr(tf, arch)(cfg)


def build_tiny_qwen3_5(
    path: str | os.PathLike | None = None,
    kind: str = "dense",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    with_tokenizer: bool = True,
    **overrides,
):
    """Build (and optionally save) a tiny random Qwen3.5 model.

    kind: ``dense`` (Qwen3_5ForCausalLM), ``moe`` (Qwen3_5MoeForCausalLM), ``vl``
    (Qwen3_5ForConditionalGeneration), ``vl_moe`` (Qwen3_5MoeForConditionalGeneration) or ``seq_cls``
    (Qwen3_5ForSequenceClassification with one label: a reward model).
    Returns the model; with ``path`` the checkpoint (and tokenizer; for VL kinds also the processor, see
    :func:`build_tiny_vl_processor`) are written there.

    ``mtp_num_hidden_layers=N`` (N >= 1) also builds a random multi-token-prediction head of N layers, attached
    as ``model.mtp`` so that the checkpoint holds its ``mtp.*`` tensors as released Qwen3.5 checkpoints do (see
    :mod:`verl.models.qwen3_5.mtp`); the config records ``mtp_num_hidden_layers``.
    """
    import transformers as tf

    torch.manual_seed(seed)
    moe_kw = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    if kind == "dense":
        cfg = tf.Qwen3_5TextConfig(**tiny_text_config_kwargs(**overrides))
        cfg.architectures = ["Qwen3_5ForCausalLM"]
        model = tf.Qwen3_5ForCausalLM(cfg)
    elif kind == "moe":
        text = tiny_text_config_kwargs(**{**moe_kw, **overrides})
        text.pop("intermediate_size", None)
        cfg = tf.Qwen3_5MoeTextConfig(**text)
        cfg.architectures = ["Qwen3_5MoeForCausalLM"]
        model = tf.Qwen3_5MoeForCausalLM(cfg)
    elif kind == "seq_cls":
        # A discriminative reward model: the dense backbone with a one-output score head. The head is drawn
        # with unit scale (HF's init uses initializer_range, 0.02) so that scores of different texts differ
        # visibly in tests.
        cfg = tf.Qwen3_5TextConfig(**tiny_text_config_kwargs(**{"num_labels": 1, **overrides}))
        cfg.architectures = ["Qwen3_5ForSequenceClassification"]
        model = tf.Qwen3_5ForSequenceClassification(cfg)
        with torch.no_grad():
            model.score.weight.normal_(0.0, 1.0)
    elif kind in ("vl", "vl_moe"):
        model = _tiny_vl_model(kind, moe_kw, overrides)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected dense, moe, vl, vl_moe or seq_cls")
    if int(overrides.get("mtp_num_hidden_layers", 0) or 0) > 0:
        from verl.models.qwen3_5.mtp import Qwen3_5MTP, _text_model
        from verl.models.transformers.patching import modeling_module

        text_model = _text_model(model)
        model.add_module("mtp", Qwen3_5MTP(text_model.config, modeling_module(text_model)))
        # The RMSNorms start at zero (unit gain); random gains make a test notice a norm loaded from the wrong key.
        with torch.no_grad():
            # MoE experts and routers hold raw torch.empty / zero parameters that only the model's post_init fills
            # (the head is added after it): without this the head's experts were uninitialised memory (NaN at times).
            for mod in model.mtp.modules():
                if type(mod).__name__.endswith(("Experts", "SparseMoeBlock")):
                    model._init_weights(mod)
            for name, p in model.mtp.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0, 0.1)
    model = model.to(dtype)
    model.eval()
    if path is not None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(path))
        if with_tokenizer:
            tokenizer = build_tiny_tokenizer(path)
            if kind in ("vl", "vl_moe"):
                build_tiny_vl_processor(tokenizer, path)
        (path / "tiny_model.json").write_text(json.dumps({"kind": kind, "seed": seed}))
    return model


def make_mtp_head_exact(model, layer_scale: float = 0.0, mtp_scale: float = 0.0):
    """Turn a random Qwen3.5 with an MTP head (``build_tiny_qwen3_5(..., mtp_num_hidden_layers=1)``) into one whose
    head is an (almost) exact drafter, in place, for speculative-decoding tests and benchmarks.

    The main model's token mixers and MLPs are scaled by ``layer_scale`` (0: a bigram model, whose final hidden
    state at t + 1 is norm(embed(x[t + 1]))), and the head is set to return norm(embed(next token)): with
    ``layer_scale = 0`` every draft is what the model would sample (acceptance 1, the upper bound of the speed-up);
    a small ``layer_scale`` makes the model depend on its context a little, so drafts are right only sometimes.
    ``mtp_scale`` keeps that share of the head's own attention and MLP outputs (so its KV cache matters)."""
    text = model.get_base_model().model if hasattr(model, "get_base_model") else model.model
    text = getattr(text, "language_model", text)
    ends = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "down_proj")
    with torch.no_grad():
        for name, p in text.layers.named_parameters():
            if name.endswith(ends):
                p.mul_(layer_scale)
        mtp = model.mtp
        h = mtp.fc.weight.shape[0]
        mtp.fc.weight.zero_()
        mtp.fc.weight[:, :h] = torch.eye(h, dtype=mtp.fc.weight.dtype, device=mtp.fc.weight.device)
        mtp.pre_fc_norm_embedding.weight.zero_()
        for name, p in mtp.layers.named_parameters():
            if name.endswith(ends):
                p.mul_(mtp_scale)
        mtp.norm.weight.copy_(text.norm.weight)
    return model
