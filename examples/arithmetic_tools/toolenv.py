"""Tools and a tool environment in the shape of Agent-R1's ``BaseTool`` / ``ToolEnv``, as plain synchronous
Python for the plain-``openai`` and framework agents. The library's version (async, with process rewards and a
generic loop) is ``steptap.adapters.env``; the ``calculator_env`` example runs it from a parquet dataset.

A ``BaseTool`` executes one action and returns its raw result; the ``ToolEnv`` is the orchestrator: it runs
the tool calls of an assistant message, turns the results into the next observation (tool messages), decides
when the episode ends and what it earned. Nothing here knows about steptap or the model: the agent loop
(agent.py) connects the two, and the proxy records every model call on the way.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

from steptap.adapters.env.base import BaseTool
from steptap.adapters.env.calculator import CalculatorTool as LibraryCalculatorTool
from steptap.adapters.env.calculator import hermes_tool_call, safe_eval

__all__ = ["BaseTool", "CalculatorTool", "ToolEnv", "hermes_tool_call", "safe_eval"]


class CalculatorTool(LibraryCalculatorTool):
    """The library's calculator tool (``steptap.adapters.env.calculator``), returning only its text: the
    frameworks' tool functions in the sibling examples return a string."""

    def execute(self, args: dict[str, Any]) -> str:  # type: ignore[override]
        return super().execute(args)[0]


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
