"""The ``calculator`` environment with forced model output, for a random test model (``--env
examples/calculator_env/scripted.py:make_env``).

A random-weight model never writes a well-formed tool call, so this variant constrains each reply with vLLM's
structured outputs: first the calculator call for the row's expression, then ``The answer is N.`` (``N``
from the row's ``env_kwargs``, or ``say`` when given: a deliberately wrong answer, to test scoring).
Everything else (tool execution, process rewards, scoring, the recorded tokens and logprobs) is the real
environment's.

A forced reply is recorded, but the learner drops it from training (``dropped_unreproducible``: it cannot
recompute a grammar-constrained distribution). With ``free_answer`` in ``env_kwargs`` only the tool call is
forced and the model writes its answer itself: that step is an ordinary sample, and trained on.
"""

from __future__ import annotations

from typing import Any

from steptap.adapters.env.base import Observation, ToolEnv
from steptap.adapters.env.calculator import SYSTEM, CalculatorTool, forced, hermes_tool_call


class ScriptedCalculatorEnv(ToolEnv):
    def __init__(self) -> None:
        super().__init__([CalculatorTool()], max_steps=4, system=SYSTEM)

    def reset(self, **kw: Any) -> Observation:
        obs = super().reset(**kw)
        answer = self.env_kwargs.get("say", self.env_kwargs.get("answer"))
        self.script = [
            hermes_tool_call("calculator", {"expression": str(self.env_kwargs["expression"])}),
            f"The answer is {answer}.",
        ]
        self.forced_turns = 1 if self.env_kwargs.get("free_answer") else len(self.script)
        return obs

    def request_options(self, turn: int) -> dict[str, Any]:
        return forced(self.script[turn]) if turn < self.forced_turns else {}


def make_env() -> ScriptedCalculatorEnv:
    return ScriptedCalculatorEnv()
