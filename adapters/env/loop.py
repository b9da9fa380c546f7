"""Driving a model through the proxy: ``AgentFlowBase`` (full control) and ``AgentEnvLoop`` (an environment).

A flow runs one episode inside one steptap session. Its ``FlowContext`` makes model calls on that session
(``await ctx.chat(messages, tools=...)``: each call is one recorded step) and attaches process rewards to the
step just recorded (``await ctx.reward_step(0.1)``). The flow returns the trajectory reward (a number or named
parts) and an info dict; the runner finishes the session with it.

    class MyFlow(AgentFlowBase):                    # full control: build prompts, call the model, branch
        async def run(self, ctx, *, prompt, reward_model, **env_kwargs):
            reply = await ctx.chat([{"role": "user", "content": "..."}])
            return (1.0 if "yes" in reply.get("content", "") else 0.0), {}

``AgentEnvLoop(env)`` is the generic flow over an ``AgentEnv``: reset, then model call and ``env.step`` until
``done`` or ``max_steps``, each step's reward attached to its model call through the control API.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import aiohttp

from steptap.adapters.env.base import AgentEnv, Message, RewardValue

MAX_REPLY_BYTES = 16 << 20  # a chat completion larger than this is refused, not buffered


class ModelCallError(RuntimeError):
    """The proxy refused or failed a model call (its OpenAI error message is kept)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"model call failed ({status}): {message}")
        self.status = status


class FlowContext:
    """What a flow gets for one episode: model calls and process rewards on its session."""

    def __init__(
        self, http: aiohttp.ClientSession, session: Any, model: str, defaults: dict[str, Any]
    ) -> None:
        self.http = http
        self.session = session  # steptap.adapters.AsyncSession: id, base_url, api_key, reward_step
        self.model = model
        self.defaults = dict(defaults)  # max_tokens, temperature, ... for every call
        self.calls = 0
        self.step_rewards: list[RewardValue] = []

    async def chat(
        self, messages: list[Message], *, tools: list[dict[str, Any]] | None = None, **params: Any
    ) -> Message:
        """One chat completion on the session; returns the assistant message (``content``, ``tool_calls``).
        ``params`` are request fields (``extra_body`` is merged into the body, as the openai client does)."""
        body: dict[str, Any] = {"model": self.model, "messages": messages, **self.defaults}
        extra = params.pop("extra_body", None) or {}
        body.update(params)
        body.update(extra)
        if tools:
            body["tools"] = tools
            body.setdefault("tool_choice", "auto")
        self.calls += 1
        self.step_rewards.append(None)
        async with self.http.post(
            self.session.base_url.rstrip("/") + "/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {self.session.api_key}"},
        ) as resp:
            raw = await resp.content.read(MAX_REPLY_BYTES + 1)
            if len(raw) > MAX_REPLY_BYTES:
                raise ModelCallError(resp.status, f"reply larger than {MAX_REPLY_BYTES} bytes")
            if resp.status >= 400:
                raise ModelCallError(resp.status, _error_message(raw))
        try:
            message = json.loads(raw)["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ModelCallError(resp.status, f"not a chat completion: {raw[:200]!r}") from exc
        return {k: v for k, v in message.items() if v is not None and k != "refusal"}

    async def reward_step(self, value: RewardValue, name: str = "process") -> None:
        """Attach a process reward to the step recorded last (a number, or named parts)."""
        if value is None:
            return
        parts = value if isinstance(value, dict) else {name: float(value)}
        for part, v in parts.items():
            await self.session.reward_step(float(v), step="last", name=part)
        if self.step_rewards:
            self.step_rewards[-1] = value


def _error_message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace")[:500]


class AgentFlowBase:
    """Full control over one episode: subclasses implement ``run``.

    ``async run(ctx, *, prompt, reward_model, **env_kwargs) -> (reward, info)``: ``reward`` is the trajectory
    reward (a number, named parts, or ``None``); ``info["correct"]`` (a bool) is what ``steptap eval`` counts.
    """

    async def run(
        self,
        ctx: FlowContext,
        *,
        prompt: Any = None,
        reward_model: dict[str, Any] | None = None,
        **env_kwargs: Any,
    ) -> tuple[RewardValue, dict[str, Any]]:
        raise NotImplementedError


class AgentEnvLoop(AgentFlowBase):
    """The generic loop over an ``AgentEnv`` (a fresh one per episode from ``env_factory``)."""

    def __init__(self, env_factory: Callable[[], AgentEnv], *, max_steps: int | None = None) -> None:
        self.env_factory = env_factory
        self.max_steps = max_steps

    async def run(
        self,
        ctx: FlowContext,
        *,
        prompt: Any = None,
        reward_model: dict[str, Any] | None = None,
        **env_kwargs: Any,
    ) -> tuple[RewardValue, dict[str, Any]]:
        env = self.env_factory()
        observation = env.reset(prompt=prompt, reward_model=reward_model, **env_kwargs)
        max_steps = self.max_steps or env.max_steps
        info: dict[str, Any] = {}
        done = False
        turn = 0
        while turn < max_steps and not done:
            action = await ctx.chat(observation, tools=env.tools(), **env.request_options(turn))
            observation, reward, done, info = await env.step(action)
            await ctx.reward_step(reward, name=env.step_reward_name)
            turn += 1
        info = {**info, "turns": turn, "truncated": not done}
        return env.outcome(), info


__all__ = ["AgentEnvLoop", "AgentFlowBase", "FlowContext", "ModelCallError"]
