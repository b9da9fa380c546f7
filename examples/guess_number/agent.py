"""A multi-turn agent for the number-guessing game, rewarded at every turn through the control API.

    python examples/guess_number/agent.py --games 4 --group-size 4

After each model reply the game scores the guess and the agent attaches that score to the step just recorded
(``POST /sessions/<id>/rewards`` with ``step: "last"``, here through ``s.reward_step``): the learner then
sees per-step (process) rewards, with a discounted return per step, instead of one reward at the end.
``--scripted`` forces binary-search guesses through structured outputs (deterministic, for a random model).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import uuid
from typing import Any

import steptap.adapters
from game import GuessNumberEnv
from steptap.adapters.session import resolve_model


def play(
    s: Any,
    client: Any,
    model: str,
    env: GuessNumberEnv,
    *,
    scripted: bool = False,
    max_tokens: int = 8,
    temperature: float = 1.0,
) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You play a guessing game. Reply with a single integer."},
        {"role": "user", "content": env.intro()},
    ]
    rewards = []
    while True:
        extra = (
            {"structured_outputs": {"regex": re.escape(str(env.binary_search_guess()))}} if scripted else None
        )
        resp = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=temperature, extra_body=extra
        )
        reply = resp.choices[0].message.content or ""
        turn = env.step(reply)
        s.reward_step(turn.reward, name="guess")  # a process reward on the step this reply was recorded as
        rewards.append(turn.reward)
        if turn.done:
            break
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": turn.feedback}]
    s.set_reward(1.0 if env.solved else 0.0, name="solved")
    return {"turns": env.turns, "solved": env.solved, "step_rewards": rewards}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--proxy", help="steptap proxy URL (default $STEPTAP_URL)")
    p.add_argument("--control-token", help="control token (default $STEPTAP_CONTROL_TOKEN)")
    p.add_argument("--model", help="model name (default: the one the proxy serves)")
    p.add_argument("--games", type=int, default=2, help="secrets to play (one GRPO group each)")
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--high", type=int, default=64)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scripted", action="store_true", help="force binary-search guesses (structured outputs)")
    args = p.parse_args(argv)

    rng = random.Random(args.seed)
    for _ in range(args.games):
        secret = rng.randint(1, args.high)
        group = f"guess-{uuid.uuid4().hex[:8]}"
        for _member in range(args.group_size):
            env = GuessNumberEnv(secret, 1, args.high, args.max_turns)
            meta = {"task": "guess_number", "secret": secret, "high": args.high}
            with steptap.adapters.session(
                args.proxy,
                args.control_token,
                group_id=group,
                group_size=args.group_size,
                metadata=meta,
                model=args.model,
            ) as s:
                info = play(s, s.openai_client(), resolve_model(s, args.model), env, scripted=args.scripted)
            print(json.dumps({"session": s.id, "group": group, "secret": secret, **info}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
