"""The demo's agent population: many small agents whose reward is dense and quickly learnable.

    python examples/digits/agents.py --concurrency 16          # against $STEPTAP_URL, until stopped

Each agent is asked a short question and rewarded with the fraction of its response tokens that are digits.
The tiny model's tokenizer (Qwen2's pre-tokenizer) makes every digit its own token, so a random policy almost
never emits one (reward about 0.001-0.03); a policy that learns to answer in digits gets close to 1.0, and the
rise shows within a few GRPO updates (measured: 0.03 -> 0.96 in 10 updates of 8 prompts x 8 samples x 24
tokens).

The agents are grouped for GRPO: each prompt is answered by ``--group-size`` sessions sharing a ``group_id``
(``group_size`` set, so the learner knows when a group is complete). Sampling stays at temperature 1.0, the
policy's own distribution. The token strings come back with the reply's logprobs (asked for explicitly; the
proxy strips only what the agent did not ask for), so the reward counts tokens, not characters.

By default the population samples continuously, overlapping with training (off-policy by a version or two,
which the learner bounds with ``max_staleness``). ``--round-groups N`` samples N groups, then waits until the
proxy serves a newer policy: on-policy batches, and on a 2-core machine generation and training then take
turns instead of fighting over the cores. The demo uses it (examples/digits/learner.toml has batch_groups =
8).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import urllib.request
import uuid
from typing import Any

import openai

import steptap.adapters
from steptap.middleware.client import default_control_token

PROMPTS = [
    "Tell me something.",
    "What do you see?",
    "Say a few words.",
    "Describe the weather.",
    "Write a line.",
    "What is on your mind?",
    "Give me an answer.",
    "Continue the story.",
    "Name a thing.",
    "Reply briefly.",
    "What happened today?",
    "Say anything.",
    "Report the status.",
    "What comes next?",
    "Tell me a fact.",
    "Write a short note.",
]


def digit_fraction(tokens: list[str]) -> float:
    """The task's reward: the fraction of response tokens that are digits (surrounding spaces ignored)."""
    if not tokens:
        return 0.0
    return sum(1 for t in tokens if t.strip().isdigit()) / len(tokens)


def response_tokens(choice: Any) -> list[str]:
    content = getattr(getattr(choice, "logprobs", None), "content", None) or []
    if content:
        return [c.token for c in content]
    return (choice.message.content or "").split()  # no logprobs came back: fall back to words


def policy_version(proxy: str) -> int:
    """The policy version the proxy serves now (``GET /health``; no token needed)."""
    try:
        with urllib.request.urlopen(f"{proxy}/health", timeout=10) as resp:
            return int(json.loads(resp.read()).get("policy_version", 0))
    except (OSError, ValueError):
        return -1


