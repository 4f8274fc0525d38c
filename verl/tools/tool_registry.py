"""Build tools from a YAML ``tool_config_path`` (upstream layout)::

    tools:
      - class_name: verl.tools.calculator_tool.CalculatorTool
        config: {type: native, timeout: 5}
        tool_schema: {type: function, function: {name: calculator, ...}}   # optional

Only ``native`` tools (``BaseTool`` subclasses) are supported; other types are rejected with a clear error.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from .schemas import OpenAIFunctionToolSchema

if TYPE_CHECKING:
    from .base_tool import BaseTool

__all__ = ["get_tool_class", "initialize_tools_from_config", "load_all_tools"]

_SUPPORTED_TYPES = ("native",)


def get_tool_class(cls_name: str) -> type:
    """Import ``package.module.ClassName``."""
    if "." not in cls_name:
        raise ValueError(f"tool class_name must be a dotted path like pkg.module.Class, got {cls_name!r}")
    module_name, class_name = cls_name.rsplit(".", 1)
    module = importlib.import_module(module_name)
    try:
        return getattr(module, class_name)
    except AttributeError as e:
        raise ValueError(f"module {module_name!r} has no tool class {class_name!r}") from e


def initialize_tools_from_config(tools_config_file) -> list["BaseTool"]:
    """Instantiate every tool declared in the YAML file; tool names must be unique."""
    cfg = OmegaConf.load(tools_config_file)
    entries = cfg.get("tools") or []
    tools = []
    for i, entry in enumerate(entries):
        if "class_name" not in entry:
            raise ValueError(f"{tools_config_file}: tools[{i}] lacks class_name")
        tool_cfg = OmegaConf.to_container(entry.get("config") or {}, resolve=True)
        tool_type = tool_cfg.get("type", "native")
        if tool_type not in _SUPPORTED_TYPES:
            raise ValueError(f"{tools_config_file}: tools[{i}] has type {tool_type!r}; supported: {_SUPPORTED_TYPES}")
        schema = None
        if entry.get("tool_schema") is not None:
            schema = OpenAIFunctionToolSchema.model_validate(OmegaConf.to_container(entry.tool_schema, resolve=True))
        tools.append(get_tool_class(entry.class_name)(config=tool_cfg, tool_schema=schema))
    names = [t.name for t in tools]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{tools_config_file}: duplicate tool names {dupes}")
    return tools


def load_all_tools(tool_config_path=None, function_tool_path=None) -> list["BaseTool"]:
    """Tools from the YAML (``tool_config_path``) and from ``@function_tool`` functions (``function_tool_path``);
    a name defined in both is an error."""
    from .function_tool import load_function_tools_from_path

    tools = initialize_tools_from_config(tool_config_path) if tool_config_path else []
    functions = load_function_tools_from_path(function_tool_path) if function_tool_path else []
    clash = sorted({t.name for t in tools} & {t.name for t in functions})
    if clash:
        raise ValueError(f"tool name(s) {clash} are defined both in tool_config_path ({tool_config_path}) and in "
                         f"function_tool_path ({function_tool_path}); rename one")
    return tools + functions
