"""Agent-R1's environment layer: ``BaseTool``, ``AgentEnv`` and the tool-calling ``ToolEnv``.

A **tool** executes one action and returns its raw result (and, optionally, a process reward for it). An
**environment** is the orchestrator: ``reset(**env_kwargs)`` gives the first observation, ``step(action)``
takes the model's assistant message and returns the next observation, the step's reward, whether the episode
is done, and an info dict. An observation is the whole message list the model sees next: the environment
decides what that is (append, truncate, summarise), and the proxy's ``prefix`` cause records what happened to
the history.

Nothing here knows the model or the proxy: ``AgentEnvLoop`` (loop.py) connects the two.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable
from typing import Any, ClassVar

Message = dict[str, Any]
Observation = list[Message]
RewardValue = float | dict[str, float] | None
ToolResult = tuple[str, float | None]  # (text, process_reward | None)

MAX_TOOL_CALLS = 16  # per assistant message: more is refused with an error observation
MAX_TOOL_RESULT_CHARS = 16_384  # a tool result longer than this is cut (the prompt must stay bounded)


class BaseTool:
    """One executable tool: ``name``, ``description``, a JSON schema for its arguments (``parameters``), and
    ``execute(args) -> (text, process_reward | None)``. ``execute`` may be ``async``."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}

    def execute(self, args: dict[str, Any]) -> ToolResult | Awaitable[ToolResult]:
        raise NotImplementedError

    def schema(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry for this tool."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


class AgentEnv:
    """A task environment. Subclasses implement ``reset`` and ``step``; the defaults keep a growing chat.

    - ``reset(**env_kwargs) -> observation``: the runner passes the dataset row's ``prompt`` (a message list
      or a string), ``reward_model`` and the row's ``env_kwargs`` as keyword arguments.
    - ``async step(action) -> (observation, reward, done, info)``: ``action`` is the assistant message
      (``content``, ``tool_calls``); ``reward`` is this step's process reward (``None``: none), attached to
      the step the model call was recorded as. ``info["correct"]`` (a bool), when given on the last step,
      is what ``steptap eval`` counts as accuracy.
    - ``outcome() -> reward``: the trajectory-level reward when the episode ends (a number or named parts).
    - ``tools()``: the OpenAI ``tools`` list to send with each call (``None``: no tools).
    - ``request_options(turn)``: extra request fields for the next call (e.g. ``extra_body`` that constrains
      the output); by default none.
    """

    max_steps: int = 8
    step_reward_name: str = "process"  # the name process rewards are recorded under

    def __init__(self) -> None:
        self.messages: Observation = []
        self.reward_model: dict[str, Any] = {}

    def reset(
        self, *, prompt: Any = None, reward_model: dict[str, Any] | None = None, **env_kwargs: Any
    ) -> Observation:
        self.messages = as_messages(prompt)
        self.reward_model = dict(reward_model or {})
        return list(self.messages)

    async def step(self, action: Message) -> tuple[Observation, RewardValue, bool, dict[str, Any]]:
        raise NotImplementedError

    def outcome(self) -> RewardValue:
        return None

    def tools(self) -> list[dict[str, Any]] | None:
        return None

    def request_options(self, turn: int) -> dict[str, Any]:
        return {}


class ToolEnv(AgentEnv):
    """Multi-turn tool calling: each assistant message either calls tools (run here; their results are the
    next observation's tool messages) or answers (the episode ends, scored by ``score``).

    A step's reward is the sum of its tool calls' process rewards (``None`` when no tool gave one). Tool calls
    come from the message's ``tool_calls`` (a server with a tool parser) or, failing that, from hermes
    ``<tool_call>{...}</tool_call>`` blocks in its text. Unknown tools, bad JSON and tools that raise become
    error results the model sees, never exceptions.

    ``calls_in_content``: the assistant turn goes back into the history with its calls as the hermes text the
    model wrote, not as ``tool_calls`` (for chat templates that render no ``tool_calls``, like SmolLM2's:
    the model would otherwise see an empty turn before each tool result).

    Counted per episode, in every step's info: ``calls`` (tool calls the model made, parsed or not) and
    ``well_formed_calls`` (those naming a known tool, with JSON object arguments, that ran without an error
    result); ``steptap eval`` reports them as the tool-call and well-formed rates."""

    def __init__(
        self,
        tools: list[BaseTool],
        *,
        max_steps: int = 4,
        system: str | None = None,
        calls_in_content: bool = False,
    ) -> None:
        super().__init__()
        self.tool_map = {t.name: t for t in tools}
        self.max_steps = max_steps
        self.system = system
        self.calls_in_content = calls_in_content
        self.turn = 0
        self.tool_calls = 0
        self.calls = self.well_formed_calls = 0
        self.answer: str | None = None

    def tools(self) -> list[dict[str, Any]] | None:
        return [t.schema() for t in self.tool_map.values()]

    def reset(
        self, *, prompt: Any = None, reward_model: dict[str, Any] | None = None, **env_kwargs: Any
    ) -> Observation:
        super().reset(prompt=prompt, reward_model=reward_model)
        if self.system and not any(m.get("role") == "system" for m in self.messages):
            self.messages.insert(0, {"role": "system", "content": self.system})
        self.env_kwargs = env_kwargs
        self.turn, self.tool_calls, self.answer = 0, 0, None
        self.calls = self.well_formed_calls = 0
        return list(self.messages)

    async def step(self, action: Message) -> tuple[Observation, RewardValue, bool, dict[str, Any]]:
        self.turn += 1
        calls = parse_tool_calls(action)
        self.calls += len(calls)
        if self.calls_in_content:
            self.messages.append({"role": "assistant", "content": as_text(action)})
        else:
            self.messages.append(assistant_message(action, calls))
        counts = {"calls": self.calls, "well_formed_calls": self.well_formed_calls}
        if not calls:
            self.answer = action.get("content") or ""
            score = self.score(self.answer)
            return (
                list(self.messages),
                None,
                True,
                {"answer": self.answer, "correct": score >= 1.0, "score": score, **counts},
            )
        rewards: list[float] = []
        for call in calls[:MAX_TOOL_CALLS]:
            text, reward = await self.run_tool(call)
            if reward is not None:
                rewards.append(float(reward))
            self.messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": text[:MAX_TOOL_RESULT_CHARS]}
            )
        for call in calls[MAX_TOOL_CALLS:]:
            self.messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "content": json.dumps({"error": f"at most {MAX_TOOL_CALLS} tool calls a turn"}),
                }
            )
        done = self.turn >= self.max_steps
        info = {
            "tool_calls": len(calls),
            "truncated": done,
            "calls": self.calls,
            "well_formed_calls": self.well_formed_calls,
        }
        return list(self.messages), (sum(rewards) if rewards else None), done, info

    async def run_tool(self, call: dict[str, Any]) -> tuple[str, float | None]:
        """Run one parsed call: ``{"id", "name", "arguments"}`` (arguments: a dict, or the raw string that
        did not parse)."""
        tool = self.tool_map.get(call["name"])
        if tool is None:
            return json.dumps({"error": f"unknown tool {call['name']!r}"}), None
        if not isinstance(call["arguments"], dict):
            return json.dumps(
                {"error": f"arguments are not a JSON object: {str(call['arguments'])[:200]}"}
            ), None
        try:
            result = tool.execute(call["arguments"])
            if isinstance(result, Awaitable):
                result = await result
        except Exception as exc:  # noqa: BLE001 - a tool's failure is an observation, not a crash
            return json.dumps({"error": f"{type(exc).__name__}: {exc}"}), None
        self.tool_calls += 1
        text, reward = result if isinstance(result, tuple) else (result, None)
        self.well_formed_calls += not _is_error(str(text))
        return str(text), reward

    def score(self, answer: str) -> float:
        """The outcome of a final answer (1.0: right). Default: the last number equals
        ``reward_model["ground_truth"]`` (GSM8K style: ``#### 42`` or ``42``)."""
        truth = parse_number(str(self.reward_model.get("ground_truth", "")))
        return 1.0 if truth is not None and parse_number(answer) == truth else 0.0

    def outcome(self) -> RewardValue:
        return self.score(self.answer) if self.answer is not None else 0.0


