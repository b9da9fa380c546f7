"""A multi-turn agent for the number-guessing game on ``AgentEnv`` + ``AgentEnvLoop``, rewarded every turn.

    python examples/guess_number/agent.py --games 4 --group-size 4

After each model reply the environment (env.py) scores the guess, and the loop attaches that score to the
step just recorded (``POST /sessions/<id>/rewards`` with ``step: "last"``): the learner then sees per-step
(process) rewards, with a discounted return per step, instead of one reward at the end. ``--scripted`` forces
binary-search guesses through structured outputs (deterministic, for a random model).

The same environment runs from a dataset too (``env_kwargs``: secret, high, max_turns, scripted):
``steptap env run games.parquet --env examples/guess_number/env.py:make_env``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys

from env import make_env

from steptap.adapters.env import DatasetRunner, Row, RunConfig
from steptap.adapters.session import proxy_settings


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--proxy", help="steptap proxy URL (default $STEPTAP_URL)")
    p.add_argument("--control-token", help="control token (default $STEPTAP_CONTROL_TOKEN)")
    p.add_argument("--model", help="model name (default: the one the proxy serves)")
    p.add_argument("--games", type=int, default=2, help="secrets to play (one GRPO group each)")
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--high", type=int, default=64)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scripted", action="store_true", help="force binary-search guesses (structured outputs)")
    args = p.parse_args(argv)

    url, token = proxy_settings(args.proxy, args.control_token)
    rng = random.Random(args.seed)
    rows = [
        Row(
            index=i,
            prompt=None,
            env_kwargs={
                "secret": rng.randint(1, args.high),
                "high": args.high,
                "max_turns": args.max_turns,
                "scripted": args.scripted,
            },
        )
        for i in range(args.games)
    ]
    cfg = RunConfig(
        proxy_url=url,
        control_token=token,
        n=args.group_size,
        concurrency=args.concurrency,
        env=make_env,
        model=args.model or os.environ.get("STEPTAP_MODEL"),
        max_tokens=8,
        temperature=1.0,
        name="guess",
    )
    episodes = asyncio.run(DatasetRunner(rows, cfg).run())
    for ep in sorted(episodes, key=lambda e: (e.row, e.member)):
        if ep.error:
            print(f"game {ep.row} member {ep.member} failed: {ep.error}", file=sys.stderr)
            continue
        print(
            json.dumps(
                {
                    "session": ep.session_id,
                    "group": ep.group_id,
                    "secret": rows[ep.row].env_kwargs["secret"],
                    "turns": ep.steps,
                    "solved": bool(ep.info.get("solved")),
                    "step_rewards": ep.step_rewards,
                }
            ),
            flush=True,
        )
    return 0 if all(not ep.error for ep in episodes) else 1


if __name__ == "__main__":
    sys.exit(main())
