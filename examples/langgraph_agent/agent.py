"""The arithmetic tool agent written with LangGraph, through steptap's LangChain adapter.

    python examples/langgraph_agent/agent.py --problems 2 --group-size 2

The graph is LangGraph's standard tool loop (a model node, a ``ToolNode``, ``tools_condition``); the chat
model is ``langchain_openai.ChatOpenAI`` bound to the steptap session by the adapter, so every model call the
graph makes is recorded as a step of the session. The tool and the problems are the ones of
examples/arithmetic_tools. ``--scripted`` forces a correct run (structured outputs), for a random test model.
"""

from __future__ import annotations

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


def build_graph(llm: Any, script: list[str] | None = None) -> Any:
    from langchain_core.tools import tool
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    calc = CalculatorTool()

    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / and parentheses; returns the number."""
        return calc.execute({"expression": expression})

    tools = [calculator]
    model = llm.bind_tools(tools)

    def agent(state: MessagesState) -> dict[str, Any]:
        turn = sum(1 for m in state["messages"] if m.type == "ai")
        step_model = model
        if script and turn < len(script):
            step_model = llm.bind_tools(tools).bind(extra_body=forced(script[turn]))
        return {"messages": [step_model.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()


def solve(
    s: Any, problem: Problem, *, model: str | None = None, scripted: bool = False, max_turns: int = 4
) -> tuple[float, dict[str, Any]]:
    llm = steptap.adapters.bind("langchain", s, model=model, max_tokens=96, temperature=1.0)
    app = build_graph(llm, scripted_turns(problem) if scripted else None)
    try:
        # Each model turn is two graph steps (agent, tools); the limit bounds a model that never answers.
        state = app.invoke(
            {"messages": [("system", SYSTEM), ("user", problem.question)]}, {"recursion_limit": 2 * max_turns}
        )
    except Exception as exc:
        if type(exc).__name__ != "GraphRecursionError":
            raise
        return 0.0, {"truncated": True}
    answer = parse_answer(state["messages"][-1].content)
    return float(answer == problem.answer), {"answer": answer, "messages": len(state["messages"])}


def main(argv: list[str] | None = None) -> int:
    p = agent_arguments(__doc__.split("\n\n")[0])
    args = p.parse_args(argv)

    rng = random.Random(args.seed)
    for _ in range(args.problems):
        problem = make_problem(rng)
        group = f"langgraph-{uuid.uuid4().hex[:8]}"
        for _member in range(args.group_size):
            meta = {"task": "arithmetic_tools", "agent": "langgraph", "question": problem.question}
            with steptap.adapters.session(
                args.proxy,
                args.control_token,
                group_id=group,
                group_size=args.group_size,
                metadata=meta,
                model=args.model,
            ) as s:
                reward, info = solve(s, problem, model=args.model, scripted=args.scripted)
                s.set_reward(reward)
            print(json.dumps({"session": s.id, "group": group, "reward": reward, **info}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
