"""Token-in-token-out (TITO) mode: a multi-turn trajectory as one exact token sequence.

In normal mode every turn is rendered again from the messages, and the template may render the model's own
earlier reply as other tokens than it sampled (re-serialized tool-call JSON, dropped reasoning), which breaks
the sequence. In TITO mode, when a turn's messages extend the previous turn's (its messages + the assistant
reply as returned + new messages), the prompt is built from tokens:

    previous prompt ids + previous response ids + template tail after the turn's end token + new messages' ids

and sent to vLLM as token ids: to ``/inference/v1/generate``, the reply derendered by vLLM (tool parser
applied, ``/v1/chat/completions/derender``) into the chat reply the agent expects; a streamed turn, where it
can, to the chat route with the ids as its prompt (``Turn.stream``). The new messages' ids come from vLLM's
render route: the difference between rendering a fixed two-message conversation with and without them, so
the template decides how they open and close (no tokenizer here). These need vLLM's ``--enable-scale-out``.

Reasoning: the previous reply's tokens hold its reasoning as sampled (``<think>...</think>``), which the
template may render otherwise or drop. The replayed reply may carry it back as text (chat ``reasoning``, a
Messages thinking block, a Responses reasoning item) and as the opaque value the proxy gave it (a handle
naming the step: ``translation.reasoning_handle``). The logged tokens are spliced back only when the replay
vouches for them: a handle naming that step of this session, or the reasoning text as logged. Else the turn is
rendered: an opaque value from elsewhere (``handle_foreign``), a handle naming another step or session
(``handle_unknown``), changed reasoning text (``reasoning_edited``), or reasoning left out with no handle
(``reasoning_dropped``).

Stops the agent names: a reply cut by a stop string or a stop token id need not end a turn, and the proxy adds
no end token the model never sampled: the next turn is rendered (``reply_stop_string``, ``reply_stop_token``),
as is a call asking for stop strings (``stop_strings``: vLLM's derender does not cut the text at them).

When the history is not append-only (edited, summarised, tools changed, a reply cut by max_tokens), the turn
is rendered as normal, counted by cause (``steptap_tito_turns{path}``), named in the step's notes. Which turn
extends, and what it leaves for the next: ``proxy/tito_plan.py``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec

from steptap.middleware.backend.boundary import Backend, BackendStream
from steptap.middleware.backend.client import Parts, json_parts
from steptap.middleware.exceptions import BackendError, BackendMalformed, BackendStatus
from steptap.middleware.proxy import derender, prompts
from steptap.middleware.proxy.tito_plan import Plan, next_state, plan
from steptap.middleware.records import Step, json_encoder
from steptap.middleware.weights.spans import Spans

if TYPE_CHECKING:
    from steptap.middleware.proxy.call_state import CallState
    from steptap.middleware.sessions.session import LiveSession

_decode = msgspec.json.decode
_encode = json_encoder.encode

# A fixed conversation that ends with an assistant turn: what the template puts after it for new messages is
# what it would put after any assistant turn.
_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
_NOT_RENDERED = ("stream", "stream_options", "n")
# What no chat template reads (sampling; the messages are the base's): a base render is held under the rest
_NOT_TEMPLATE = frozenset({*_NOT_RENDERED, "messages", "max_tokens", "max_completion_tokens", "temperature",
                           "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "logprobs",
                           "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
                           "structured_outputs", "logit_bias", "ignore_eos", "min_tokens", "return_token_ids",
                           "metadata", "user"})
_TAIL_MAX = 4  # tokens a template may put after an assistant turn's end token (ChatML: one newline)


def _after_base(base: list[int], ids: list[int], end: int) -> tuple[list[int], list[int]] | None:
    """(the template's tail after the assistant turn's end token, the new messages' ids) from the render of
    the base conversation alone (``base``) and with the new messages (``ids``); None when they do not line up.
    The assistant turn ends at the same count of ``end`` tokens in both, though a template may render it
    otherwise once messages follow (Qwen3-style templates drop the reasoning of turns before the last user
    query)."""
    at = [i for i, t in enumerate(base) if t == end]
    if not at or len(base) - at[-1] - 1 > _TAIL_MAX:
        return None
    tail = base[at[-1] + 1:]
    seen = [i for i, t in enumerate(ids) if t == end]
    if len(seen) < len(at):
        return None
    start = seen[len(at) - 1] + 1
    if ids[start:start + len(tail)] != tail:
        return None
    return tail, ids[start + len(tail):]


async def post_json(client: Backend, endpoint: str, body: dict[str, Any] | Parts) -> dict[str, Any]:
    """A JSON call to one of vLLM's render/generate routes; an error answer is the client's
    ``BackendStatus``."""
    reply: dict[str, Any] = _decode(await client.post_json(endpoint, body))  # these routes answer an object
    return reply


async def render(client: Backend, chat: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """vLLM's render of a chat body (``token_ids``: the prompt exactly as a chat call would see it), with
    ``changes`` applied to the body."""
    body = {k: v for k, v in chat.items() if k not in _NOT_RENDERED}
    body.update(changes)
    return await post_json(client, "chat.render", body)


class Turn:
    """One TITO turn against the backend: build the prompt ids, generate, derender."""

    def __init__(self, client: Backend, chat: dict[str, Any], plan: Plan,
                 held: tuple[bytes, list[int]] | None = None,
                 base: tuple[bytes, list[int]] | None = None) -> None:
        self.client = client
        self.held = held  # the session's latest prompt, its JSON and ids (CallState.prompt)
        # The base conversation's render, by the body it was rendered with (messages aside): the same for
        # every turn of a session that keeps its tools and settings, so rendered once, not every turn (with
        # an agent's tools, tens of thousands of tokens for vLLM to render)
        self.base = base
        self.chat = chat  # the patched chat body (logprobs and token ids on)
        self.plan = plan
        # The session's spare list and the list it is a prefix of (CallState.tito_spare), for ``_grow``
        self.spare: tuple[list[int], list[int]] | None = None
        self.prompt: list[int] = []
        self.added: list[int] = []  # the prompt after the previous reply (``request``)
        self.spans: Spans | None = None  # told vLLM's per-token weight versions (weights/spans.py)
        # Whether a keep swap's split is the count of tokens the relay passed on (a stream on the chat route);
        # else vLLM's weight_versions tell it (weights/spans.py)
        self.counted = False
        # The prompt ids and the chat body, JSON-encoded once: every generate and derender body (one per chunk
        # when streamed) carries them, and at 120k ids each encode cost more than the rest of the body; they
        # go out as they are (``Parts``), never copied into a body
        self._raw: dict[str, tuple[Any, bytes]] = {}  # name -> (the value encoded, its JSON)
        self._stream_state: Any = None  # a streamed derender's state, carried from call to call
        self._echoed = False  # a stream's first chunk carries the prompt's ids, once

    def _json(self, name: str, value: Any) -> bytes:
        held = self._raw.get(name)
        if held is None or held[0] is not value:
            held = self._raw[name] = (value, _encode(value))
        return held[1]

    def encoded_prompt(self) -> tuple[bytes, list[int]]:
        """The prompt's JSON and its ids (what a stream's first chunk echoes: ``prompts.take_echo``)."""
        return self._json("prompt", self.prompt), self.prompt

    async def _post(self, endpoint: str, body: dict[str, Any] | Parts) -> dict[str, Any]:
        return await post_json(self.client, endpoint, body)

    def _generate_body(self, generate: dict[str, Any]) -> Parts:
        return json_parts({"token_ids": self._json("prompt", generate["token_ids"])},
                          {k: v for k, v in generate.items() if k != "token_ids"})

    async def _render(self, messages: list[dict[str, Any]], generation: bool) -> dict[str, Any]:
        return await render(self.client, self.chat, messages=messages, add_generation_prompt=generation,
                            continue_final_message=False)

    async def request(self, stream: bool) -> dict[str, Any] | None:
        """The generate request, or None when the template does not append (fall back)."""
        state = self.plan.state
        assert state is not None
        full = await self._render(_BASE + self.plan.new, True)
        key = _encode({k: v for k, v in self.chat.items() if k not in _NOT_TEMPLATE})
        if self.base is None or self.base[0] != key:
            self.base = (key, (await self._render(_BASE, False))["token_ids"])
        base = self.base[1]
        ids = full["token_ids"]
        end = state.response_ids[-1]  # the token that ended the reply (its stop token)
        split = _after_base(base, ids, end)
        if split is None:
            return None
        tail, added = split
        # A streamed derender gets only this: vLLM's reasoning parsers look back to the prompt's last marker
        # (when spliced, an earlier reply's end of reasoning) and would take the reply for content
        self.added = tail + added
        rest = state.response_ids + self.added  # short: the long prompt list is built once, not thrice
        self.prompt = self._grow(state.prompt_ids, rest)
        if self.held is not None and self.held[1] is state.prompt_ids:  # its JSON continued, not re-encoded
            self._raw["prompt"] = (self.prompt, prompts.grown_json(self.held, rest))
        params = dict(full["sampling_params"])
        if self.chat.get("max_tokens") is None and self.chat.get("max_completion_tokens") is None:
            # render's default is the context left after its own (shorter) prompt
            params["max_tokens"] = params["max_tokens"] + len(ids) - len(self.prompt)
            if params["max_tokens"] < 1:
                return None
        params["logprobs"] = max(0, int(params.get("logprobs") or 0))
        out = {**full, "token_ids": self.prompt, "sampling_params": params, "stream": stream}
        if stream:
            out["stream_options"] = {"include_usage": True}
        return out

    def _grow(self, old: list[int], rest: list[int]) -> list[int]:
        """``old + rest`` as a new list. At 120k ids, copying ``old`` (and freeing the list two turns old)
        touched every id object a turn: ~0.5 ms with cold caches. So the list the previous turn was built
        from, which is ``old``'s prefix and dead once that turn is done, is grown in place instead: only
        what the last two turns added is copied. Dead means no reference but the ones here: any other
        holder (a step kept somewhere, a turn in flight on the same state) gets a copy, as before."""
        spare, self.spare = self.spare, None
        if spare is not None:
            ids, of = spare
            del spare  # the pair's reference: ``ids`` is left with this frame's and getrefcount's argument's
            if of is old and sys.getrefcount(ids) == 2 and len(ids) <= len(old):
                ids += old[len(ids):]
                ids += rest
                return ids
        return old + rest

    def _report(self, gen_choice: dict[str, Any]) -> None:
        # generate's weight_versions (the final output only): where a keep swap split this choice, exactly
        if self.spans is not None and gen_choice.get("weight_versions"):
            self.spans.report(gen_choice.get("index", 0), gen_choice["weight_versions"])

    def _derender_body(self, prompt: bytes, **fields: Any) -> Parts:
        held = self._raw.get("chat")
        if held is None or held[0] is not self.chat:  # encoded once a turn, cut to what derender reads
            held = self._raw["chat"] = (self.chat, _encode(derender.chat_request(self.chat)))
        return json_parts({"prompt_token_ids": prompt, "chat_request": held[1]},
                          {"model": self.chat.get("model"), **fields})

    async def reply(self, generate: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed turn: the chat reply, with the prompt and response ids vLLM generated with."""
        gen = await self._post("generate", self._generate_body(generate))
        chat = {**self.chat, "stream": False}
        chat.pop("stream_options", None)
        self.chat = chat
        reply = await self._post("chat.derender", self._derender_body(  # reads the prompt's last ids only
            _encode(self.prompt[-derender.PROMPT_TAIL:]), generate_response=derender.without_eos(gen)))
        reply["prompt_token_ids"] = self.prompt
        # derender knows no prompt (its usage says 0 tokens): agents size their context by this
        done = sum(len(g.get("token_ids") or ()) for g in gen.get("choices") or ())
        reply["usage"] = {**(reply.get("usage") or {}), "prompt_tokens": len(self.prompt),
                          "completion_tokens": done, "total_tokens": len(self.prompt) + done}
        for choice, g in zip(reply.get("choices") or (), gen.get("choices") or (), strict=False):
            choice["token_ids"] = g.get("token_ids")
            choice["stop_reason"] = g.get("stop_reason")  # what ended it, as a chat reply says
            self._report(g)
            if g.get("logprobs") and g["logprobs"].get("content") is not None:
                # the sampled tokens' logprobs as vLLM computed them (derender copies them as text tokens)
                choice["logprobs"] = derender.chat_logprobs(choice.get("logprobs"), g["logprobs"]["content"])
        return reply

    @contextlib.asynccontextmanager
    async def stream(self, generate: dict[str, Any], metrics: Any) -> AsyncIterator[BackendStream]:
        """A streamed turn's source, a ``BackendStream`` as a plain call's (the relay reads both alike),
        counted by route: vLLM's chat route on the ids unless vLLM would render or they hold an earlier
        reply's reasoning (``request``); else generate and derender (``chunks``)."""
        route = ("derender_content" if not derender.takes_ids(self.chat) else "derender_reasoning"
                 if self.plan.state is None or self.plan.state.reasoned else "chat")
        metrics.child(metrics.tito_streams, route).inc()
        self.counted = route == "chat"
        if route != "chat":
            yield BackendStream(200, self.chunks(generate))
            return
        ids = b'{"prompt_token_ids":' + self._json("prompt", self.prompt) + b"}"
        # the history cut to what vLLM reads of it there: it renders nothing (derender.chat_request)
        body = {k: v for k, v in derender.chat_request(self.chat, last=True).items()
                if k != "kv_transfer_params"}
        async with await self.client.stream("chat.completions",
                                            json_parts({"kv_transfer_params": ids}, body)) as source:
            await source.raise_for_status()
            yield source

    async def chunks(self, generate: dict[str, Any]) -> AsyncGenerator[list[bytes], None]:
        """A streamed turn: the chat SSE lines (``data: {chunk}``), one batch per generate chunk. A malformed
        answer ends it as ``BackendMalformed`` (the relay records the failure and ends the agent's stream)."""
        try:
            async for batch in self._chunks(generate):
                yield batch
        except (msgspec.DecodeError, KeyError, TypeError, AttributeError) as exc:
            raise BackendMalformed(f"backend {self.client.name} sent a malformed token-in-token-out answer: "
                                   f"{exc!r}") from None

    async def _chunks(self, generate: dict[str, Any]) -> AsyncIterator[list[bytes]]:
        async with await self.client.stream("generate", self._generate_body(generate)) as source:
            await source.raise_for_status()
            async for lines in source:  # all that came while the last derender was out
                gens: list[dict[str, Any]] = []
                done = False  # [DONE] is the stream's last event: it goes after what it follows
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                    elif (gen := _decode(payload)).get("choices"):  # not the usage chunk (ids count tokens)
                        gens.append(gen)
                out = [await self._derender_chunk(derender.merge(gens))] if gens else []
                yield out + [b"data: [DONE]"] if done else out

    async def _derender_chunk(self, gen: dict[str, Any]) -> bytes:
        """One chat SSE line for one generate chunk (or several merged), through a streamed derender."""
        derendered = await self._post("chat.derender", self._derender_body(
            self._json("added", self.added), stream=True, generate_chunk=derender.without_eos(gen),
            stream_state=self._stream_state))
        self._stream_state = derendered["stream_state"]
        chunk = derendered["chunk"]
        if not self._echoed:
            chunk["prompt_token_ids"] = msgspec.Raw(self._json("prompt", self.prompt))  # once
            self._echoed = True
        for g in gen["choices"]:
            self._report(g)
        for choice, g in zip(chunk.get("choices") or (), gen["choices"], strict=False):
            choice["token_ids"] = g.get("token_ids")
            if g.get("finish_reason") is not None:
                choice["stop_reason"] = g.get("stop_reason")
            if g.get("logprobs") and g["logprobs"].get("content") is not None:
                choice["logprobs"] = derender.chat_logprobs(choice.get("logprobs"), g["logprobs"]["content"])
        if not chunk.get("choices") and gen["choices"]:
            chunk["choices"] = [{"index": g["index"], "delta": {}, "token_ids": g.get("token_ids"),
                                 "logprobs": derender.chat_logprobs(
                                     None, (g.get("logprobs") or {}).get("content") or []),
                                 "finish_reason": g.get("finish_reason"), "stop_reason": g.get("stop_reason")}
                                for g in gen["choices"]]
        return b"data: " + _encode(chunk)


