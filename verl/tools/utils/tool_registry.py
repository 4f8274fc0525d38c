"""Older verl releases kept the registry under ``verl.tools.utils``; keep that import path working."""

from verl.tools.tool_registry import get_tool_class, initialize_tools_from_config

__all__ = ["get_tool_class", "initialize_tools_from_config"]
