"""LangChain / LangGraph: a ``langchain_openai.ChatOpenAI`` bound to a session.

    llm = ADAPTER.bind(s, model="my-model", temperature=0.7)
    agent = langgraph.prebuilt.create_react_agent(llm, tools)

The chat model is all LangGraph needs: graphs and prebuilt agents call it like any other. Extra keywords go
to ``ChatOpenAI`` (``extra_body``, ``max_tokens``, ``http_client`` ...). The Responses API is switched off
(the proxy captures chat completions)."""

from __future__ import annotations

from typing import Any

from steptap.adapters.registry import Adapter
from steptap.adapters.session import resolve_model


def bind(session: Any, *, model: str | None = None, **kw: Any) -> Any:
    from langchain_openai import ChatOpenAI

    kw.setdefault("use_responses_api", False)
    return ChatOpenAI(
        model=resolve_model(session, model), base_url=session.base_url, api_key=session.api_key, **kw
    )


ADAPTER = Adapter(
    name="langchain",
    framework="langchain-openai",
    binder=bind,
    modules=("langchain_openai",),
    description="langchain_openai.ChatOpenAI on the session (LangChain chains, LangGraph agents)",
)
