"""The arithmetic tool agent written against the OpenAI Responses API (``client.responses.create``).

    steptap up                      # prints STEPTAP_URL / STEPTAP_CONTROL_TOKEN; then, in another shell:
    python examples/responses_agent/agent.py --problems 2 --group-size 2 [--stream] [--scripted]

A stateful Responses agent: the first call sends ``instructions`` and the question, each later call sends only
the new ``function_call_output`` items with ``previous_response_id`` (the proxy keeps the conversation behind
a response, per session). Every call is a step with exact token ids (``endpoint: responses``). ``--scripted``
forces a correct run (vLLM structured outputs) for a random model.
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
TOOLS = [{"type": "function", "name": TOOL.name, "description": TOOL.description,
          "parameters": TOOL.parameters}]


def call_model(client: Any, stream: bool, **kw: Any) -> Any:
    if not stream:
        return client.responses.create(**kw)
    with client.responses.stream(**kw) as s:
        for _ in s:  # typed events: response.output_text.delta, response.output_item.done, ...
            pass
        return s.get_final_response()


def run_episode(client: Any, model: str, problem: Problem, *, scripted: bool, stream: bool,
                max_turns: int = 4) -> tuple[float, dict[str, Any]]:
    script = scripted_turns(problem) if scripted else []
    new_input: Any = problem.question
    previous: str | None = None
    for turn in range(max_turns):
        extra = forced(script[turn]) if turn < len(script) else None
        resp = call_model(client, stream, model=model, instructions=SYSTEM, tools=TOOLS, input=new_input,
                          previous_response_id=previous, max_output_tokens=96, extra_body=extra)
        calls = [item for item in resp.output if item.type == "function_call"]
        if not calls:
            answer = parse_answer(resp.output_text)
            correct = answer == problem.answer
            return (1.0 if correct else 0.0), {"answer": answer, "turns": turn + 1}
        new_input = []
        for call in calls:
            try:
                out = (
                    TOOL.execute(json.loads(call.arguments))
                    if call.name == TOOL.name
                    else '{"error": "unknown"}'
                )
            except ValueError as exc:
                out = json.dumps({"error": f"arguments are not JSON: {exc}"})
            new_input.append({"type": "function_call_output", "call_id": call.call_id, "output": out})
        previous = resp.id
    return 0.0, {"turns": max_turns, "truncated": True}


def main(argv: list[str] | None = None) -> int:
    p = agent_arguments(__doc__.split("\n\n")[0])
    p.add_argument("--stream", action="store_true", help="use responses.stream (typed server-sent events)")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    for _ in range(args.problems):
        problem = make_problem(rng)
        group = f"responses-{uuid.uuid4().hex[:8]}"
        for _member in range(args.group_size):
            meta = {"task": "arithmetic_tools", "agent": "responses", "question": problem.question}
            with steptap.adapters.session(args.proxy, args.control_token, group_id=group,
                                          group_size=args.group_size, metadata=meta, model=args.model) as s:
                reward, info = run_episode(s.openai_client(), resolve_model(s, args.model), problem,
                                           scripted=args.scripted, stream=args.stream)
                s.set_reward(reward)
            print(json.dumps({"session": s.id, "group": group, "question": problem.question, "reward": reward,
                              **info}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
