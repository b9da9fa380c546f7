"""The OpenAI Agents SDK (``openai-agents``): an ``OpenAIChatCompletionsModel`` on the session.

    model = ADAPTER.bind(s, model="my-model")
    agent = agents.Agent(name="a", instructions="...", tools=[...], model=model)
    result = await agents.Runner.run(agent, "question")

or, for every agent of a run, ``RunConfig(model_provider=provider(s))``.

The SDK's default model speaks the Responses API, which the proxy does not capture yet: these use chat
completions. Binding switches the SDK's tracing off (``set_tracing_disabled(True)``, global): by default it
uploads traces to OpenAI with the API key, which here is a session key that OpenAI rejects."""

from __future__ import annotations

from typing import Any

from steptap.adapters.registry import Adapter
from steptap.adapters.session import resolve_model


def _client(session: Any, client_kwargs: dict[str, Any] | None) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, **(client_kwargs or {}))


def bind(
    session: Any,
    *,
    model: str | None = None,
    client_kwargs: dict[str, Any] | None = None,
    tracing: bool = False,
) -> Any:
    """An ``OpenAIChatCompletionsModel`` whose ``AsyncOpenAI`` client is on the session."""
    from agents import OpenAIChatCompletionsModel, set_tracing_disabled

    if not tracing:
        set_tracing_disabled(True)
    return OpenAIChatCompletionsModel(
        model=resolve_model(session, model), openai_client=_client(session, client_kwargs)
    )


def provider(
    session: Any,
    *,
    model: str | None = None,
    client_kwargs: dict[str, Any] | None = None,
    tracing: bool = False,
) -> Any:
    """A ``ModelProvider`` for ``RunConfig(model_provider=...)``: every agent of the run, whatever model name
    it asks for, gets a chat-completions model on the session (``model`` when given, else the name it asked
    for)."""
    from agents import ModelProvider, OpenAIChatCompletionsModel, set_tracing_disabled

    if not tracing:
        set_tracing_disabled(True)
    client = _client(session, client_kwargs)

    class SessionModelProvider(ModelProvider):
        def get_model(self, model_name: str | None) -> Any:
            name = model or model_name or resolve_model(session, None)
            return OpenAIChatCompletionsModel(model=name, openai_client=client)

    return SessionModelProvider()


ADAPTER = Adapter(
    name="openai_agents",
    framework="openai-agents",
    binder=bind,
    modules=("agents", "openai"),
    description="OpenAI Agents SDK: OpenAIChatCompletionsModel on the session (tracing off)",
)
