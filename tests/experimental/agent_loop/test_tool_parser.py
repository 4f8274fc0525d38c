import asyncio
import json

import pytest

from verl.experimental.agent_loop.tool_parser import (
    HermesToolParser,
    Qwen3XMLToolParser,
    ToolParser,
    convert_param_value,
    ValueConversionError,
)
from verl.models.tiny import build_tiny_tokenizer
from verl.tools.schemas import OpenAIFunctionToolSchema

_TYPED_PROPS = {name: {"type": typ} for name, typ in [
    ("s", "string"), ("i", "integer"), ("n", "number"), ("b", "boolean"), ("o", "object"), ("a", "array"),
    ("u", ["integer", "null"]),
]}
TOOLS = [
    OpenAIFunctionToolSchema.model_validate(
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": _TYPED_PROPS}}}
    ),
    {"type": "function",
     "function": {"name": "calculator", "parameters": {"properties": {"expression": {"type": "string"}}}}},
]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


CALC = "<tool_call><function=calculator><parameter=expression>"


def xml(name, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def parse(tok, text, tools=TOOLS, fmt="qwen3_coder"):
    parser = ToolParser.get_tool_parser(fmt, tok)
    ids = tok.encode(text, add_special_tokens=False)
    return asyncio.run(parser.parse(ids, tools))


def test_registry(tok):
    assert isinstance(ToolParser.get_tool_parser("qwen3_coder", tok), Qwen3XMLToolParser)
    assert isinstance(ToolParser.get_tool_parser("hermes", tok), HermesToolParser)
    with pytest.raises(ValueError, match="not a registered tool-call parser"):
        ToolParser.get_tool_parser("nope", tok)


def test_schema_typing_every_type(tok):
    text = "Let me call. " + xml("f", s=" 12 ", i="-7", n="2.5e1", b="True", o='{"k": [1, 2]}', a="[1, 'x']", u="null")
    r = parse(tok, text)
    assert r.errors == []
    assert r.content == "Let me call."
    (call,) = r.calls
    assert call.name == "f"
    assert json.loads(call.arguments) == {
        "s": " 12 ", "i": -7, "n": 25.0, "b": True, "o": {"k": [1, 2]}, "a": [1, "x"], "u": None
    }


def test_number_int_and_python_literal_object(tok):
    r = parse(tok, xml("f", n="3", o="{'a': True, 'b': None}"))
    assert json.loads(r.calls[0].arguments) == {"n": 3, "o": {"a": True, "b": None}}


def test_multiple_calls_per_turn(tok):
    text = xml("calculator", expression="1+1") + "\n" + xml("calculator", expression="2*3")
    r = parse(tok, text)
    assert [json.loads(c.arguments)["expression"] for c in r.calls] == ["1+1", "2*3"]
    # Two functions inside one <tool_call> are also accepted.
    two = "<tool_call><function=calculator><parameter=expression>1</parameter></function>" \
          "<function=calculator><parameter=expression>2</parameter></function></tool_call>"
    assert len(parse(tok, two).calls) == 2


@pytest.mark.parametrize(
    "text, fragment",
    [
        (CALC + "1+1</parameter></function>", "unclosed <tool_call>"),
        (CALC + "1</parameter></tool_call>", "unclosed or stray <function"),
        ("<tool_call>just text</tool_call>", "expected <function=NAME>"),
        (xml("rm_rf", path="/"), "unknown function 'rm_rf'"),
        ("<tool_call><function=calculator<parameter=expression>1</parameter></function></tool_call>",
         "malformed function header"),
        ("<tool_call><function=>x</function></tool_call>", "malformed function header"),
        ("<tool_call><function=calculator</function></tool_call>", "malformed function header"),
        ("stray </tool_call>", "without a matching"),
    ],
    ids=lambda v: v[:30] if isinstance(v, str) else None,
)
def test_malformed_calls_yield_errors_not_calls(tok, text, fragment):
    r = parse(tok, text)
    assert r.calls == []
    assert any(fragment in e for e in r.errors), r.errors


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ({"i": "3.5"}, "expected an integer"),
        ({"i": "__import__('os').system('echo pwned')"}, "expected an integer"),
        ({"n": "nan"}, "expected a number"),
        ({"n": "1e999"}, "out of range"),
        ({"b": "yes"}, "expected true or false"),
        ({"o": "[1, 2]"}, "expected dict"),
        ({"o": "__import__('os').system('echo pwned')"}, "not a valid dict literal"),
        ({"a": "(lambda: 1)()"}, "not a valid list literal"),
        ({"a": "[" * 200 + "]" * 200}, "nested deeper"),
        ({"a": "[" + "1," * 20000 + "1]"}, "longer than"),
    ],
    ids=lambda v: str(v)[:30],
)
def test_a_malformed_parameter_is_skipped_and_valid_ones_survive(tok, bad, fragment):
    r = parse(tok, xml("f", s="kept", **bad))
    (call,) = r.calls
    assert json.loads(call.arguments) == {"s": "kept"}
    assert any(fragment in e for e in r.errors), r.errors


