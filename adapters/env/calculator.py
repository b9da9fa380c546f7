"""A calculator tool and the ``calculator`` environment (registered in ``steptap.envs``): Agent-R1's
"GSM8K + Tool" task shape. The model may call ``calculator`` any number of times, then answers; the outcome
reward is 1.0 when the last number of the answer equals ``reward_model["ground_truth"]``, and each well-formed
calculator call earns a process reward of ``WELL_FORMED_REWARD`` on its step."""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Callable
from typing import Any, ClassVar

from steptap.adapters.env.base import BaseTool, ToolEnv

WELL_FORMED_REWARD = 0.1
MAX_EXPRESSION = 200
MAX_MAGNITUDE = 1e12  # intermediate results beyond this are refused (no 9**9**9 CPU burn)

SYSTEM = (
    "You solve arithmetic word problems. Call the calculator tool to compute, then give the final answer "
    "as 'The answer is N.'"
)

_OPS: dict[type[ast.AST], Callable[..., float]] = {  # binary and unary: one or two operands
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def safe_eval(expression: str) -> float:
    """+ - * / // % and parentheses on numbers; anything else is refused (never ``eval``)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool)
        ):
            value = node.value
        elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            value = _OPS[type(node.op)](ev(node.left), ev(node.right))
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            value = _OPS[type(node.op)](ev(node.operand))
        else:
            raise ValueError(f"unsupported expression element: {type(node).__name__}")
        if abs(value) > MAX_MAGNITUDE:
            raise ValueError("number too large")
        return value

    if len(expression) > MAX_EXPRESSION:
        raise ValueError("expression too long")
    return ev(ast.parse(expression, mode="eval"))


class CalculatorTool(BaseTool):
    name = "calculator"
    description = "Evaluate an arithmetic expression with + - * / and parentheses; returns the number."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "for example: (12 + 7) * 3"}},
        "required": ["expression"],
    }

    def execute(self, args: dict[str, Any]) -> tuple[str, float | None]:
        try:
            value = safe_eval(str(args["expression"]))
        except (KeyError, ValueError, SyntaxError, ZeroDivisionError, TypeError, RecursionError) as exc:
            return json.dumps({"error": f"{type(exc).__name__}: {exc}"}), 0.0
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return json.dumps({"result": value}), WELL_FORMED_REWARD


def make_env(max_steps: int = 4) -> ToolEnv:
    """The ``calculator`` environment: a ToolEnv with the calculator tool and the system prompt above."""
    return ToolEnv([CalculatorTool()], max_steps=max_steps, system=SYSTEM)


def hermes_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The exact text a hermes-style (Qwen) model emits for a tool call; vLLM's hermes parser turns it into
    ``tool_calls``. With ``forced`` it makes a random test model call a tool."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def forced(text: str) -> dict[str, Any]:
    """Request options that make vLLM emit exactly ``text`` (structured outputs with a regex)."""
    import re

    return {"extra_body": {"structured_outputs": {"regex": re.escape(text)}}}
