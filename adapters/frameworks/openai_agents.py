"""The OpenAI Agents SDK (``openai-agents``): the SDK's default model (``OpenAIResponsesModel``, the Responses
API) on the session, or ``api="chat"`` for ``OpenAIChatCompletionsModel``.

    model = ADAPTER.bind(s, model="my-model")
    agent = agents.Agent(name="a", instructions="...", tools=[...], model=model)
    result = await agents.Runner.run(agent, "question")

or, for every agent of a run, ``RunConfig(model_provider=provider(s))``.

The proxy captures both APIs with exact token ids (``Step.endpoint`` is ``responses`` or
``chat.completions``). Binding switches the SDK's tracing off (``set_tracing_disabled(True)``, global): by
default it uploads traces to OpenAI with the API key, which here is a session key that OpenAI rejects."""

from __future__ import annotations

from typing import Any

from steptap.adapters.registry import Adapter
from steptap.adapters.session import resolve_model


def _client(session: Any, client_kwargs: dict[str, Any] | None) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, **(client_kwargs or {}))


def _model_class(api: str) -> Any:
    from agents import OpenAIChatCompletionsModel, OpenAIResponsesModel

    if api not in ("responses", "chat"):
        raise ValueError(f"api must be 'responses' or 'chat', got {api!r}")
    return OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel


def bind(
    session: Any,
    *,
    model: str | None = None,
    client_kwargs: dict[str, Any] | None = None,
    tracing: bool = False,
    api: str = "responses",
) -> Any:
    """The SDK's model (``api="responses"``, its default; ``"chat"``: chat completions) whose ``AsyncOpenAI``
    client is on the session."""
    from agents import set_tracing_disabled

    cls = _model_class(api)
    if not tracing:
        set_tracing_disabled(True)
    return cls(model=resolve_model(session, model), openai_client=_client(session, client_kwargs))


def provider(
    session: Any,
    *,
    model: str | None = None,
    client_kwargs: dict[str, Any] | None = None,
    tracing: bool = False,
    api: str = "responses",
) -> Any:
    """A ``ModelProvider`` for ``RunConfig(model_provider=...)``: every agent of the run, whatever model name
    it asks for, gets a model on the session (``model`` when given, else the name it asked for; the proxy's
    ``--any-model`` serves names the backend does not)."""
    from agents import ModelProvider, set_tracing_disabled

    cls = _model_class(api)

    if not tracing:
        set_tracing_disabled(True)
    client = _client(session, client_kwargs)

    class SessionModelProvider(ModelProvider):
        def get_model(self, model_name: str | None) -> Any:
            name = model or model_name or resolve_model(session, None)
            return cls(model=name, openai_client=client)

    return SessionModelProvider()


ADAPTER = Adapter(
    name="openai_agents",
    framework="openai-agents",
    binder=bind,
    modules=("agents", "openai"),
    description="OpenAI Agents SDK: its Responses model (or api='chat') on the session (tracing off)",
)