@pytest.mark.parametrize("body, fragment", [
    ("<parameter=expression>1+1", "has no </parameter>"),
    ("<parameter=expression 1+1</parameter>", "malformed parameter header"),
    ("<parameter=>1</parameter>", "malformed parameter header"),
])
def test_malformed_parameter_headers_are_skipped(tok, body, fragment):
    text = f"<tool_call><function=f><parameter=i>4</parameter>{body}</function></tool_call>"
    r = parse(tok, text)
    (call,) = r.calls
    assert json.loads(call.arguments) == {"i": 4}
    assert any(fragment in e for e in r.errors), r.errors


def test_missing_or_empty_tools_list_means_no_tools(tok):
    for tools in (None, []):
        r = parse(tok, xml("anything", i="3"), tools=tools)
        assert r.errors == [] and r.calls[0].name == "anything"
        assert json.loads(r.calls[0].arguments) == {"i": "3"}  # nothing to type against


def test_dangerous_string_stays_string(tok, tmp_path):
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    r = parse(tok, xml("f", s=payload))
    assert json.loads(r.calls[0].arguments) == {"s": payload}
    assert not marker.exists()


def test_bad_call_does_not_drop_good_call(tok):
    r = parse(tok, xml("nope", x="1") + xml("calculator", expression="3"))
    assert [c.name for c in r.calls] == ["calculator"] and len(r.errors) == 1


def test_without_tools_values_stay_strings_and_names_unchecked(tok):
    r = parse(tok, xml("anything", i="3"), tools=None)
    assert r.calls[0].name == "anything" and json.loads(r.calls[0].arguments) == {"i": "3"}


def test_no_tool_call_is_plain_content(tok):
    r = parse(tok, "The answer is 4.")
    assert r.calls == [] and r.errors == [] and r.content == "The answer is 4."


def test_union_and_convert_helper():
    assert convert_param_value("5", ["integer", "null"]) == 5
    assert convert_param_value("None", ["integer", "null"]) is None
    assert convert_param_value("abc", ["integer", "string"]) == "abc"
    with pytest.raises(ValueConversionError):
        convert_param_value("abc", ["integer", "boolean"])
    assert convert_param_value("kept", "custom_type") == "kept"


def test_hermes(tok):
    good = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
    r = parse(tok, "hi " + good, fmt="hermes")
    assert r.content == "hi" and json.loads(r.calls[0].arguments) == {"expression": "2+2"}
    for bad, frag in [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ('<tool_call>{"name": "zzz", "arguments": {}}</tool_call>', "unknown function"),
        ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "JSON object"),
        ('<tool_call>' + "[" * 5000 + "]" * 5000 + '</tool_call>', ""),
        ('<tool_call>{"name": "calculator"', "unclosed"),
    ]:
        r = parse(tok, bad, fmt="hermes")
        assert r.calls == [] and r.errors and frag in " ".join(r.errors)


def test_extract_tool_calls_upstream_signature(tok):
    parser = ToolParser.get_tool_parser("qwen3_coder", tok)
    ids = tok.encode("x" + xml("calculator", expression="1"), add_special_tokens=False)
    content, calls = asyncio.run(parser.extract_tool_calls(ids, TOOLS))
    assert content == "x" and calls[0].name == "calculator"
