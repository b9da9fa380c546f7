"""LiteLLM: the session as an OpenAI-compatible provider (model ``openai/<name>``, ``api_base``, ``api_key``).

    llm = ADAPTER.bind(s, model="my-model")
    reply = llm.completion(messages=[...])            # litellm.completion(**llm.params, messages=...)
    reply = await llm.acompletion(messages=[...])

``llm.params`` is the plain dict, for code (or frameworks) that call LiteLLM themselves."""

from __future__ import annotations

from typing import Any

from steptap.adapters.registry import Adapter
from steptap.adapters.session import resolve_model


class LiteLLMBinding:
    """LiteLLM's ``completion`` / ``acompletion`` with the session's provider parameters filled in."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.params = params

    @property
    def model(self) -> str:
        return self.params["model"]

    def completion(self, **kw: Any) -> Any:
        import litellm

        return litellm.completion(**{**self.params, **kw})

    async def acompletion(self, **kw: Any) -> Any:
        import litellm

        return await litellm.acompletion(**{**self.params, **kw})

    def __repr__(self) -> str:
        return f"LiteLLMBinding(model={self.model!r}, api_base={self.params['api_base']!r})"


def bind(session: Any, *, model: str | None = None, **kw: Any) -> LiteLLMBinding:
    """``kw`` become defaults of every call (``temperature``, ``extra_body``, ``client`` ...)."""
    import litellm  # noqa: F401 - fail at bind time, not at the first call, when it is missing

    name = resolve_model(session, model)
    if not name.startswith("openai/"):
        name = "openai/" + name  # LiteLLM's provider prefix for any OpenAI-compatible server
    return LiteLLMBinding({"model": name, "api_base": session.base_url, "api_key": session.api_key, **kw})


ADAPTER = Adapter(
    name="litellm",
    framework="litellm",
    binder=bind,
    modules=("litellm",),
    description="LiteLLM completion/acompletion with model openai/<name> and api_base on the session",
)
