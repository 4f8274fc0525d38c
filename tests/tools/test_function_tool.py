"""@function_tool: a typed Python function becomes a tool with its OpenAI schema, loaded from a file and run
by the tool agent loop."""

import asyncio
import json
import textwrap

import pytest

from tests.experimental.agent_loop.test_tool_agent_loop import ScriptedEngine, make_config, rows, segments
from verl.experimental.agent_loop import AgentLoopManager
from verl.models.tiny import build_tiny_tokenizer
from verl.tools import ToolResponse
from verl.tools.function_tool import (
    FUNCTION_TOOL_REGISTRY,
    FunctionTool,
    function_tool,
    get_function_tool,
    load_function_tools_from_path,
    normalize_function_tool_return,
)

TOOL_FILE = textwrap.dedent('''
    from typing import Optional

    from verl.tools.function_tool import function_tool


    @function_tool
    def multiply_ft(a: int, b: int, note: Optional[str] = None) -> str:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
            note: an optional remark
        """
        return str(a * b)


    @function_tool("lookup_ft")
    async def lookup(key: str) -> dict:
        """Look a key up.

        Args:
            key: what to look up
        """
        return {"key": key, "found": True}
''')


@pytest.fixture(scope="module")
def tool_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "my_tools.py"
    path.write_text(TOOL_FILE)
    return str(path)


def test_schema_from_type_hints_and_docstring(tool_file):
    tools = {t.name: t for t in load_function_tools_from_path(tool_file)}
    assert set(tools) == {"multiply_ft", "lookup_ft"}
    fn = tools["multiply_ft"].tool_schema.function
    assert fn.description == "Multiply two integers."
    assert fn.parameters.properties["a"].type == "integer" and fn.parameters.properties["a"].description == "the first factor"
    assert fn.parameters.required == ["a", "b"]
    assert load_function_tools_from_path(tool_file) == list(tools.values())  # loaded once
    assert get_function_tool("lookup_ft") is tools["lookup_ft"]


def test_calls_sync_and_async_functions(tool_file):
    tools = {t.name: t for t in load_function_tools_from_path(tool_file)}
    resp, reward, metrics = asyncio.run(tools["multiply_ft"].execute("x", {"a": 6, "b": 7}))
    assert resp.text == "42" and reward == 0.0 and metrics == {}
    resp, _, _ = asyncio.run(tools["lookup_ft"].execute("x", {"key": "k"}))
    assert json.loads(resp.text) == {"key": "k", "found": True}


def test_decorator_errors_name_the_fix():
    with pytest.raises(ValueError, match="type hint"):
        @function_tool
        def untyped_ft(x):
            """No args section."""

    with pytest.raises(ValueError, match=r"\*args/\*\*kwargs"):
        @function_tool
        def variadic_ft(*xs: int) -> str:
            """Sum.

            Args:
                xs: numbers
            """

    @function_tool(schema={"type": "function", "function": {"name": "explicit_ft", "description": "d",
                                                            "parameters": {"properties": {}}}})
    def explicit_ft():
        return "ok"

    assert isinstance(FUNCTION_TOOL_REGISTRY["explicit_ft"], FunctionTool)
    with pytest.raises(ValueError, match="already registered"):
        function_tool(schema={"type": "function", "function": {"name": "explicit_ft"}})(lambda: None)


def test_return_values_are_normalised():
    assert normalize_function_tool_return("hi")[0].text == "hi"
    assert normalize_function_tool_return(("r", None, None)) == (ToolResponse(text="r"), 0.0, {})
    assert normalize_function_tool_return(("r", 0, {"m": 1}))[1:] == (0.0, {"m": 1})
    with pytest.raises(TypeError, match="length 4"):
        normalize_function_tool_return((1, 2, 3, 4))


def test_bad_paths_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="function_tool_path"):
        load_function_tools_from_path(str(tmp_path / "missing.py"))
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(ValueError, match="defines no @function_tool"):
        load_function_tools_from_path(str(empty))


def test_agent_loop_loads_them_from_the_config_and_runs_them(tool_file):
    tok = build_tiny_tokenizer()
    cfg = make_config(function_tool_path=tool_file, tool_config_path=None)
    call = "<tool_call><function=multiply_ft><parameter=a>6</parameter><parameter=b>7</parameter></function></tool_call>"
    mgr = AgentLoopManager(cfg, ScriptedEngine(tok, {"Q": [call, "It is 42."]}), tok)
    assert sorted(t.name for t in mgr.tools) == ["lookup_ft", "multiply_ft"]
    (out,), _ = mgr.run_rows(rows("Q"), mgr.sampling_params())
    _, inserted = segments(tok, out)
    assert "<tool_response>\n42\n</tool_response>" in inserted
    assert out.metrics["num_tool_calls"] == 1 and out.metrics["tool_call_failures"] == 0


def _run_multiply(mgr, tok):
    call = ("<tool_call><function=multiply_ft><parameter=a>6</parameter><parameter=b>7</parameter></function>"
            "</tool_call>")
    mgr.engine = ScriptedEngine(tok, {"Q": [call, "It is 42."]})
    (out,), _ = mgr.run_rows(rows("Q"), mgr.sampling_params())
    return segments(tok, out)[1]


def test_agent_loop_falls_back_to_data_function_tool_path(tool_file):
    """Upstream's key is data.function_tool_path; with the multi_turn key unset the agent loop reads it."""
    tok = build_tiny_tokenizer()
    cfg = make_config(function_tool_path=None, tool_config_path=None)
    cfg.data = {"function_tool_path": tool_file}
    mgr = AgentLoopManager(cfg, ScriptedEngine(tok, {}), tok)
    assert sorted(t.name for t in mgr.tools) == ["lookup_ft", "multiply_ft"]
    assert "<tool_response>\n42\n</tool_response>" in _run_multiply(mgr, tok)
    # Without either key there are no tools: the tools above really came from data.function_tool_path.
    cfg.data = {"function_tool_path": None}
    assert AgentLoopManager(cfg, ScriptedEngine(tok, {}), tok).tools == []


def test_data_function_tool_path_through_the_composed_config(tool_file):
    """As a user writes it on the command line: the composed, validated trainer config carries the data key
    (the multi_turn key stays null) and the agent loop built from that config loads the file's tools."""
    from verl.trainer.config.checks import compose_config

    cfg = compose_config("ppo_trainer", ["actor_rollout_ref.rollout.name=hf", "algorithm.adv_estimator=grpo",
                                         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
                                         "actor_rollout_ref.rollout.n=2",
                                         "actor_rollout_ref.rollout.multi_turn.enable=true",
                                         "actor_rollout_ref.rollout.multi_turn.format=qwen3_coder",
                                         f"data.function_tool_path={tool_file}"])
    assert cfg.data.function_tool_path == tool_file
    assert cfg.actor_rollout_ref.rollout.multi_turn.function_tool_path is None
    tok = build_tiny_tokenizer()
    mgr = AgentLoopManager(cfg, ScriptedEngine(tok, {}), tok)
    assert sorted(t.name for t in mgr.tools) == ["lookup_ft", "multiply_ft"]
