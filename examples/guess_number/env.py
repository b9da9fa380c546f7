"""The number-guessing game as an ``AgentEnv``: every guess is scored (a process reward on its step) and the
episode's outcome is ``{"solved": 1.0 | 0.0}``. ``AgentEnvLoop`` drives it; the game itself is game.py.

``reset(secret=, high=, max_turns=, scripted=)``; with ``scripted`` each reply is forced (vLLM structured
outputs) to the binary-search guess, which makes a random test model play deterministically."""

from __future__ import annotations

import re
from typing import Any

from game import GuessNumberEnv

from steptap.adapters.env import AgentEnv
from steptap.adapters.env.base import Observation, RewardValue

SYSTEM = "You play a guessing game. Reply with a single integer."


class GuessNumberAgentEnv(AgentEnv):
    step_reward_name = "guess"

    def reset(
        self,
        *,
        prompt: Any = None,
        reward_model: dict[str, Any] | None = None,
        secret: int = 1,
        high: int = 64,
        max_turns: int = 8,
        scripted: bool = False,
        **_: Any,
    ) -> Observation:
        self.game = GuessNumberEnv(int(secret), 1, int(high), int(max_turns))
        self.max_steps, self.scripted = int(max_turns), bool(scripted)
        self.messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": self.game.intro()},
        ]
        return list(self.messages)

    def request_options(self, turn: int) -> dict[str, Any]:
        if not self.scripted:
            return {}
        return {
            "extra_body": {"structured_outputs": {"regex": re.escape(str(self.game.binary_search_guess()))}}
        }

    async def step(self, action: dict[str, Any]) -> tuple[Observation, RewardValue, bool, dict[str, Any]]:
        reply = action.get("content") or ""
        turn = self.game.step(reply)
        if not turn.done:  # the env decides what the model sees next: here the whole game so far
            self.messages += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": turn.feedback},
            ]
        info = {"guess": turn.guess, "solved": self.game.solved, "correct": self.game.solved}
        return list(self.messages), turn.reward, turn.done, info

    def outcome(self) -> RewardValue:
        return {"solved": 1.0 if self.game.solved else 0.0}


def make_env() -> GuessNumberAgentEnv:
    return GuessNumberAgentEnv()
