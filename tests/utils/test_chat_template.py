import pytest
from jinja2.exceptions import TemplateError

from verl.models.tiny import build_tiny_tokenizer
from verl.utils.chat_template import apply_chat_template, is_missing_user_error


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def test_normal_conversation_matches_tokenizer(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert apply_chat_template(tok, msgs, tokenize=False) == tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )
    ids = apply_chat_template(tok, msgs)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert ids == tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)


def test_template_itself_rejects_no_user(tok):
    with pytest.raises(TemplateError, match="No user query"):
        tok.apply_chat_template([{"role": "system", "content": "S"}], tokenize=False)


def test_system_only_renders_without_placeholder(tok):
    text = apply_chat_template(tok, [{"role": "system", "content": "Be brief."}], tokenize=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n"
    assert "PLACEHOLDER" not in text and "user" not in text


def test_assistant_first_renders_without_placeholder(tok):
    msgs = [{"role": "assistant", "content": "Hello"}]
    text = apply_chat_template(tok, msgs, tokenize=False, add_generation_prompt=False)
    assert text == "<|im_start|>assistant\nHello<|im_end|>\n"
    ids = apply_chat_template(tok, msgs, tokenize=True, add_generation_prompt=False)
    assert tok.decode(ids) == text


def test_tool_only_fragment_with_tools_keeps_system_block(tok):
    tools = [{"type": "function", "function": {"name": "calc"}}]
    text = apply_chat_template(tok, [{"role": "tool", "content": "4"}], tools=tools, tokenize=False)
    assert text.startswith("<|im_start|>system\n\n# Tools")
    assert text.endswith("<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert "PLACEHOLDER" not in text


def test_other_template_errors_propagate(tok):
    # A misplaced system message is a different template error: it must not be papered over.
    with pytest.raises(TemplateError, match="System message must be at the beginning"):
        apply_chat_template(tok, [{"role": "assistant", "content": "a"}, {"role": "system", "content": "s"}])
    with pytest.raises(TemplateError, match="Unknown message role"):
        apply_chat_template(tok, [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])


def test_missing_user_error_only_when_really_no_user():
    bad = build_tiny_tokenizer(chat_template="{{ raise_exception('No user query found in messages.') }}")
    # The template lies: a user message exists, so the fallback must not kick in.
    with pytest.raises(TemplateError):
        apply_chat_template(bad, [{"role": "user", "content": "x"}])
    assert is_missing_user_error(TemplateError("No user query found in messages."))
    assert not is_missing_user_error(TemplateError("something else"))
    assert not is_missing_user_error(ValueError("No user query found"))


def test_thinking_rendering(tok):
    text = apply_chat_template(tok, [{"role": "user", "content": "q"}], tokenize=False, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "A", "reasoning_content": "R"}]
    assert "<think>\nR\n</think>\n\nA<|im_end|>" in apply_chat_template(tok, msgs, tokenize=False)
