"""Edge validation of model-call bodies: the types of the keys the proxy reads, checked before anything is
forwarded, opened or recorded.

A small typed view (a ``msgspec.Struct``) of only the keys the proxy (and the record) reads is converted from
the already-decoded body; every other key is left alone, and the agent's body is forwarded as it came. A wrong
type or a value out of range is a 400 in OpenAI's error body, so nothing a writer accepts can later be
unreadable (a ``{"model": 1}`` written into ``Step.model`` used to stop every log reader). Other protocols
(``/v1/responses``, ``/v1/messages``) call ``check`` with a view of their own.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import msgspec

from steptap.middleware.errors import ApiError

T = TypeVar("T", bound=msgspec.Struct)

_Stop = str | list[str] | None


class _Sampling(msgspec.Struct, kw_only=True):
    """What changes the sampling distribution or the number of steps: recorded in ``Step.sampling``."""

    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    stop: _Stop = None
    seed: int | None = None


class ChatView(_Sampling, kw_only=True):
    model: str | None = None
    stream: bool | None = None
    # messages (a list of objects) is checked by hand: converting a long history would copy every message
    logprobs: bool | None = None
    top_logprobs: int | None = None
    return_token_ids: bool | None = None


class CompletionView(_Sampling, kw_only=True):
    model: str | None = None
    stream: bool | None = None
    prompt: str | list[str | int | list[int]] | None = None  # text, ids, or a batch of either
    logprobs: int | None = None
    echo: bool | None = None
    return_token_ids: bool | None = None


def check(body: dict[str, Any], view: type[T]) -> T:
    """``body`` as ``view``, or a 400 naming the first key of a wrong type (``$.model``,
    ``$.messages[0]``)."""
    try:
        return msgspec.convert(body, view)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid request: {exc}", "invalid_request_body") from None


_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_COUNTS = ("max_tokens", "max_completion_tokens", "min_tokens")


def check_sampling(view: _Sampling, max_n: int) -> None:
    """Ranges the proxy relies on: finite numbers, ``n`` in ``[1, max_n]``, non-negative token counts."""
    if view.n is not None and not 1 <= view.n <= max_n:
        raise ApiError(400, f"n must be between 1 and {max_n}, got {view.n}", "invalid_n")
    floats = (view.temperature, view.top_p, view.min_p, view.presence_penalty, view.frequency_penalty,
              view.repetition_penalty)
    # One C pass on every call (a sum of finite values is finite unless it overflows); the names only when
    # it is not: a loop over six getattrs was a tenth of the edge check's bytecode
    if not math.isfinite(sum(filter(None, floats))):
        for name, value in zip(_FLOATS, floats, strict=True):
            if value is not None and not math.isfinite(value):
                raise ApiError(400, f"{name} must be a finite number, got {value}", "invalid_sampling")
    if view.logit_bias and not math.isfinite(sum(view.logit_bias.values())):
        for v in view.logit_bias.values():
            if not math.isfinite(v):
                raise ApiError(400, "logit_bias values must be finite numbers", "invalid_sampling")
    counts = (view.max_tokens, view.max_completion_tokens, view.min_tokens)
    if min(filter(None, counts), default=0) < 0:
        for name, value in zip(_COUNTS, counts, strict=True):
            if value is not None and value < 0:
                raise ApiError(400, f"{name} must not be negative, got {value}", "invalid_sampling")


def _not_objects() -> ApiError:
    return ApiError(400, "invalid request: `messages` must be a list of objects", "invalid_request_body")


def check_model_call(body: dict[str, Any], chat: bool, max_n: int) -> ChatView | CompletionView:
    """The edge check of ``/v1/chat/completions`` (``chat``) and ``/v1/completions`` bodies."""
    view: ChatView | CompletionView = check(body, ChatView) if chat else check(body, CompletionView)
    if chat:
        messages = body.get("messages")
        if messages is not None:
            if not isinstance(messages, list):
                raise _not_objects()
            for m in messages:  # a loop, not all() over a generator: one resume a message on every call
                if not isinstance(m, dict):
                    raise _not_objects()
    check_sampling(view, max_n)
    return view
