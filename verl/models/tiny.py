"""A character-level tokenizer with Qwen-style chat markers, built locally for tiny test and demo models.

No hub is reachable at run time, so the embedded demo and every test build their tokenizers here; the tiny
checkpoints of each architecture are built by its package (e.g. :mod:`verl.models.qwen3_5.tiny`).
"""

from __future__ import annotations

import os
import re
import string
from pathlib import Path


# Special tokens in the order Qwen-style chat templates use them. The VL markers are present so the same
# tokenizer serves text and vision-language tiny models.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<unk>",
]
# XML tool-call markup is spelled with characters, but these short pieces keep tool-calling prompts short.
WORD_TOKENS = ["<function=", "</function>", "<parameter=", "</parameter>"]
CHARS = list(string.ascii_letters + string.digits + string.punctuation + " \n\t")

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "utils" / "chat_templates"


def tiny_vocab() -> dict[str, int]:
    tokens = SPECIAL_TOKENS + WORD_TOKENS + CHARS
    return {tok: i for i, tok in enumerate(tokens)}


def default_chat_template() -> str:
    return (TEMPLATE_DIR / "qwen3_5.jinja").read_text()


def build_tiny_tokenizer(path: str | os.PathLike | None = None, chat_template: str | None = None):
    """A character-level fast tokenizer with Qwen's special tokens and a Qwen3.5-style chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = tiny_vocab()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Multi-character word tokens first, then one token per character.
    pieces = "|".join(re.escape(w) for w in WORD_TOKENS)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(f"{pieces}|(?m:.)"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|endoftext|>", "<|im_end|>", "<unk>")],
    )
    fast.chat_template = chat_template if chat_template is not None else default_chat_template()
    if path is not None:
        fast.save_pretrained(str(path))
    return fast


def pad_vocab(n: int, multiple: int = 16) -> int:
    return (n + multiple - 1) // multiple * multiple
