"""The ``openai`` client bound to a session: ``OpenAI`` / ``AsyncOpenAI`` with the session's base URL and key.

    client = ADAPTER.bind(s)                 # openai.OpenAI
    aclient = ADAPTER.bind(s, async_=True)   # openai.AsyncOpenAI

Any extra keyword goes to the client constructor (``http_client``, ``max_retries``, ``timeout`` ...)."""

from __future__ import annotations

from typing import Any

from steptap.adapters.registry import Adapter


def bind(session: Any, *, async_: bool = False, **kw: Any) -> Any:
    import openai

    cls = openai.AsyncOpenAI if async_ else openai.OpenAI
    return cls(base_url=session.base_url, api_key=session.api_key, **kw)


ADAPTER = Adapter(
    name="openai",
    framework="openai",
    binder=bind,
    modules=("openai",),
    description="openai.OpenAI / AsyncOpenAI clients (async_=True) on the session",
)
