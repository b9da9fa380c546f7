"""smolagents: an ``OpenAIServerModel`` bound to a session.

    model = ADAPTER.bind(s, model="my-model")
    agent = smolagents.ToolCallingAgent(tools=[...], model=model)

Extra keywords go to ``OpenAIServerModel``: ``client_kwargs`` to the ``openai`` client, the rest to every
completion call (``temperature``, ``extra_body`` ...)."""

from __future__ import annotations

from typing import Any

from steptap.adapters.registry import Adapter
from steptap.adapters.session import resolve_model


def bind(session: Any, *, model: str | None = None, **kw: Any) -> Any:
    from smolagents import OpenAIServerModel

    return OpenAIServerModel(
        model_id=resolve_model(session, model), api_base=session.base_url, api_key=session.api_key, **kw
    )


ADAPTER = Adapter(
    name="smolagents",
    framework="smolagents",
    binder=bind,
    modules=("smolagents", "openai"),
    description="smolagents.OpenAIServerModel on the session",
)
