"""A calculator tool: evaluates arithmetic by walking a Python ``ast`` (never ``eval``).

Allowed: int/float literals, + - * / // % **, unary +/-, parentheses. Exponents and intermediate magnitudes
are bounded so a model cannot stall the rollout with ``9**9**9``. It also records the last answer so a
trajectory's reward can check it against ``ground_truth`` passed through ``tools_kwargs``.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Optional
from uuid import uuid4

from .base_tool import BaseTool
from .schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["CalculatorTool", "CalculatorError", "evaluate_expression"]

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_ABS_VALUE = 10**30
MAX_NODES = 100

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be computed; the message is shown to the model."""


def _check_magnitude(value):
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    if abs(value) > MAX_ABS_VALUE:
        raise CalculatorError("number too large")
    return value


def _eval_node(node: ast.AST):
    if isinstance(node, ast.Constant):
        # bool is an int subclass; "True + 1" is not arithmetic the model should rely on.
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"unsupported literal {node.value!r}")
        return _check_magnitude(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval_node(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent larger than {MAX_EXPONENT}")
        try:
            return _check_magnitude(_BINOPS[type(node.op)](left, right))
        except ZeroDivisionError as e:
            raise CalculatorError("division by zero") from e
        except OverflowError as e:
            raise CalculatorError("number too large") from e
    raise CalculatorError(f"unsupported syntax: {type(node).__name__}")


def evaluate_expression(expression: str) -> int | float:
    """Evaluate an arithmetic expression safely; raises :class:`CalculatorError` on anything else."""
    if not isinstance(expression, str):
        raise CalculatorError("expression must be a string")
    expr = expression.strip()
    if not expr:
        raise CalculatorError("empty expression")
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"invalid expression: {e.msg}") from e
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError("expression too complex")
    return _eval_node(tree.body)


def _format(value) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


class CalculatorTool(BaseTool):
    """``calculator(expression: str)`` -> the value as text, or an error message the model can read."""

    def __init__(self, config: dict, tool_schema: Optional[OpenAIFunctionToolSchema] = None):
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict[str, Any]] = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate(
            {
                "type": "function",
                "function": {
                    "name": "calculator",
                    "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
                    "parameters": {
                        "type": "object",
                        "properties": {"expression": {"type": "string", "description": "e.g. (3 + 4) * 2"}},
                        "required": ["expression"],
                    },
                },
            }
        )

    async def create(self, instance_id: Optional[str] = None, ground_truth: Any = None, **kwargs):
        instance_id = instance_id or uuid4().hex
        self._instances[instance_id] = {"ground_truth": ground_truth, "last": None}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
        expression = parameters.get("expression") if isinstance(parameters, dict) else None
        if expression is None:
            return ToolResponse(text="Error: missing required parameter 'expression'."), 0.0, {"error": 1}
        try:
            value = evaluate_expression(expression if isinstance(expression, str) else str(expression))
        except CalculatorError as e:
            return ToolResponse(text=f"Error: {e}."), 0.0, {"error": 1}
        state = self._instances.setdefault(instance_id, {"ground_truth": None, "last": None})
        state["last"] = value
        return ToolResponse(text=_format(value)), 0.0, {"error": 0}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        """1.0 when the last computed value equals the numeric ground truth, else 0.0."""
        state = self._instances.get(instance_id) or {}
        truth, last = state.get("ground_truth"), state.get("last")
        if truth is None or last is None:
            return 0.0
        try:
            return 1.0 if math.isclose(float(str(truth).replace(",", "")), float(last), rel_tol=1e-9) else 0.0
        except ValueError:
            return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)
