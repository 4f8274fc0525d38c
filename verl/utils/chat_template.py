"""Chat-template rendering that tolerates Qwen3.5's "at least one user message" rule.

Qwen3.5's template calls ``raise_exception('No user query found in messages.')`` when a conversation has no
user turn. Multi-turn rollouts render fragments such as a lone tool response, and SFT data may hold
system-only or assistant-first conversations, so :func:`apply_chat_template` renders those with a
placeholder user turn and removes exactly that turn's text again. Any other template error propagates.
"""

from __future__ import annotations

import re
from typing import Any

from jinja2.exceptions import TemplateError

__all__ = ["apply_chat_template", "is_missing_user_error"]

# Matches the wording of Qwen3.5's check (and close variants); deliberately narrow so unrelated template
# errors are never swallowed.
_MISSING_USER_RE = re.compile(r"no user (query|message)", re.IGNORECASE)
# Unique, tokenizer-neutral marker for the placeholder turn (plain ASCII so any vocabulary can encode it).
_SENTINEL = "VERLPLACEHOLDERUSERTURN"


def is_missing_user_error(err: BaseException) -> bool:
    return isinstance(err, TemplateError) and bool(_MISSING_USER_RE.search(str(err)))


def _has_user(messages: list[dict]) -> bool:
    return any(isinstance(m, dict) and m.get("role") == "user" for m in messages)


def _tokenizer_of(processor_or_tokenizer):
    # Processors wrap a tokenizer; tokenizers are their own tokenizer.
    return getattr(processor_or_tokenizer, "tokenizer", processor_or_tokenizer)


def _render(proc, messages, *, tools, add_generation_prompt, **kwargs) -> str:
    out = proc.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
    )
    if isinstance(out, list):  # batched rendering returns one string per conversation
        out = out[0]
    return out


def _placeholder_turn_text(proc, *, tools, **kwargs) -> str:
    """The exact text one placeholder user turn renders to, measured as the difference of two renders."""
    turn = {"role": "user", "content": _SENTINEL}
    one = _render(proc, [turn], tools=tools, add_generation_prompt=False, **kwargs)
    two = _render(proc, [turn, turn], tools=tools, add_generation_prompt=False, **kwargs)
    if not two.startswith(one):
        raise ValueError("chat template renders user turns position-dependently; cannot strip a placeholder turn")
    return two[len(one) :]


def _render_without_user(proc, messages, *, tools, add_generation_prompt, **kwargs) -> str:
    turn_text = _placeholder_turn_text(proc, tools=tools, **kwargs)
    # A leading system message must stay first, so the placeholder goes right after it.
    insert_at = 1 if messages and messages[0].get("role") == "system" else 0
    padded = list(messages[:insert_at]) + [{"role": "user", "content": _SENTINEL}] + list(messages[insert_at:])
    text = _render(proc, padded, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
    if text.count(turn_text) != 1:
        raise ValueError("placeholder user turn not found exactly once in the rendered conversation")
    return text.replace(turn_text, "", 1)


def apply_chat_template(
    processor_or_tokenizer,
    messages: list[dict],
    *,
    tokenize: bool = True,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    return_dict: bool = False,
    **kwargs: Any,
):
    """Render ``messages`` like ``processor_or_tokenizer.apply_chat_template`` (same keywords as upstream).

    Returns a string (``tokenize=False``), a list of token ids (``tokenize=True``) or, with
    ``return_dict=True``, whatever the processor returns. Only when the template rejects a conversation that
    really has no user message does it fall back to rendering with a placeholder user turn.
    """
    proc = processor_or_tokenizer
    options = dict(kwargs, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=tokenize)
    try:
        out = proc.apply_chat_template(messages, return_dict=return_dict, **options)
    except TemplateError as err:
        if not (is_missing_user_error(err) and not _has_user(messages)):
            raise
        text = _render_without_user(proc, messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
        if not tokenize:
            return text
        tok = _tokenizer_of(proc)
        if return_dict:
            # The stripped text is tokenized by the processor itself so multimodal keys stay consistent.
            return_tensors = kwargs.get("return_tensors")
            if tok is proc:
                return proc(text, add_special_tokens=False, return_tensors=return_tensors)
            return proc(text=[text], return_tensors=return_tensors)
        return list(tok.encode(text, add_special_tokens=False))
    if tokenize and not return_dict and out and isinstance(out[0], list):
        # transformers >= 5 may return a batch of one; callers want a flat id list.
        if len(out) != 1:
            raise ValueError("expected a single conversation")
        out = out[0]
    if tokenize and not return_dict and hasattr(out, "keys"):
        out = list(out["input_ids"])  # some tokenizers return a BatchEncoding even without return_dict
    return out
