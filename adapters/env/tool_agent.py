"""The multi-turn tool recipe's task (examples/tool_agent), registered as the ``tool_agent`` environment.

Products a small model cannot work out in its head (3-digit x 2-digit), the ``calculator`` tool in hermes
format (``<tool_call>{"name", "arguments"}</tool_call>``, parsed by vLLM's hermes tool parser or, failing
that, from the text), multi-turn: call -> tool result -> answer. A short system prompt and ONE worked tool
example as chat turns: SmolLM2's chat template renders neither ``tools`` nor ``tool_calls``, so the prompt is
where the model learns the format, and calls go back into the history as the text the model wrote.

Rewards: a process reward once per episode, graded along the call's format (``GRADES``: a ``<tool_call>``
opened, closed, naming the calculator, with an ``expression`` argument, run without an error; paid up to the
best grade reached, at most ``CALL_REWARD``), and 1.0 for the exact product as the answer's last number. The
answer is never forced.

The GPU recipe (GSM8K rows, the ``calculator`` environment) is the same loop with another dataset and config.
"""

from __future__ import annotations

import random
from typing import Any

from steptap.adapters.env.base import Message, Observation, RewardValue, ToolEnv, parse_tool_calls
from steptap.adapters.env.calculator import CalculatorTool, hermes_tool_call

# The process reward's grades, one per part of the call's format (small beside the outcome's 1.0):
CALL_REWARD = 0.1  # a well-formed call that ran
ARGUMENTS_REWARD = 0.08  # a closed block naming the calculator with an "expression" argument that did not run
NAMED_REWARD = 0.06  # a closed block naming the calculator
ATTEMPT_REWARD = 0.04  # a closed <tool_call> block naming no calculator (the base model's {"result": N})
OPENED_REWARD = 0.02  # a <tool_call> opened, never closed: the first thing the base model gets right
# Why the grades. The base model (T=1) opens a <tool_call> in about 1 reply of 4 and almost never closes one,
# so a reward for closed blocks alone left nearly every GRPO group without variance. With three grades
# (opened, closed, ran) one run of two learned and the other did not (issue 40): it learned to close blocks
# shaped like the tool's *result* ({"result": 876 * 63}), and nothing paid a step from there towards
# {"name": "calculator", "arguments": {...}}. Each part of the format now earns its own step.
EVAL_SEED = 1234  # held-out rows come from this seed and are never drawn for training
NAME = "tool_agent"

SYSTEM = "You have a calculator tool. Call it for every multiplication, then answer with: The answer is N."
# The one worked example, as chat turns after the system prompt. Measured on SmolLM2-135M-Instruct (T=1, 8
# samples of one question): the same example written inside the system prompt gave 0 of 8 tool calls (and 0
# of 100 held-out rows greedily); as turns, 3 of 8 replies opened a <tool_call> block (none well-formed yet).
EXAMPLE: list[dict[str, Any]] = [
    {"role": "user", "content": "What is 214 * 36?"},
    {"role": "assistant", "content": hermes_tool_call("calculator", {"expression": "214 * 36"})},
    {"role": "tool", "content": '{"result": 7704}'},
    {"role": "assistant", "content": "The answer is 7704."},
]


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def pairs(n: int, seed: int, exclude: set[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """``n`` distinct (3-digit, 2-digit) pairs from ``seed``, none in ``exclude``."""
    rng, seen = random.Random(seed), set(exclude or ())
    out: list[tuple[int, int]] = []
    if n > 900 * 90 - len(seen):
        raise ValueError(f"at most {900 * 90 - len(seen)} distinct rows")
    while len(out) < n:
        pair = (rng.randint(100, 999), rng.randint(10, 99))
        if pair not in seen:
            seen.add(pair)
            out.append(pair)
    return out


def make_rows(n: int, *, seed: int = 0, held_out: int = 0) -> list[dict[str, Any]]:
    """Dataset rows (Agent-R1's columns). With ``held_out`` > 0, the rows avoid the first ``held_out`` pairs
    of the evaluation seed, so training never sees an eval question; ``seed=EVAL_SEED`` gives those rows."""
    exclude = set(pairs(held_out, EVAL_SEED)) if held_out and seed != EVAL_SEED else set()
    return [
        {
            "data_source": "steptap/multiply_3x2",
            "prompt": [{"role": "user", "content": question(a, b)}],
            "reward_model": {"style": "rule", "ground_truth": str(a * b)},
            "agent_name": NAME,
            "env_kwargs": {"expression": f"{a} * {b}"},
            "index": i,
        }
        for i, (a, b) in enumerate(pairs(n, seed, exclude))
    ]


class ToolAgentEnv(ToolEnv):
    """The calculator ToolEnv with the recipe's prompt (system + one worked example as turns), calls kept as
    text in the history, and the graded process reward: each step earns what its grade adds to the best one
    paid so far in the episode (at most ``CALL_REWARD`` in all)."""

    def __init__(self, *, system: str = SYSTEM, example: list[dict[str, Any]] | None = None,
                 max_steps: int = 3) -> None:
        super().__init__([CalculatorTool()], max_steps=max_steps, system=system, calls_in_content=True)
        self.example = EXAMPLE if example is None else example
        self.paid = 0.0

    def reset(self, **kw: Any) -> Observation:
        super().reset(**kw)
        self.paid = 0.0
        head = 1 if self.messages and self.messages[0].get("role") == "system" else 0
        self.messages[head:head] = [dict(m) for m in self.example]
        return list(self.messages)

    async def step(self, action: Message) -> tuple[Observation, RewardValue, bool, dict[str, Any]]:
        well_formed = self.well_formed_calls
        obs, _, done, info = await super().step(action)
        if self.well_formed_calls > well_formed:
            earned = CALL_REWARD
        else:
            earned = max((grade(c) for c in parse_tool_calls(action)), default=0.0)
            if not earned and "<tool_call>" in (action.get("content") or ""):
                earned = OPENED_REWARD
        reward = earned - self.paid if earned > self.paid else None  # at most CALL_REWARD an episode
        self.paid = max(self.paid, earned)
        return obs, reward, done, info


def grade(call: dict[str, Any]) -> float:
    """A parsed call that did not run well-formed, graded by how much of the format it has."""
    if call["name"] != CalculatorTool.name:
        return ATTEMPT_REWARD
    args = call["arguments"]
    return ARGUMENTS_REWARD if isinstance(args, dict) and "expression" in args else NAMED_REWARD


def make_env() -> ToolAgentEnv:
    return ToolAgentEnv()