def backend_error(name: str, exc: BackendStatus) -> BackendError:
    try:
        message = _decode(exc.body)["error"]["message"]
    except (msgspec.DecodeError, KeyError, TypeError):
        message = exc.body[:200].decode("utf-8", "replace")
    return BackendError(f"backend {name} answered {exc.status} on a token-in-token-out route "
                        f"(is it started with --enable-scale-out?): {message}")


async def start_turn(session: LiveSession, state: CallState, chat: dict[str, Any], client: Backend,
                     metrics: Any, stream: bool, handles: dict[int, str] | None = None
                     ) -> tuple[Turn, dict[str, Any]] | str:
    """The turn and its generate request when this call extends the session's previous turn (``state``: what
    the proxy holds for the session); else the cause of the fallback to the normal path, counted by cause in
    either case."""
    decided = plan(state.tito_state, chat, handles, session.id, session.norms)
    spare, state.tito_spare = state.tito_spare, None  # a turn not built from ids leaves none
    state.tito_packed = decided.packed  # the next state's bytes (tito_plan.next_state)
    prev = decided.state
    # the log's delta need not encode both message lists again to find the previous ones kept (delta.Kept)
    state.kept = (chat["messages"], prev.messages, len(prev.messages)) if (
        decided.same and prev is not None and prev.messages is not None) else None
    if decided.cause == "tokens" and not client.caps.tito:  # an older vLLM (backend/capabilities.py)
        decided = decided._replace(cause="no_scale_out")
    if decided.cause == "tokens":
        turn = Turn(client, chat, decided, state.prompt, state.tito_base)
        turn.spare, spare = spare, None  # the turn's alone: a reference left here would keep it from growing
        try:
            generate = await turn.request(stream)
            state.tito_base = turn.base
        except BackendStatus as exc:
            if exc.status not in (404, 405):
                raise backend_error(client.name, exc) from None
            generate = None  # a vLLM without --enable-scale-out: normal rendering, counted
            decided = decided._replace(cause="no_scale_out")
        if generate is not None:
            metrics.child(metrics.tito_turns, "tokens").inc()
            last = decided.state
            assert last is not None
            # built as the previous step's prompt + response + what is new: prefix.extends compares only that
            state.grown = (turn.prompt, last.prompt_ids, last.response_ids)
            state.tito_spare = (last.prompt_ids, turn.prompt)  # grown into the next turn's (Turn._grow)
            return turn, generate
        if decided.cause == "tokens":
            decided = decided._replace(cause="template")
    metrics.child(metrics.tito_turns, decided.cause).inc()
    return decided.cause


def end_turn(state: CallState, chat: dict[str, Any], steps: list[Step], stop_reason: Any) -> None:
    """What the session's next turn extends (a failed or multi-choice call extends nothing)."""
    packed, state.tito_packed = state.tito_packed, None
    state.tito_state = (next_state(chat, steps[0], stop_reason, state.tito_state, packed)
                          if len(steps) == 1 else None)