class Population:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.proxy = args.proxy or os.environ.get("STEPTAP_URL", "")
        # `steptap up --agents` hands the token over as a 0600 file ($STEPTAP_CONTROL_TOKEN_FILE)
        self.token = args.control_token or default_control_token() or ""
        self.rng = random.Random(args.seed)
        self.sem = asyncio.Semaphore(args.concurrency)
        self.done = 0
        self.rewards: list[float] = []
        self.t0 = time.time()

    async def member(
        self, steptap_client: Any, llm: openai.AsyncOpenAI, model: str, group: str, prompt: str
    ) -> None:
        async with self.sem:
            meta = {"task": "digits", "prompt": prompt}
            async with steptap.adapters.async_session(
                self.proxy,
                self.token,
                client=steptap_client,
                group_id=group,
                group_size=self.args.group_size,
                metadata=meta,
            ) as s:
                # One shared HTTP client for every agent; each call carries its own session's key.
                resp = await llm.with_options(base_url=s.base_url, api_key=s.api_key).chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=self.args.max_tokens,
                    temperature=1.0,
                    logprobs=True,
                )
                reward = digit_fraction(response_tokens(resp.choices[0]))
                s.set_reward(reward)
            self.done += 1
            self.rewards.append(reward)
            if self.args.print_sessions:
                print(json.dumps({"session": s.id, "group": group, "reward": reward}), flush=True)

    async def group(self, steptap_client: Any, llm: openai.AsyncOpenAI, model: str) -> None:
        prompt = self.rng.choice(PROMPTS)
        group = f"digits-{uuid.uuid4().hex[:10]}"
        members = [
            self.member(steptap_client, llm, model, group, prompt) for _ in range(self.args.group_size)
        ]
        results = await asyncio.gather(*members, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            print(
                f"group {group}: {len(errors)} member(s) failed: {errors[0]!r}", file=sys.stderr, flush=True
            )
            await asyncio.sleep(1.0)  # back off (a weight swap or a restart in progress)

    async def wait_for_new_policy(self, version: int) -> int:
        """Until the proxy serves a newer policy version (the learner swapped its update in), or a timeout."""
        deadline = time.time() + self.args.round_timeout
        while time.time() < deadline:
            now = await asyncio.to_thread(policy_version, self.proxy)
            if now > version:
                return now
            await asyncio.sleep(0.5)
        return version

    async def run(self) -> None:
        from steptap.middleware.client import SteptapClient

        if not self.proxy or not self.token:
            raise SystemExit(
                "set STEPTAP_URL and STEPTAP_CONTROL_TOKEN or STEPTAP_CONTROL_TOKEN_FILE (steptap up prints "
                "them), or pass flags"
            )
        async with SteptapClient(self.proxy, self.token) as steptap_client:
            llm = openai.AsyncOpenAI(base_url=f"{self.proxy}/v1", api_key="EMPTY", max_retries=2, timeout=300)
            model = self.args.model or os.environ.get("STEPTAP_MODEL") or (await llm.models.list()).data[0].id
            # Enough groups in flight to keep every concurrency slot busy while a group's last members finish.
            in_flight = max(1, -(-self.args.concurrency // self.args.group_size) + 1)
            started, round_left = 0, self.args.round_groups or None
            version = await asyncio.to_thread(policy_version, self.proxy)
            tasks: set[asyncio.Task[None]] = set()
            last_report = time.time()
            while self.args.groups is None or started < self.args.groups or tasks:
                while (
                    len(tasks) < in_flight
                    and (self.args.groups is None or started < self.args.groups)
                    and round_left != 0
                ):
                    tasks.add(asyncio.create_task(self.group(steptap_client, llm, model)))
                    started += 1
                    round_left = None if round_left is None else round_left - 1
                if tasks:
                    _, tasks = await asyncio.wait(tasks, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                elif round_left == 0:  # a round is complete: sample the next one from the next policy
                    version = await self.wait_for_new_policy(version)
                    round_left = self.args.round_groups
                if time.time() - last_report >= self.args.report_every and self.rewards:
                    last_report = time.time()
                    recent = self.rewards[-64:]
                    print(
                        json.dumps(
                            {
                                "t": round(time.time() - self.t0, 1),
                                "sessions": self.done,
                                "policy_version": version,
                                "recent_reward": round(sum(recent) / len(recent), 3),
                            }
                        ),
                        flush=True,
                    )
            await llm.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--proxy", help="steptap proxy URL (default $STEPTAP_URL)")
    p.add_argument(
        "--control-token",
        help="control token (default $STEPTAP_CONTROL_TOKEN or $STEPTAP_CONTROL_TOKEN_FILE)"
    )
    p.add_argument("--model", help="model name (default $STEPTAP_MODEL, else the proxy's first model)")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt (GRPO group)")
    p.add_argument("--concurrency", type=int, default=16, help="model calls in flight")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument(
        "--groups", type=int, default=None, help="stop after this many groups (default: run until stopped)"
    )
    p.add_argument(
        "--round-groups",
        type=int,
        default=0,
        help="sample in rounds of this many groups, each round from a newer policy than the last "
        "(on-policy batches for a learner with batch_groups equal to it); 0: sample continuously",
    )
    p.add_argument("--round-timeout", type=float, default=300.0, help="longest wait for a new policy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--print-sessions", action="store_true", help="one JSON line per finished session")
    p.add_argument("--report-every", type=float, default=10.0, help="seconds between progress lines")
    args = p.parse_args(argv)
    try:
        asyncio.run(Population(args).run())
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
