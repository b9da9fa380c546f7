"""The arithmetic tool agent written against Anthropic's Messages API, with the ``anthropic`` SDK.

    steptap up                      # prints STEPTAP_URL / STEPTAP_CONTROL_TOKEN; then, in another shell:
    python examples/anthropic_agent/agent.py --problems 2 --group-size 2 [--stream] [--scripted]

The agent speaks Messages (``system``, ``tools`` with ``input_schema``, ``tool_use`` -> ``tool_result``) to
``s.anthropic_client()``: an ``anthropic.Anthropic`` whose base URL is the session's ``/s/<id>`` and whose key
is the session key. The proxy answers in Anthropic's format and records each call as a step with exact token
ids (``endpoint: messages``). ``--scripted`` forces a correct run (vLLM structured outputs) for a random
model.
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
from steptap.adapters.session import resolve_model

TOOL = CalculatorTool()
TOOLS = [{"name": TOOL.name, "description": TOOL.description, "input_schema": TOOL.parameters}]


def call_model(client: Any, model: str, messages: list[dict[str, Any]], extra: dict[str, Any] | None,
               stream: bool) -> Any:
    kw = dict(model=model, system=SYSTEM, tools=TOOLS, messages=messages, max_tokens=96, extra_body=extra)
    if not stream:
        return client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        for _ in s.text_stream:  # what a chat UI would print as it comes
            pass
        return s.get_final_message()


def run_episode(client: Any, model: str, problem: Problem, *, scripted: bool, stream: bool,
                max_turns: int = 4) -> tuple[float, dict[str, Any]]:
    """Model turn, tool results, model turn ... until an answer (no tool_use) or ``max_turns``."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": problem.question}]
    script = scripted_turns(problem) if scripted else []
    for turn in range(max_turns):
        reply = call_model(client, model, messages, forced(script[turn]) if turn < len(script) else None,
                           stream)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                          for b in reply.content]})
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            answer = parse_answer("".join(b.text for b in reply.content if b.type == "text"))
            correct = answer == problem.answer
            return (1.0 if correct else 0.0), {"answer": answer, "turns": turn + 1, "stop": reply.stop_reason}
        results = []
        for use in uses:
            out = TOOL.execute(use.input) if use.name == TOOL.name else json.dumps({"error": "unknown tool"})
            results.append({"type": "tool_result", "tool_use_id": use.id, "content": out})
        messages.append({"role": "user", "content": results})
    return 0.0, {"turns": max_turns, "truncated": True}


def main(argv: list[str] | None = None) -> int:
    p = agent_arguments(__doc__.split("\n\n")[0])
    p.add_argument("--stream", action="store_true", help="use messages.stream (server-sent events)")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    for _ in range(args.problems):
        problem = make_problem(rng)
        group = f"anthropic-{uuid.uuid4().hex[:8]}"
        for _member in range(args.group_size):
            meta = {"task": "arithmetic_tools", "agent": "anthropic", "question": problem.question}
            with steptap.adapters.session(args.proxy, args.control_token, group_id=group,
                                          group_size=args.group_size, metadata=meta, model=args.model) as s:
                reward, info = run_episode(s.anthropic_client(), resolve_model(s, args.model), problem,
                                           scripted=args.scripted, stream=args.stream)
                s.set_reward(reward)
            print(json.dumps({"session": s.id, "group": group, "question": problem.question, "reward": reward,
                              **info}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
