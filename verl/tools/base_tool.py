"""Base class every tool implements; one instance serves many trajectories keyed by ``instance_id``."""

from __future__ import annotations

from typing import Any, Optional
from uuid import uuid4

from .schemas import OpenAIFunctionToolSchema, ToolResponse


class BaseTool:
    """Lifecycle per trajectory: ``create`` -> ``execute`` (any number of times) -> ``calc_reward`` -> ``release``.

    Subclasses may override :meth:`get_openai_tool_schema` to supply a schema when the config gives none.
    """

    def __init__(self, config: dict, tool_schema: Optional[OpenAIFunctionToolSchema] = None):
        self.config = dict(config or {})
        self.tool_schema = tool_schema if tool_schema is not None else self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError(f"{type(self).__name__} has no tool schema: pass one or override get_openai_tool_schema")
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> Optional[OpenAIFunctionToolSchema]:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        """Start per-trajectory state; returns the instance id and an optional initial response."""
        return (instance_id or uuid4().hex), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        """Run the tool; returns ``(response, step_reward, metrics)``."""
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        return None
