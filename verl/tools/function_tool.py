"""Tools from plain typed Python functions (upstream's ``verl.tools.function_tool``).

::

    from verl.tools.function_tool import function_tool

    @function_tool
    def add(a: int, b: int) -> str:
        \"\"\"Add two integers.

        Args:
            a: the first addend
            b: the second addend
        \"\"\"
        return str(a + b)

Point ``actor_rollout_ref.rollout.multi_turn.function_tool_path`` (or ``data.function_tool_path``) at the file
and the tool agent loop offers ``add`` to the model. The OpenAI schema comes from the signature's type hints
and the Google-style docstring (``transformers.utils.get_json_schema``); pass ``schema=`` to give one
explicitly. A function tool is stateless: it is a :class:`BaseTool` whose ``execute`` calls the function.
It may return a string, a dict (sent as JSON), a :class:`ToolResponse`, or ``(response[, reward[, metrics]])``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import importlib.util
import inspect
import json
import logging
import os
import sys
import threading
from typing import Any, Callable, Optional, Union

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.registry import Registry

__all__ = [
    "FUNCTION_TOOL_REGISTRY",
    "FunctionTool",
    "function_tool",
    "get_function_tool",
    "load_function_tools_from_path",
    "normalize_function_tool_return",
]

logger = logging.getLogger(__name__)

FUNCTION_TOOL_REGISTRY = Registry("function tool", config_key="function tool name")
_LOADED: dict[str, list["FunctionTool"]] = {}


class FunctionTool(BaseTool):
    """A registered function as a tool: ``name``, ``fn``, ``tool_schema``; no per-trajectory state."""

    def __init__(self, fn: Callable[..., Any], tool_schema: OpenAIFunctionToolSchema, config: Optional[dict] = None):
        super().__init__(config or {}, tool_schema)
        self.fn = fn
        self.is_async = inspect.iscoroutinefunction(fn)

    async def call(self, parameters: dict[str, Any]) -> Any:
        """Run the function with the model's arguments (sync functions in a thread of their own: the event loop
        stays free, and the tool's timeout can cut off a call that blocks)."""
        if self.is_async:
            return await self.fn(**parameters)
        return await asyncio.wrap_future(run_in_daemon_thread(self.fn, parameters))

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        return normalize_function_tool_return(await self.call(parameters))


def run_in_daemon_thread(fn: Callable[..., Any], kwargs: dict[str, Any]) -> concurrent.futures.Future:
    """``fn(**kwargs)`` in a new daemon thread. Not the event loop's default executor: ``asyncio.run`` joins that
    one's threads when the rollout's loop closes, so a call that never returns (a hung request, an endless loop)
    would hold the whole batch after its timeout had already given the model an error. A daemon thread is left
    behind instead (it ends with the call, or with the process)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def target():
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(**kwargs))
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting coroutine
            future.set_exception(err)

    threading.Thread(target=target, name=f"verl-tool-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    return future


def _schema_from_function(fn: Callable, name: str) -> OpenAIFunctionToolSchema:
    variadic = [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if variadic:
        raise ValueError(f"@function_tool {name!r} ({fn.__module__}.{fn.__qualname__}) takes *args/**kwargs "
                         f"({variadic}); an OpenAI tool schema needs named, typed parameters")
    from transformers.utils import get_json_schema

    try:
        raw = get_json_schema(fn)
    except Exception as err:  # transformers raises its own parsing exceptions; name the function and the fix
        raise ValueError(f"@function_tool {name!r}: cannot build its schema ({type(err).__name__}: {err}). Give "
                         "every parameter a type hint and a Google-style docstring with an Args: entry for each, "
                         "or pass schema=...") from err
    raw["function"]["name"] = name
    return OpenAIFunctionToolSchema.model_validate(raw)


def function_tool(name: Union[str, Callable, None] = None, *,
                  schema: Union[OpenAIFunctionToolSchema, dict, None] = None):
    """Register a function as a tool: ``@function_tool``, ``@function_tool("name")`` or
    ``@function_tool(schema={...})``. Returns the function unchanged."""

    def decorate(fn: Callable, tool_name: Optional[str]) -> Callable:
        tool_name = tool_name or fn.__name__
        if schema is None:
            built = _schema_from_function(fn, tool_name)
        else:
            built = schema if isinstance(schema, OpenAIFunctionToolSchema) \
                else OpenAIFunctionToolSchema.model_validate(schema)
            if built.function.name != tool_name and name is not None:
                raise ValueError(f"@function_tool({tool_name!r}) got a schema named {built.function.name!r}")
        tool = FunctionTool(fn, built)
        current = FUNCTION_TOOL_REGISTRY.get(tool.name)
        if current is not None and current.fn is not fn:
            raise ValueError(f"function tool {tool.name!r} is already registered to "
                             f"{current.fn.__module__}.{current.fn.__qualname__}; rename one of them")
        FUNCTION_TOOL_REGISTRY[tool.name] = tool
        return fn

    if callable(name):  # bare @function_tool
        return decorate(name, None)
    return lambda fn: decorate(fn, name)


def get_function_tool(name: str) -> FunctionTool:
    return FUNCTION_TOOL_REGISTRY.get_or_raise(name)


def load_function_tools_from_path(path: str) -> list[FunctionTool]:
    """Import the Python file at ``path`` once and return the tools its ``@function_tool`` decorators registered."""
    abs_path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(abs_path):
        raise FileNotFoundError(f"function_tool_path {path!r} does not exist (looked at {abs_path})")
    if abs_path in _LOADED:
        return list(_LOADED[abs_path])
    known = set(FUNCTION_TOOL_REGISTRY)
    _import_file(abs_path, path)
    names = sorted(set(FUNCTION_TOOL_REGISTRY) - known)
    if not names:
        raise ValueError(f"function_tool_path {path!r} defines no @function_tool functions; decorate the functions "
                         "to expose, or unset function_tool_path")
    _LOADED[abs_path] = [FUNCTION_TOOL_REGISTRY[n] for n in names]
    logger.info("loaded function tools %s from %s", names, path)
    return list(_LOADED[abs_path])


def _import_file(abs_path: str, shown: str) -> None:
    """Import a file by path under a name derived from it; registered in sys.modules so that the file's
    functions can be pickled and found again, and dropped again if the import fails."""
    digest = hashlib.sha1(abs_path.encode()).hexdigest()[:16]
    name = f"verl_user_function_tools_{digest}"
    spec = importlib.util.spec_from_file_location(name, abs_path)
    if spec is None or spec.loader is None:
        raise ImportError(f"function_tool_path {shown!r} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


def _as_response(value: Any) -> ToolResponse:
    if isinstance(value, ToolResponse):
        return value
    if isinstance(value, dict):
        return ToolResponse(text=json.dumps(value, ensure_ascii=False))
    return ToolResponse(text=value if isinstance(value, str) else str(value))


def normalize_function_tool_return(ret: Any) -> tuple[ToolResponse, float, dict]:
    """A function's return value as ``(ToolResponse, reward, metrics)``; tuples are ``(response[, reward[,
    metrics]])`` with None meaning 0.0 / {}; any other tuple length is an authoring error."""
    if isinstance(ret, tuple):
        if not 1 <= len(ret) <= 3:
            raise TypeError(f"a function tool returned a tuple of length {len(ret)}; return (response,), "
                            "(response, reward) or (response, reward, metrics)")
        reward = 0.0 if len(ret) < 2 or ret[1] is None else float(ret[1])
        metrics = {} if len(ret) < 3 or ret[2] is None else dict(ret[2])
        return _as_response(ret[0]), reward, metrics
    return _as_response(ret), 0.0, {}
