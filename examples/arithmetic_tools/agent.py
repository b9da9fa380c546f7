"""A tool-calling agent on generated arithmetic problems, with the plain ``openai`` client.

    steptap up                      # prints STEPTAP_URL / STEPTAP_CONTROL_TOKEN_FILE; then, in another shell:
    python examples/arithmetic_tools/agent.py --problems 4 --group-size 4

Each problem is asked ``--group-size`` times (one GRPO group); each attempt is one steptap session whose
reward is 1.0 when the final answer is right. ``--scripted`` forces a correct run through vLLM's structured
outputs (a random test model cannot call tools on its own), which makes the run deterministic.
"""

from __future__ import annotations

import json
import random
import sys
import uuid
from typing import Any

from toolenv import CalculatorTool, Problem, ToolEnv, agent_arguments, forced, make_problem, scripted_turns

import steptap.adapters
from steptap.adapters.session import resolve_model


def run_episode(
    client: Any,
    model: str,
    env: ToolEnv,
    problem: Problem,
    *,
    scripted: bool = False,
    max_tokens: int = 96,
    temperature: float = 1.0,
) -> tuple[float, dict[str, Any]]:
    """One attempt: model turn, tool results, model turn ... until an answer or ``env.max_turns``."""
    messages = env.reset(problem)
    script = scripted_turns(problem) if scripted else []
    for turn in range(env.max_turns):
        extra = forced(script[turn]) if turn < len(script) else None
        resp = client.chat.completions.create(
            model=model,
            messages=messages,
            tools=env.tool_schemas(),
            tool_choice="auto",
            max_tokens=max_tokens,
            temperature=temperature,
            extra_body=extra,
        )
        message = resp.choices[0].message.model_dump(exclude_none=True)
        message.pop("refusal", None)
        messages.append(message)  # the assistant turn, tool calls included, goes back as the model wrote it
        result = env.step(message)
        messages.extend(result.observations)
        if result.done:
            return result.reward, {**result.info, "turns": turn + 1}
    return 0.0, {"turns": env.max_turns, "truncated": True}


def main(argv: list[str] | None = None) -> int:
    p = agent_arguments(__doc__.split("\n\n")[0])
    p.add_argument("--max-turns", type=int, default=4)
    args = p.parse_args(argv)

    rng = random.Random(args.seed)
    correct = 0
    for _ in range(args.problems):
        problem = make_problem(rng)
        group = f"arith-{uuid.uuid4().hex[:8]}"
        for _member in range(args.group_size):
            env = ToolEnv([CalculatorTool()], max_turns=args.max_turns)
            meta = {"task": "arithmetic_tools", "question": problem.question, "answer": problem.answer}
            with steptap.adapters.session(
                args.proxy,
                args.control_token,
                group_id=group,
                group_size=args.group_size,
                metadata=meta,
                model=args.model,
            ) as s:
                model = resolve_model(s, args.model)
                reward, info = run_episode(s.openai_client(), model, env, problem, scripted=args.scripted)
                s.set_reward(reward)
            correct += reward == 1.0
            print(
                json.dumps(
                    {"session": s.id, "group": group, "question": problem.question, "reward": reward, **info}
                ),
                flush=True,
            )
    total = args.problems * args.group_size
    print(f"correct {correct}/{total}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
