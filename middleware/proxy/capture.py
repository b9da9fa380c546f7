"""Pure functions from vLLM replies to ``Step`` records, and the stripping that makes the agent's reply
exactly what vLLM would have sent it. No I/O here: ``forward`` does the talking, this module only reshapes
dicts.

A streamed reply is reduced to the shape of a non-streamed one (``accumulator.py``), so both modes go through
the same ``steps_from_reply`` and give identical steps.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from steptap.middleware.records import Sampling, Step, StepError, Usage

CHAT = "chat.completions"
COMPLETIONS = "completions"


class Asked(NamedTuple):
    """What the agent itself asked vLLM for; anything else we added is removed from its reply."""

    token_ids: bool
    logprobs: bool


# --- request side -------------------------------------------------------------------------------------------


_NO_DEFAULTS: dict[str, float] = {}


# Keys that constrain decoding beyond the scalars of ``Sampling`` (vLLM applies each as a logits processor or
# a grammar): recorded by name in ``Sampling.constraints``.
_CONSTRAINT_KEYS = (
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "bad_words", "allowed_token_ids", "logits_processors", "vllm_xargs",
)
_CONSTRAINT_SET = frozenset(_CONSTRAINT_KEYS)


def constraints_of(body: dict[str, Any]) -> list[str]:
    """The request keys (present and non-empty) that constrain decoding beyond temperature and truncation."""
    present = _CONSTRAINT_SET.intersection(body)  # one C pass; most calls name none (no loop over the keys)
    found = [k for k in _CONSTRAINT_KEYS if k in present and body[k]] if present else []
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        found.append("response_format")
    choice = body.get("tool_choice")
    if body.get("tools") and (choice == "required" or isinstance(choice, dict)):
        found.append("tool_choice")  # vLLM forces the call with a grammar
    return found


def sampling_of(body: dict[str, Any], forced: bool, defaults: dict[str, float] = _NO_DEFAULTS) -> Sampling:
    """The sampling parameters sent to vLLM (after forcing). A value the request omits is what vLLM applies:
    ``defaults`` (the model's generation_config, ``--model-dir``), else OpenAI's (temperature 1, top_p 1,
    top_k disabled, no penalties). The body's types were checked at the edge (``validate``)."""
    get, default = body.get, defaults.get  # straight-line: no loop, dict or ** on every model call
    top_k = get("top_k", default("top_k"))
    max_tokens = get("max_completion_tokens", get("max_tokens"))
    bias = get("logit_bias")
    temperature, top_p = get("temperature", default("temperature")), get("top_p", default("top_p"))
    min_p, presence = get("min_p", default("min_p")), get("presence_penalty", default("presence_penalty"))
    frequency = get("frequency_penalty", default("frequency_penalty"))
    repetition = get("repetition_penalty", default("repetition_penalty"))
    return Sampling(  # a value neither the request nor the defaults set is the neutral one
        temperature=1.0 if temperature is None else float(temperature),
        top_p=1.0 if top_p is None else float(top_p),
        min_p=0.0 if min_p is None else float(min_p),
        presence_penalty=0.0 if presence is None else float(presence),
        frequency_penalty=0.0 if frequency is None else float(frequency),
        repetition_penalty=1.0 if repetition is None else float(repetition),
        top_k=-1 if top_k is None or top_k <= 0 else int(top_k),
        max_tokens=None if max_tokens is None else int(max_tokens),
        forced=forced,
        min_tokens=int(body.get("min_tokens") or 0),
        logit_bias={str(k): float(v) for k, v in bias.items()} if isinstance(bias, dict) else {},
        constraints=constraints_of(body),
    )


# --- reply side: stripping --------------------------------------------------------------------------------
# vLLM serializes absent values as explicit nulls (non-streamed: model_dump(); streamed: the fields it set),
# so stripping sets a present key to None rather than deleting it: the bytes then match a direct call.


def strip_reply(reply: dict[str, Any], asked: Asked, endpoint: str) -> None:
    """Remove (in place) from a non-streamed reply what the agent did not ask for. Runs on every streamed
    chunk too: no helper calls (three a chunk, before: bench/call_counts.py)."""
    ids, logprobs = asked.token_ids, asked.logprobs
    if not ids and reply.get("prompt_token_ids") is not None:
        reply["prompt_token_ids"] = None
    for choice in reply.get("choices") or ():
        if not ids:
            if choice.get("token_ids") is not None:
                choice["token_ids"] = None
            if endpoint == COMPLETIONS and choice.get("prompt_token_ids") is not None:
                choice["prompt_token_ids"] = None
        if not logprobs and choice.get("logprobs") is not None:
            choice["logprobs"] = None


def strip_chunk(chunk: dict[str, Any], asked: Asked, endpoint: str) -> bool:
    """Strip one SSE chunk in place; False when vLLM would not have sent it at all (a chunk it emits only to
    carry token ids or logprobs, e.g. while the tool parser holds text back)."""
    strip_reply(chunk, asked, endpoint)
    if asked.token_ids or asked.logprobs or endpoint != CHAT:
        return True
    choices = chunk.get("choices")
    if not choices or chunk.get("usage"):
        return True
    for choice in choices:  # a loop, not any(): no generator per chunk
        if choice.get("finish_reason") is not None or choice.get("delta"):
            return True
    return False


# --- reply side: steps ------------------------------------------------------------------------------------


def _choice_logprobs(choice: dict[str, Any], endpoint: str) -> list[float] | None:
    lp = choice.get("logprobs")
    if not lp:
        return None
    if endpoint == CHAT:
        content = lp.get("content")
        if content is None:
            return None
        return [float(item["logprob"]) for item in content]
    values = lp.get("token_logprobs")
    if values is None:
        return None
    return [float("nan") if v is None else float(v) for v in values]


def _response_of(choice: dict[str, Any], endpoint: str) -> dict[str, Any]:
    if endpoint != CHAT:
        return {"text": choice.get("text")}
    msg = choice.get("message") or {}
    return message_response(
        msg.get("role", "assistant"), msg.get("content"), msg.get("tool_calls"),
        msg.get("reasoning_content", msg.get("reasoning")),
    )


def message_response(role: Any, content: Any, tool_calls: Any, reasoning: Any) -> dict[str, Any]:
    """``Step.response`` of a chat choice: the assistant message's content, tool calls and reasoning."""
    out: dict[str, Any] = {"role": role, "content": content}
    if tool_calls:
        out["tool_calls"] = tool_calls
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    return out


def steps_from_reply(reply: dict[str, Any], endpoint: str, **common: Any) -> list[Step]:
    """One ``Step`` per choice of a (non-streamed, or reassembled) vLLM reply. ``common`` holds the fields
    every choice shares (request, sampling, model, timings...). Token ids and logprobs are vLLM's own; a reply
    that lacks them gives a failed step (the agent still gets its answer). ``replies.py`` builds the same
    steps from a typed view."""
    steps: list[Step] = []
    top_prompt = reply.get("prompt_token_ids")
    for choice in reply.get("choices") or ():
        prompt = top_prompt if endpoint == CHAT else choice.get("prompt_token_ids")
        if steps and prompt is not None and prompt == steps[-1].prompt_token_ids:
            prompt = steps[-1].prompt_token_ids  # one list for a call's choices (as sessions count them)
        steps.append(make_step(
            endpoint,
            int(choice.get("index", 0)),
            prompt,
            choice.get("token_ids"),
            _choice_logprobs(choice, endpoint),
            choice.get("finish_reason"),
            _response_of(choice, endpoint),
            common,
        ))
    steps.sort(key=lambda s: s.choice)
    return steps


def stop_reason(reply: dict[str, Any]) -> Any:
    """vLLM's ``stop_reason`` of a reply's first choice: a stop string, a stop token id, or None."""
    choices = reply.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    return first.get("stop_reason") if isinstance(first, dict) else None


def make_step(
    endpoint: str,
    index: int,
    prompt: list[int] | None,
    ids: list[int] | None,
    logprobs: list[float] | None,
    finish_reason: str | None,
    response: dict[str, Any],
    common: dict[str, Any],
) -> Step:
    """The step of one choice; a failed one when token ids or logprobs are missing or do not match."""
    error = None
    if prompt is None or ids is None:
        error = StepError(message="backend reply carries no token ids (return_token_ids)",
                          type="capture_error")
    elif logprobs is None or len(logprobs) != len(ids):
        error = StepError(
            message=f"backend gave {len(logprobs or ())} logprobs for {len(ids)} tokens", type="capture_error"
        )
    prompt = prompt or []
    ids = ids or []
    return Step(
        choice=index,
        endpoint=endpoint,
        prompt_token_ids=prompt,
        response_token_ids=ids,
        response_logprobs=logprobs or [],
        finish_reason=finish_reason,
        response=response,
        status="ok" if error is None else "failed",
        error=error,
        usage=Usage(prompt_tokens=len(prompt), completion_tokens=len(ids),
                    total_tokens=len(prompt) + len(ids)),
        **common,
    )


def failed_step(
    endpoint: str, message: str, type_: str, partial: dict[str, Any] | None = None, **common: Any
) -> Step:
    """A step for a call that failed (cut stream, timeout, hang-up), keeping what arrived before it."""
    steps = steps_from_reply(partial, endpoint, **common) if partial else []
    step = steps[0] if steps else Step(endpoint=endpoint, **common)
    step.status = "failed"
    step.error = StepError(message=message, type=type_)
    return step