# ---- parsing ----------------------------------------------------------------------------------------------

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def as_messages(prompt: Any) -> Observation:
    """A dataset prompt as chat messages: a list of ``{role, content}`` dicts, a JSON string of one, or
    text."""
    if prompt is None:
        return []
    if isinstance(prompt, str):
        try:
            decoded = json.loads(prompt)
        except ValueError:
            return [{"role": "user", "content": prompt}]
        prompt = decoded if isinstance(decoded, list) else prompt
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, (list, tuple)) or not all(isinstance(m, dict) and "role" in m for m in prompt):
        raise ValueError("prompt must be a string or a list of {role, content} messages")
    return [{k: v for k, v in m.items() if v is not None} for m in prompt]


def parse_tool_calls(message: Message) -> list[dict[str, Any]]:
    """``[{"id", "name", "arguments"}]`` from ``tool_calls``, else from hermes blocks in the content."""
    out = []
    for i, call in enumerate(message.get("tool_calls") or []):
        fn = call.get("function") or {}
        out.append(
            {
                "id": call.get("id") or f"call_{i}",
                "name": str(fn.get("name", "")),
                "arguments": _arguments(fn.get("arguments")),
                "raw": call,
            }
        )
    if out:
        return out
    for i, block in enumerate(_HERMES.findall(message.get("content") or "")):
        try:
            data = json.loads(block)
        except ValueError:
            data = {"name": "", "arguments": block}
        if not isinstance(data, dict):
            data = {"name": "", "arguments": block}
        out.append(
            {
                "id": f"call_{i}",
                "name": str(data.get("name", "")),
                "arguments": _arguments(data.get("arguments")),
            }
        )
    return out


def _arguments(raw: Any) -> Any:
    if isinstance(raw, dict):
        return raw
    if raw is None or raw == "":
        return {}
    try:
        value = json.loads(raw)
    except (TypeError, ValueError):
        return raw
    return value if isinstance(value, dict) else raw


def assistant_message(action: Message, calls: list[dict[str, Any]]) -> Message:
    """The assistant turn as it goes back into the history: as the model wrote it (tool calls included)."""
    msg: Message = {"role": "assistant", "content": action.get("content") or ""}
    if action.get("tool_calls"):
        msg["tool_calls"] = action["tool_calls"]
    return msg


def as_text(action: Message) -> str:
    """The assistant turn as the text a hermes model wrote: its content, then each of its ``tool_calls`` as a
    ``<tool_call>`` block (a server's tool parser takes them out of the content)."""
    parts = [action.get("content") or ""]
    for call in action.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = _arguments(fn.get("arguments"))
        parts.append(
            "<tool_call>\n" + json.dumps({"name": fn.get("name", ""), "arguments": args}) + "\n</tool_call>"
        )
    return "\n".join(p for p in parts if p)


def _is_error(text: str) -> bool:
    """A tool result that is an ``{"error": ...}`` object (what ``run_tool`` and the tools here return)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and "error" in value


def parse_number(text: str | None) -> float | None:
    """The last number in ``text`` (``1,234`` and ``#### 42`` forms included), or ``None``."""
    found = _NUMBER.findall(text or "")
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None
