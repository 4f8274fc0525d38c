"""Turn a model's response tokens into tool calls.

Parsers are chosen by ``actor_rollout_ref.rollout.multi_turn.format``:

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (JSON).
* ``qwen3_coder``: Qwen3.5 / Qwen3-Coder XML,
  ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>``; values are typed by
  the tool's JSON schema.

Model output is untrusted. Nothing here evaluates it: values are decoded with ``json.loads`` or, for Python
style object/array literals, ``ast.literal_eval`` after size and nesting checks. A malformed call yields no
call plus an error string (``ToolParseResult.errors``) that the agent loop shows the model; parsing never
raises on bad model output.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional

from pydantic import BaseModel

from verl.utils.registry import Registry

logger = logging.getLogger(__name__)

__all__ = ["FunctionCall", "ToolParseResult", "ToolParser", "HermesToolParser", "Qwen3XMLToolParser"]

# Limits on a single value / call body; large enough for real arguments, small enough to stay cheap.
MAX_CALL_CHARS = 64_000
MAX_LITERAL_CHARS = 16_000
MAX_LITERAL_DEPTH = 32


class FunctionCall(BaseModel):
    """One call: the function name and its arguments as a JSON object string."""

    arguments: str
    name: str
    tool_call_id: Optional[str] = None


@dataclass
class ToolParseResult:
    content: str
    calls: list[FunctionCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _schema_properties(tools) -> Optional[dict[str, dict[str, Any]]]:
    """``{function name: {param: property schema dict}}`` from OpenAI tool schemas (models or dicts)."""
    if tools is None:
        return None
    table: dict[str, dict[str, Any]] = {}
    for tool in tools:
        spec = tool.model_dump() if hasattr(tool, "model_dump") else dict(tool)
        fn = spec.get("function", spec)
        params = (fn.get("parameters") or {}).get("properties") or {}
        table[fn["name"]] = {k: (v if isinstance(v, dict) else dict(v)) for k, v in params.items()}
    return table


# multi_turn.format -> parser class. ``qwen3_xml`` (vLLM's name for the same XML call syntax) is an alias of
# qwen3_coder. Upstream verl's other formats (gpt-oss, glm, seed, minimax, kimi, deepseek_v4, gemma4) use
# different syntaxes and have no parser here: validation refuses them with the registered list.
TOOL_PARSER_REGISTRY = Registry(
    "tool-call parser", config_key="actor_rollout_ref.rollout.multi_turn.format", aliases={"qwen3_xml": "qwen3_coder"}
)


class ToolParser(ABC):
    """Base class and registry of tool-call parsers.

    ``stop_token_ids`` lists extra ids that must end generation so the parser can run; Qwen models end a
    tool-calling turn with EOS already, so the default is empty.
    """

    _registry = None  # bound to TOOL_PARSER_REGISTRY below (upstream code reads ToolParser._registry)
    stop_token_ids: list[int] = []

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def register(cls, name: str, *, override: bool = False):
        return TOOL_PARSER_REGISTRY.register(name, override=override)

    @classmethod
    def get_tool_parser(cls, name: str, tokenizer) -> "ToolParser":
        return TOOL_PARSER_REGISTRY.get_or_raise(name)(tokenizer)

    def decode(self, responses_ids: list[int]) -> str:
        return self.tokenizer.decode(list(responses_ids), skip_special_tokens=False)

    @abstractmethod
    def parse_text(self, text: str, tools=None) -> ToolParseResult:
        """Parse decoded text; ``tools`` (OpenAI schemas) enables name checks and value typing."""

    async def parse(self, responses_ids: list[int], tools=None) -> ToolParseResult:
        return self.parse_text(self.decode(responses_ids), tools)

    async def extract_tool_calls(self, responses_ids: list[int], tools=None) -> tuple[str, list[FunctionCall]]:
        """Upstream-compatible entry point: ``(content text, calls)``; errors are logged, not raised."""
        result = await self.parse(responses_ids, tools)
        for err in result.errors:
            logger.debug("tool call parse error: %s", err)
        return result.content, result.calls


ToolParser._registry = TOOL_PARSER_REGISTRY

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _split_tool_call_blocks(text: str) -> tuple[str, list[str], list[str]]:
    """Return (content without tool-call blocks, block bodies, errors for unclosed/stray tags)."""
    blocks = [m.group(1) for m in _TOOL_CALL_RE.finditer(text)]
    content = _TOOL_CALL_RE.sub("", text)
    errors = []
    if "<tool_call>" in content:
        errors.append("unclosed <tool_call> tag: close every call with </tool_call>")
        content = content[: content.index("<tool_call>")]
    if "</tool_call>" in content:
        errors.append("</tool_call> without a matching <tool_call>")
        content = content.replace("</tool_call>", "")
    return content.strip(), blocks, errors


def _unknown_function_error(name: str, table) -> Optional[str]:
    if table is not None and name not in table:
        return f"unknown function {name!r}; available: {sorted(table) or 'none'}"
    return None


@ToolParser.register("hermes")
class HermesToolParser(ToolParser):
    """JSON inside ``<tool_call>`` tags."""

    def parse_text(self, text: str, tools=None) -> ToolParseResult:
        table = _schema_properties(tools)
        content, blocks, errors = _split_tool_call_blocks(text)
        calls = []
        for i, body in enumerate(blocks, 1):
            if len(body) > MAX_CALL_CHARS:
                errors.append(f"tool call {i}: longer than {MAX_CALL_CHARS} characters")
                continue
            try:
                obj = json.loads(body)
            except (json.JSONDecodeError, RecursionError) as e:
                errors.append(f"tool call {i}: not valid JSON ({e.__class__.__name__})")
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                errors.append(f'tool call {i}: expected {{"name": ..., "arguments": {{...}}}}')
                continue
            args = obj.get("arguments", {})
            if isinstance(args, str):  # some models double-encode the arguments
                try:
                    args = json.loads(args)
                except (json.JSONDecodeError, RecursionError):
                    pass
            if not isinstance(args, dict):
                errors.append(f"tool call {i}: arguments must be a JSON object")
                continue
            err = _unknown_function_error(obj["name"], table)
            if err:
                errors.append(f"tool call {i}: {err}")
                continue
            calls.append(FunctionCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False)))
        return ToolParseResult(content=content, calls=calls, errors=errors)


class ValueConversionError(ValueError):
    pass


_INT_RE = re.compile(r"[+-]?\d{1,4000}")
_NUMBER_RE = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _max_bracket_depth(text: str) -> int:
    # Counts brackets even inside strings: conservative, and cheap enough to run before any parser.
    depth = best = 0
    for ch in text:
        if ch in "[{(":
            depth += 1
            best = max(best, depth)
        elif ch in "]})":
            depth -= 1
    return best


def _parse_literal(value: str, expected: type) -> Any:
    if len(value) > MAX_LITERAL_CHARS:
        raise ValueConversionError(f"value longer than {MAX_LITERAL_CHARS} characters")
    if _max_bracket_depth(value) > MAX_LITERAL_DEPTH:
        raise ValueConversionError(f"value nested deeper than {MAX_LITERAL_DEPTH} levels")
    try:
        parsed = json.loads(value)
    except (json.JSONDecodeError, RecursionError):
        try:
            # Python-style literals ({'a': 1}, True, None) are common in model output; literal_eval builds
            # only literals and never calls anything.
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as e:
            raise ValueConversionError(f"not a valid {expected.__name__} literal") from e
    if not isinstance(parsed, expected):
        raise ValueConversionError(f"expected {expected.__name__}, got {type(parsed).__name__}")
    return parsed


def convert_param_value(value: str, schema_type: Any) -> Any:
    """Convert one raw XML parameter value to the JSON-schema type; raises ``ValueConversionError``."""
    types = schema_type if isinstance(schema_type, list) else [schema_type]
    types = [str(t).lower() for t in types if t is not None]
    if not types:
        return value
    if "null" in types and value.strip().lower() in ("null", "none"):
        return None
    last_error: Optional[ValueConversionError] = None
    for t in types:
        try:
            return _convert_single(value, t)
        except ValueConversionError as e:
            last_error = e
    raise last_error or ValueConversionError(f"cannot convert to {types}")


def _convert_single(value: str, t: str) -> Any:
    v = value.strip()
    if t == "string" or t == "str":
        return value
    if t == "integer" or t == "int":
        if not _INT_RE.fullmatch(v):
            raise ValueConversionError(f"expected an integer, got {v[:40]!r}")
        return int(v)
    if t == "number" or t == "float":
        if _INT_RE.fullmatch(v):
            return int(v)
        if not _NUMBER_RE.fullmatch(v) or len(v) > 400:
            raise ValueConversionError(f"expected a number, got {v[:40]!r}")
        out = float(v)
        if not math.isfinite(out):
            raise ValueConversionError("number out of range")
        return out
    if t == "boolean" or t == "bool":
        if v.lower() in ("true", "false"):
            return v.lower() == "true"
        raise ValueConversionError(f"expected true or false, got {v[:40]!r}")
    if t == "object" or t == "dict":
        return _parse_literal(v, dict)
    if t == "array" or t == "list":
        return _parse_literal(v, list)
    if t == "null":
        raise ValueConversionError(f"expected null, got {v[:40]!r}")
    # Unknown schema type: keep the text rather than guess.
    return value


_FUNCTION_RE = re.compile(r"<function=(.*?)</function>", re.DOTALL)
_HEADER_RE = re.compile(r"[^<>\n]+")


def _strip_one_newline(value: str) -> str:
    # The Qwen3.5 template writes "<parameter=k>\nvalue\n</parameter>"; those two newlines are framing.
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _split_header(text: str) -> tuple[Optional[str], str]:
    """``"NAME>rest"`` -> (NAME, rest); (None, text) when the header is malformed (no ``>``, empty, or broken by
    a tag or a newline before the ``>``)."""
    end = text.find(">")
    if end == -1:
        return None, text
    name = text[:end].strip()
    if not name or not _HEADER_RE.fullmatch(text[:end]):
        return None, text
    return name, text[end + 1 :]


@ToolParser.register("qwen3_coder")
class Qwen3XMLToolParser(ToolParser):
    """Qwen3.5 / Qwen3-Coder XML tool calls, several per turn, values typed by the tool schema.

    Malformed input, as upstream treats it: a malformed function header (no ``>``, an empty name) yields no
    call; a malformed parameter (bad header, no ``</parameter>``, or a value that is not of its schema type) is
    skipped while the call keeps its valid parameters; with no tools list (None or empty) nothing is typed or
    name-checked. Every skip is reported in ``errors`` so the agent loop can tell the model. Where upstream
    keeps an unconvertible value as a string, this parser drops it: a schema-violating value never reaches a
    tool.
    """

    def parse_text(self, text: str, tools=None) -> ToolParseResult:
        table = _schema_properties(tools) or None  # a missing or empty tools list means no tools
        content, blocks, errors = _split_tool_call_blocks(text)
        calls: list[FunctionCall] = []
        for i, body in enumerate(blocks, 1):
            if len(body) > MAX_CALL_CHARS:
                errors.append(f"tool call {i}: longer than {MAX_CALL_CHARS} characters")
                continue
            functions = list(_FUNCTION_RE.finditer(body))
            rest = _FUNCTION_RE.sub("", body)
            if "<function=" in rest or "</function>" in rest:
                errors.append(f"tool call {i}: unclosed or stray <function=...> tag")
                continue
            if not functions:
                errors.append(f"tool call {i}: expected <function=NAME>...</function> inside <tool_call>")
                continue
            for fn in functions:
                call, errs = self._parse_function(fn.group(1), table)
                errors.extend(f"tool call {i}: {e}" for e in errs)
                if call is not None:
                    calls.append(call)
        return ToolParseResult(content=content, calls=calls, errors=errors)

    @staticmethod
    def _parse_function(text: str, table) -> tuple[Optional[FunctionCall], list[str]]:
        name, body = _split_header(text)
        if name is None:
            return None, [f"malformed function header {text[:40]!r}: expected <function=NAME>"]
        err = _unknown_function_error(name, table)
        if err:
            return None, [err]
        props = table.get(name, {}) if table is not None else {}
        args: dict[str, Any] = {}
        errors: list[str] = []
        head, *chunks = body.split("<parameter=")
        if "</parameter>" in head:
            errors.append(f"function {name!r}: </parameter> without a matching <parameter=...>")
        for chunk in chunks:
            close = chunk.find("</parameter>")
            if close == -1:
                errors.append(f"function {name!r}: parameter {chunk[:30]!r} has no </parameter>; skipped")
                continue
            if "</parameter>" in chunk[close + len("</parameter>"):]:
                errors.append(f"function {name!r}: stray </parameter> after parameter {chunk[:30]!r}")
            key, raw = _split_header(chunk[:close])
            if key is None:
                errors.append(f"function {name!r}: malformed parameter header {chunk[:30]!r}; skipped")
                continue
            raw = _strip_one_newline(raw)
            schema_type = (props.get(key) or {}).get("type")
            try:
                # Parameters the schema does not know stay strings; the tool decides what to do with them.
                args[key] = convert_param_value(raw, schema_type) if schema_type is not None else raw
            except ValueConversionError as e:
                errors.append(f"function {name!r}, parameter {key!r}: {e}; skipped")
        return FunctionCall(name=name, arguments=json.dumps(args, ensure_ascii=False)), errors
