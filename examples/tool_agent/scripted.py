"""The ``tool_agent`` environment with its first turn forced, for a random test model (``--env
examples/tool_agent/scripted.py:make_env``; the CI run in tests/integration/test_env_run.py).

A random-weight model never writes a tool call, so the first reply is constrained with vLLM's structured
outputs to the calculator call for the row's expression; the answer after the tool result is the model's
own (an ordinary sample, trained on; the forced call is dropped by the learner as unreproducible). Everything
else (the prompt, the tool, the rewards, the recorded tokens) is the recipe's environment.
"""

from __future__ import annotations

from typing import Any

from steptap.adapters.env.base import Observation
from steptap.adapters.env.calculator import forced, hermes_tool_call
from steptap.adapters.env.tool_agent import ToolAgentEnv


class ScriptedToolAgentEnv(ToolAgentEnv):
    def reset(self, **kw: Any) -> Observation:
        obs = super().reset(**kw)
        self.call = hermes_tool_call("calculator", {"expression": str(self.env_kwargs["expression"])})
        return obs

    def request_options(self, turn: int) -> dict[str, Any]:
        return forced(self.call) if turn == 0 else {}


def make_env() -> ScriptedToolAgentEnv:
    return ScriptedToolAgentEnv(max_steps=2)
