"""The arithmetic tool agent written with the OpenAI Agents SDK, through steptap's adapter.

    python examples/openai_agents_sdk/agent.py --problems 2 --group-size 2

An ``agents.Agent`` with a ``function_tool`` calculator, run by ``Runner.run``; its model is the adapter's
default model (``OpenAIResponsesModel``, the Responses API) on the steptap session (tracing off), so every
model call of the run is a step of the session. ``--scripted`` forces a correct run (structured outputs) for a
random model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "arithmetic_tools"))
from toolenv import (
    SYSTEM,
    CalculatorTool,
    Problem,
    agent_arguments,
    forced,
    make_problem,
    parse_answer,
    scripted_turns,
)

import steptap.adapters


def scripted_model(inner: Any, script: list[str]) -> Any:
    """A model that forces turn i's output to ``script[i]`` and otherwise is ``inner``."""
    from agents import Model, ModelSettings

    class Scripted(Model):
        def __init__(self) -> None:
            self.turn = 0

        def _settings(self, settings: ModelSettings) -> ModelSettings:
            turn, self.turn = self.turn, self.turn + 1
            return (
                settings.resolve(ModelSettings(extra_body=forced(script[turn])))
                if turn < len(script)
                else settings
            )

        async def get_response(self, system_instructions, input, model_settings, *args, **kw):
            return await inner.get_response(
                system_instructions, input, self._settings(model_settings), *args, **kw
            )

        def stream_response(self, system_instructions, input, model_settings, *args, **kw):
            return inner.stream_response(
                system_instructions, input, self._settings(model_settings), *args, **kw
            )

    return Scripted()


async def solve(
    s: Any, problem: Problem, *, model: str | None = None, scripted: bool = False, max_turns: int = 4
) -> tuple[float, dict[str, Any]]:
    from agents import Agent, MaxTurnsExceeded, ModelSettings, Runner, function_tool

    calc = CalculatorTool()

    # vLLM turns a strict tool schema into its own output constraint, which would override --scripted's regex.
    @function_tool(strict_mode=not scripted)
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / and parentheses; returns the number."""
        return calc.execute({"expression": expression})

    llm = steptap.adapters.bind("openai_agents", s, model=model)
    if scripted:
        llm = scripted_model(llm, scripted_turns(problem))
    agent = Agent(
        name="calculator-agent",
        instructions=SYSTEM,
        tools=[calculator],
        model=llm,
        model_settings=ModelSettings(max_tokens=96, temperature=1.0),
    )
    try:
        result = await Runner.run(agent, problem.question, max_turns=max_turns)
    except MaxTurnsExceeded:
        return 0.0, {"truncated": True}
    answer = parse_answer(str(result.final_output))
    return float(answer == problem.answer), {"answer": answer}


async def amain(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    for _ in range(args.problems):
        problem = make_problem(rng)
        group = f"agents-sdk-{uuid.uuid4().hex[:8]}"
        for _member in range(args.group_size):
            meta = {"task": "arithmetic_tools", "agent": "openai_agents", "question": problem.question}
            async with steptap.adapters.async_session(
                args.proxy,
                args.control_token,
                group_id=group,
                group_size=args.group_size,
                metadata=meta,
                model=args.model,
            ) as s:
                reward, info = await solve(s, problem, model=args.model, scripted=args.scripted)
                s.set_reward(reward)
            print(json.dumps({"session": s.id, "group": group, "reward": reward, **info}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = agent_arguments(__doc__.split("\n\n")[0])
    asyncio.run(amain(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
