"""MultiTurnSFTDataset: the loss mask covers exactly the assistant turns (content, reasoning, tool calls and
the end-of-turn token), for system prompts, tools, tool results, thinking on and off, and multi-image VL rows;
bad rows fail with an error that names the row."""

import json

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from verl.models.tiny import build_tiny_tokenizer, default_chat_template
from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset, SFTRowError, sft_collate_fn

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"a": "int", "b": "int"}}}]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _write(tmp_path, rows, name="d.parquet"):
    path = tmp_path / name
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


def _ds(tok, path, **cfg):
    return MultiTurnSFTDataset(path, tok, OmegaConf.create({"max_length": 512, **cfg}))


def _spans(tok, ids, mask):
    """Texts of the contiguous runs of trained tokens."""
    spans, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    if cur:
        spans.append(tok.decode(cur))
    return spans


def _untrained(tok, ids, mask):
    return tok.decode([t for t, m in zip(ids.tolist(), mask.tolist()) if not m])


def tool_conversation(thinking: bool):
    call = {"type": "function", "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})}}
    first = {"role": "assistant", "content": "", "tool_calls": [call]}
    if thinking:
        first["reasoning_content"] = "I should add."
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
        first,
        {"role": "tool", "content": "5"},
        {"role": "tool", "content": "checked"},
        {"role": "assistant", "content": "It is 5."},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "Bye."},
    ]


@pytest.mark.parametrize("thinking", [True, False])
def test_mask_covers_exactly_assistant_turns_with_system_tools_and_tool_results(tmp_path, tok, thinking):
    messages = tool_conversation(thinking)
    ds = _ds(tok, _write(tmp_path, [{"messages": messages, "tools": json.dumps(TOOLS), "enable_thinking": thinking}]))
    item = ds[0]
    ids, mask = item["input_ids"], item["loss_mask"]
    # The ids are the whole conversation as the chat template renders it.
    parsed = json.loads(json.dumps(messages))
    parsed[2]["tool_calls"][0]["function"]["arguments"] = {"a": 2, "b": 3}
    whole = tok.apply_chat_template(parsed, tools=TOOLS, tokenize=False, enable_thinking=thinking)
    assert tok.decode(ids.tolist()) == whole
    call = "<tool_call><function=add><parameter=a>2</parameter><parameter=b>3</parameter></function></tool_call>"
    think = "<think>\nI should add.\n</think>\n\n" if thinking else ""
    assert _spans(tok, ids, mask) == [think + call + "<|im_end|>", "It is 5.<|im_end|>", "Bye.<|im_end|>"]
    rest = _untrained(tok, ids, mask)
    for text in ("Be brief.", "2+3?", "<tool_response>\n5\n</tool_response>", "checked", "Thanks", '"name": "add"'):
        assert text in rest
    assert item["attention_mask"].all() and torch.equal(item["position_ids"], torch.arange(len(ids)))


def test_enable_thinking_per_row_and_default_reach_the_template(tmp_path, tok):
    # A Qwen3-style template: with thinking off, an assistant turn opens with an empty think block, which the
    # generation prompt produces as well - so it is prompt, not target.
    template = default_chat_template().replace(
        "{{- '<|im_start|>assistant\\n' -}}\n    {%- if m.reasoning_content",
        "{{- '<|im_start|>assistant\\n' -}}\n    {%- if enable_thinking is defined and enable_thinking is false -%}"
        "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}\n    {%- if m.reasoning_content")
    assert template != default_chat_template()
    t = build_tiny_tokenizer(chat_template=template)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    rows = [{"messages": msgs, "enable_thinking": False}, {"messages": msgs, "enable_thinking": None}]
    path = _write(tmp_path, rows)
    for default, second_has_block in ((None, False), (False, True)):
        ds = _ds(t, path, enable_thinking_default=default)
        texts = [t.decode(ds[i]["input_ids"].tolist()) for i in range(2)]
        assert "<think>\n\n</think>" in texts[0]
        assert ("<think>\n\n</think>" in texts[1]) == second_has_block
        for i in range(2):
            assert _spans(t, ds[i]["input_ids"], ds[i]["loss_mask"]) == ["hello<|im_end|>"]


