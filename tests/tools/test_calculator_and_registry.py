import asyncio
import textwrap

import pytest

from verl.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse, initialize_tools_from_config
from verl.tools.calculator_tool import CalculatorError, CalculatorTool, evaluate_expression
from verl.tools.schemas import OpenAIFunctionCallSchema, OpenAIFunctionParsedSchema


@pytest.mark.parametrize(
    "expr, value",
    [("1+2*3", 7), ("(1+2)*3", 9), ("-3**2", -9), ("7//2", 3), ("7%4", 3), ("2**10", 1024), ("1/4", 0.25),
     ("-(-2)", 2)],
)
def test_arithmetic(expr, value):
    assert evaluate_expression(expr) == value


@pytest.mark.parametrize(
    "expr, msg",
    [
        ("__import__('os').system('echo hi')", "unsupported syntax"),
        ("open('/etc/passwd')", "unsupported syntax"),
        ("x + 1", "unsupported syntax"),
        ("'a' * 3", "unsupported literal"),
        ("True + 1", "unsupported literal"),
        ("9**9**9", "exponent larger"),
        ("10**30 * 10**30", "too large"),
        ("1/0", "division by zero"),
        ("1 +", "invalid expression"),
        ("1" + "+1" * 150, "longer than"),
        ("", "empty"),
        ("[1, 2]", "unsupported syntax"),
    ],
)
def test_rejects_unsafe_or_bad(expr, msg):
    with pytest.raises(CalculatorError, match=msg):
        evaluate_expression(expr)


def test_calculator_tool_lifecycle_and_reward():
    tool = CalculatorTool(config={})
    assert tool.name == "calculator"

    async def go():
        inst, _ = await tool.create(ground_truth="72")
        resp, _, _ = await tool.execute(inst, {"expression": "8*9"})
        bad, _, m = await tool.execute(inst, {"expression": "import os"})
        missing, _, _ = await tool.execute(inst, {})
        reward = await tool.calc_reward(inst)
        await tool.release(inst)
        return resp, bad, m, missing, reward

    resp, bad, m, missing, reward = asyncio.run(go())
    assert resp.text == "72" and reward == 1.0
    assert bad.text.startswith("Error:") and m["error"] == 1
    assert "missing required parameter" in missing.text


def test_registry_from_yaml(tmp_path):
    cfg = tmp_path / "tools.yaml"
    cfg.write_text(textwrap.dedent("""
        tools:
          - class_name: verl.tools.calculator_tool.CalculatorTool
            config: {type: native, timeout: 5}
    """))
    (tool,) = initialize_tools_from_config(cfg)
    assert isinstance(tool, CalculatorTool) and tool.config["timeout"] == 5
    cfg.write_text("tools:\n  - class_name: verl.tools.calculator_tool.CalculatorTool\n    config: {type: mcp}\n")
    with pytest.raises(ValueError, match="type 'mcp'"):
        initialize_tools_from_config(cfg)
    cfg.write_text("tools:\n  - class_name: verl.tools.calculator_tool.Nope\n    config: {type: native}\n")
    with pytest.raises(ValueError, match="no tool class"):
        initialize_tools_from_config(cfg)


def test_shipped_example_config_loads():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    path = root / "examples/sglang_multiturn/config/tool_config/calculator_tool_config.yaml"
    (tool,) = initialize_tools_from_config(path)
    assert tool.name == "calculator"
    assert tool.tool_schema.function.parameters.properties["expression"].type == "string"


def test_schemas():
    parsed = OpenAIFunctionParsedSchema(name="f", arguments='{"a": 1}')
    call, err = OpenAIFunctionCallSchema.from_openai_function_parsed_schema(parsed)
    assert call.arguments == {"a": 1} and not err
    bad = OpenAIFunctionParsedSchema(name="f", arguments="[1]")
    _, err = OpenAIFunctionCallSchema.from_openai_function_parsed_schema(bad)
    assert err
    with pytest.raises(ValueError, match="must be a list"):
        ToolResponse(image="not-a-list")
    assert ToolResponse().is_empty() and ToolResponse(text="x").is_text_only()
    with pytest.raises(ValueError, match="no tool schema"):
        BaseTool(config={}, tool_schema=None)
    schema = OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {"name": "g"}})
    assert BaseTool({}, schema).get_openai_tool_schema().function.name == "g"
