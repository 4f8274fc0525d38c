"""Tools callable from multi-turn rollouts: schemas, the ``BaseTool`` interface, the YAML registry."""

from .base_tool import BaseTool
from .schemas import OpenAIFunctionToolSchema, ToolResponse
from .tool_registry import initialize_tools_from_config

__all__ = ["BaseTool", "OpenAIFunctionToolSchema", "ToolResponse", "initialize_tools_from_config"]
