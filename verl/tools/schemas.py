"""OpenAI-style function-tool schemas and the tool response type, as pydantic models.

Names follow upstream verl so user tool configs and tool classes keep working unchanged.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional

from pydantic import BaseModel, Field, field_validator

__all__ = [
    "OpenAIFunctionPropertySchema",
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolSchema",
    "OpenAIFunctionParsedSchema",
    "OpenAIFunctionCallSchema",
    "OpenAIFunctionToolCall",
    "ToolResponse",
]


class OpenAIFunctionPropertySchema(BaseModel):
    """One parameter: a JSON-schema type name (or a list of them for unions), description and enum."""

    type: str | list[str]
    description: Optional[str] = None
    enum: Optional[list[Any]] = None
    # Nested schemas are kept as plain dicts: the parser only needs the top-level type.
    items: Optional[dict[str, Any]] = None


class OpenAIFunctionParametersSchema(BaseModel):
    type: str = "object"
    properties: dict[str, OpenAIFunctionPropertySchema] = Field(default_factory=dict)
    required: list[str] = Field(default_factory=list)


class OpenAIFunctionSchema(BaseModel):
    name: str
    description: str = ""
    parameters: OpenAIFunctionParametersSchema = Field(default_factory=OpenAIFunctionParametersSchema)
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    type: str = "function"
    function: OpenAIFunctionSchema


class OpenAIFunctionParsedSchema(BaseModel):
    """A call as the parser saw it: arguments still a JSON string."""

    name: str
    arguments: str


def _decode_arguments(text: str) -> Optional[dict[str, Any]]:
    """The JSON object in ``text``, or None when it is not valid JSON or not an object."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None
    return value if isinstance(value, dict) else None


class OpenAIFunctionCallSchema(BaseModel):
    """A call whose arguments are already decoded into a dict."""

    name: str
    arguments: dict[str, Any]

    @staticmethod
    def from_openai_function_parsed_schema(parsed: OpenAIFunctionParsedSchema):
        """``(call, has_decode_error)``; undecodable arguments become an empty dict and set the flag."""
        decoded = _decode_arguments(parsed.arguments)
        call = OpenAIFunctionCallSchema(name=parsed.name, arguments=decoded or {})
        return call, decoded is None


class OpenAIFunctionToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCallSchema


class ToolResponse(BaseModel):
    """What a tool hands back to the model: text and, for multimodal tools, lists of images/videos."""

    text: Optional[str] = None
    image: Optional[list[Any]] = None
    video: Optional[list[Any]] = None

    @field_validator("image", "video", mode="before")
    @classmethod
    def _must_be_list(cls, value, info):
        # A bare image is a common mistake; say how to fix it instead of failing deep in the processor.
        if value is not None and not isinstance(value, list):
            raise ValueError(f"ToolResponse.{info.field_name} must be a list (wrap a single item as [item])")
        return value

    def is_empty(self) -> bool:
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        return bool(self.text) and not self.image and not self.video
