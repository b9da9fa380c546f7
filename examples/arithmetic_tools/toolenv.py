"""Tools and a tool environment in the shape of Agent-R1's ``BaseTool`` / ``ToolEnv``, as plain Python.

A ``BaseTool`` executes one action and returns its raw result; the ``ToolEnv`` is the orchestrator: it runs
the tool calls of an assistant message, turns the results into the next observation (tool messages), decides
when the episode ends and what it earned. Nothing here knows about steptap or the model: the agent loop
(agent.py) connects the two, and the proxy records every model call on the way.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import random
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar


class BaseTool:
    """One executable tool: a name, a description, a JSON schema for its arguments, and ``execute``."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}

    def execute(self, args: dict[str, Any]) -> str:
        raise NotImplementedError

    def schema(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry for this tool."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


_OPS = {
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
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression element: {type(node).__name__}")

    if len(expression) > 200:
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

    def execute(self, args: dict[str, Any]) -> str:
        try:
            value = safe_eval(str(args["expression"]))
        except (KeyError, ValueError, SyntaxError, ZeroDivisionError, TypeError) as exc:
            return json.dumps({"error": f"{type(exc).__name__}: {exc}"})
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return json.dumps({"result": value})


@dataclass
class Problem:
    question: str
    expression: str
    answer: int


def make_problem(rng: random.Random) -> Problem:
    """A two-operand integer problem, e.g. ``What is 37 * 12?``."""
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice(["+", "-", "*"])
    expression = f"{a} {op} {b}"
    return Problem(f"What is {expression}?", expression, int(safe_eval(expression)))


def parse_answer(text: str | None) -> int | None:
    """The last integer in the final answer."""
    numbers = re.findall(r"-?\d+", text or "")
    return int(numbers[-1]) if numbers else None


@dataclass
class EnvStep:
    observations: list[dict[str, Any]]  # tool messages to append
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


SYSTEM = (
    "You solve arithmetic problems. Call the calculator tool to compute, then give the final answer as "
    "'The answer is N.'"
)


class ToolEnv:
    """Multi-turn tool calling: each assistant message either calls tools (the env runs them) or answers."""

    def __init__(self, tools: list[BaseTool], max_turns: int = 4) -> None:
        self.tools = {t.name: t for t in tools}
        self.max_turns = max_turns
        self.problem: Problem | None = None
        self.turn = 0
        self.tool_calls = 0

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    def reset(self, problem: Problem) -> list[dict[str, Any]]:
        self.problem, self.turn, self.tool_calls = problem, 0, 0
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": problem.question}]

    def step(self, message: dict[str, Any]) -> EnvStep:
        """``message``: the assistant message as a dict (``content``, ``tool_calls``)."""
        assert self.problem is not None, "reset() first"
        self.turn += 1
        calls = message.get("tool_calls") or []
        if calls:
            observations = [self._run(call) for call in calls]
            done = self.turn >= self.max_turns
            return EnvStep(observations, 0.0, done, {"tool_calls": len(calls), "truncated": done})
        answer = parse_answer(message.get("content"))
        correct = answer == self.problem.answer
        return EnvStep([], 1.0 if correct else 0.0, True, {"answer": answer, "correct": correct})

    def _run(self, call: dict[str, Any]) -> dict[str, Any]:
        fn = call.get("function") or {}
        tool = self.tools.get(fn.get("name", ""))
        if tool is None:
            result = json.dumps({"error": f"unknown tool {fn.get('name')!r}"})
        else:
            try:
                args = json.loads(fn.get("arguments") or "{}")
                result = tool.execute(args if isinstance(args, dict) else {})
                self.tool_calls += 1
            except ValueError as exc:
                result = json.dumps({"error": f"arguments are not JSON: {exc}"})
        return {"role": "tool", "tool_call_id": call.get("id", ""), "content": result}


def hermes_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The exact text a hermes-style (Qwen) model emits for a tool call; vLLM's hermes parser turns it into
    ``tool_calls``. Used to force a correct run on a random model (``--scripted``)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def scripted_turns(problem: Problem) -> list[str]:
    """A correct two-turn run: call the calculator, then answer."""
    return [
        hermes_tool_call("calculator", {"expression": problem.expression}),
        f"The answer is {problem.answer}.",
    ]


def forced(text: str) -> dict[str, Any]:
    """``extra_body`` that makes vLLM emit exactly ``text`` (structured outputs with a regex)."""
    return {"structured_outputs": {"regex": re.escape(text)}}


def agent_arguments(description: str) -> argparse.ArgumentParser:
    """The flags every arithmetic agent takes (plain openai, LangGraph, Agents SDK)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--proxy", help="steptap proxy URL (default $STEPTAP_URL)")
    p.add_argument("--control-token", help="control token (default $STEPTAP_CONTROL_TOKEN)")
    p.add_argument("--model", help="model name (default: the one the proxy serves)")
    p.add_argument("--problems", type=int, default=2)
    p.add_argument("--group-size", type=int, default=2, help="attempts per problem (one GRPO group)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scripted", action="store_true", help="force a correct run (structured outputs)")
    return p