def test_padding_modes_and_collate(tmp_path, tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    longer = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello you"}]
    path = _write(tmp_path, [{"messages": msgs}, {"messages": longer}])
    right = _ds(tok, path, pad_mode="right", max_length=64)
    item = right[0]
    n = int(item["attention_mask"].sum())
    assert item["input_ids"].shape == (64,) and (item["input_ids"][n:] == tok.pad_token_id).all()
    assert not item["loss_mask"][n:].any()
    packed = _ds(tok, path, pad_mode="no_padding")
    rows = [packed[0], packed[1]]
    batch = sft_collate_fn(rows, pad_token_id=tok.pad_token_id)
    assert batch["input_ids"].shape == (2, len(rows[1]["input_ids"]))
    assert torch.equal(batch["loss_mask"][0, :n], rows[0]["loss_mask"]) and not batch["loss_mask"][0, n:].any()
    assert torch.equal(batch["input_ids"][0, :n], item["input_ids"][:n])


def test_truncation(tmp_path, tok):
    msgs = [{"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "yes"}]
    path = _write(tmp_path, [{"messages": msgs}])
    with pytest.raises(SFTRowError, match=r"row 0 .*longer than data.max_length=30"):
        _ds(tok, path, max_length=30)[0]
    left = _ds(tok, path, max_length=30, truncation="left")[0]
    assert len(left["input_ids"]) == 30 and _spans(tok, left["input_ids"], left["loss_mask"]) == ["yes<|im_end|>"]
    with pytest.raises(SFTRowError, match="no assistant token is left"):
        _ds(tok, path, max_length=30, truncation="right")[0]


def _bad(tmp_path, tok, row, match, **cfg):
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    path = _write(tmp_path, [good, row], name="bad.parquet")
    with pytest.raises(SFTRowError, match=match) as err:
        ds = _ds(tok, path, **cfg)
        ds[1]
    assert "row 1" in str(err.value)


def test_bad_rows_name_the_row_and_the_problem(tmp_path, tok):
    u = {"role": "user", "content": "a"}
    a = {"role": "assistant", "content": "b"}
    _bad(tmp_path, tok, {"messages": None}, "no messages under data.messages_key='messages'")
    _bad(tmp_path, tok, {"messages": [u, {"role": "robot", "content": "x"}, a]}, "message 1 has role 'robot'")
    _bad(tmp_path, tok, {"messages": [u, {"role": "user", "content": "c"}]}, "no assistant turn")
    _bad(tmp_path, tok, {"messages": [u, a, {"role": "system", "content": "late"}]}, "only the first message")
    bad_call = {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": "{a: 1"}}]}
    _bad(tmp_path, tok, {"messages": [u, bad_call]}, r"tool call 0 \(add\) has arguments that are not valid JSON")
    _bad(tmp_path, tok, {"messages": [u, a], "tools": "[not json"}, "'tools' is a string but not valid JSON")
    _bad(tmp_path, tok, {"messages": [{"role": "user", "content": "<image> and <image>"}, a],
                         "images": [{"path": "/nonexistent.png"}]}, "more <image> placeholders")
    _bad(tmp_path, tok, {"messages": [u, a], "enable_thinking": "yes"}, "must be true, false or null")


def test_mismatch_between_turn_by_turn_and_whole_is_reported_or_accepted(tmp_path, tok):
    # A template that drops the reasoning of assistant turns before the last user turn (as Qwen3's does): the
    # turn-by-turn rendering keeps it, the whole-conversation rendering does not.
    template = default_chat_template().replace(
        "{%- if m.reasoning_content is defined and m.reasoning_content -%}",
        "{%- if m.reasoning_content is defined and m.reasoning_content and loop.index0 > ns.last_user -%}").replace(
        "{%- set ns = namespace(has_user=false) -%}",
        "{%- set ns = namespace(has_user=false, last_user=-1) -%}").replace(
        "{%- if m.role == 'user' -%}{%- set ns.has_user = true -%}{%- endif -%}",
        "{%- if m.role == 'user' -%}{%- set ns.has_user = true -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}")
    t = build_tiny_tokenizer(chat_template=template)
    msgs = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2", "reasoning_content": "r2"}]
    path = _write(tmp_path, [{"messages": msgs}])
    with pytest.raises(SFTRowError, match=r"row 0 .*renders it differently as a whole.*ignore_input_ids_mismatch"):
        _ds(t, path)[0]
    item = _ds(t, path, ignore_input_ids_mismatch=True)[0]
    assert _spans(t, item["input_ids"], item["loss_mask"]) == ["<think>\nr1\n</think>\n\na1<|im_end|>",
                                                               "<think>\nr2\n</think>\n\na2<|im_end|>"]


def test_assistant_first_and_system_only_prefix(tmp_path, tok):
    # Qwen3.5's template needs a user turn; rows without one still render (the chat helper's placeholder).
    msgs = [{"role": "system", "content": "S"}, {"role": "assistant", "content": "hi"}]
    item = _ds(tok, _write(tmp_path, [{"messages": msgs}]))[0]
    assert _spans(tok, item["input_ids"], item["loss_mask"]) == ["hi<|im_end|>"]
    assert "S" in _untrained(tok, item["input_ids"], item["loss_mask"])


# ---------------------------------------------------------------------------------------------- VL


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    from verl.models.qwen3_5.tiny import build_tiny_qwen3_5
    from verl.utils.tokenizer import load_tokenizer_and_processor

    root = tmp_path_factory.mktemp("sftvl")
    build_tiny_qwen3_5(root / "model", kind="vl", seed=0)
    tok, proc = load_tokenizer_and_processor(OmegaConf.create({"path": str(root / "model")}))
    return root, tok, proc


def _png(path, size, color):
    from PIL import Image

    Image.new("RGB", size, color=color).save(path)
    return {"path": str(path)}


def test_multi_image_row_masks_only_assistant_and_gets_mrope_positions(vl):
    root, tok, proc = vl
    images = [_png(root / "a.png", (16, 16), (255, 0, 0)), _png(root / "b.png", (32, 16), (0, 255, 0))]
    inline = _png(root / "c.png", (16, 32), (0, 0, 255))
    rows = [
        {"messages": [{"role": "user", "content": "<image> vs <image>?"}, {"role": "assistant", "content": "red"},
                      {"role": "user", "content": [{"type": "text", "text": "and "}, {"type": "image", "image": inline}]},
                      {"role": "assistant", "content": "blue"}], "images": images},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "images": None},
    ]
    path = str(root / "vl.jsonl")  # mixed string / part-list contents: a json lines file
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    ds = MultiTurnSFTDataset(path, tok, OmegaConf.create({"max_length": 256}), processor=proc)
    item = ds[0]
    ids, mask = item["input_ids"], item["loss_mask"]
    assert _spans(tok, ids, mask) == ["red<|im_end|>", "blue<|im_end|>"]
    mm = item["multi_modal_inputs"]
    grid = mm["image_grid_thw"]
    assert grid.shape == (3, 3)
    pad_id = tok.convert_tokens_to_ids("<|image_pad|>")
    assert int((ids == pad_id).sum()) == int(grid.prod(-1).sum()) // 4  # merge 2x2
    assert not mask[ids == pad_id].any()
    assert item["position_ids"].shape == (4, len(ids))
    # The processor on the whole conversation at once gives the same ids and vision inputs.
    from verl.utils.dataset.vision_utils import process_image

    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " vs "}, {"type": "image"},
                                         {"type": "text", "text": "?"}]}, {"role": "assistant", "content": "red"},
            {"role": "user", "content": [{"type": "text", "text": "and "}, {"type": "image"}]},
            {"role": "assistant", "content": "blue"}]
    text = proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    whole = proc(text=[text], images=[process_image(x) for x in images + [inline]], return_tensors="pt")
    assert whole["input_ids"][0].tolist() == ids.tolist()
    assert torch.equal(whole["pixel_values"], mm["pixel_values"])
    text_item = ds[1]
    assert text_item["position_ids"].shape == (4, len(text_item["input_ids"])) and text_item["multi_modal_inputs"] == {}
    batch = sft_collate_fn([item, text_item], pad_token_id=tok.pad_token_id)
    assert batch["position_ids"].shape == (2, 4, len(ids)) and len(batch["multi_modal_inputs"]) == 2
