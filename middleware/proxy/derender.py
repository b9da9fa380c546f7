"""What a TITO turn sends vLLM's derender route, and what its answers become (``tito.Turn``).

vLLM's ``/v1/chat/completions/derender`` turns generated ids back into the chat reply an agent expects (tool
and reasoning parsers applied). Its body carries the chat request and the prompt's ids; at 123k tokens and
401 messages they are 0.78 MB, parsed by vLLM's API server on every call (19-25 ms there, once per streamed
chunk), where what it reads of them is small:

- **The chat request:** its parsing options (tools, tool choice, reasoning, template kwargs, decode flags);
  of the conversation only the number of the history's tool calls (Kimi-K2-style tool-call ids count them).
  It goes with the conversation cut to that: the assistant messages' tool calls (``chat_request``).
- **The prompt's ids:** a non-streamed derender reads only the last few, to seed detokenization (vLLM:
  "a suffix of the prompt is enough", ``DerenderChatRequest.prompt_token_ids``): it gets the last
  ``PROMPT_TAIL``. A streamed one with a parser configured reads back to the prompt's last reasoning marker,
  which in a spliced prompt is an earlier reply's end of reasoning: it gets what the turn added after the
  previous reply (``tito.Turn.added``), as a rendered prompt would show it.
- **Streamed chunks:** generate chunks that arrived while the previous derender call was out go to the next
  one together (``merge``), so the number of derender calls is bounded by how fast vLLM answers them, not by
  the tokens generated (vLLM's parsers take several tokens a chunk, as under speculative decoding).

A streamed turn mostly skips derender: vLLM's chat route takes the prompt as ids
(``kv_transfer_params.prompt_token_ids``, its decode-side reuse), generates from them without rendering and
streams as a chat call does, its parsers holding their state in the process: one call a turn, not a derender
call per chunk. It is sent the conversation cut as derender's is, plus its last message (``chat_request``):
the history it would not render is 0.5 MB at 120k tokens, for vLLM to parse and the proxy to write. vLLM
renders the messages instead (and ignores the ids) when ``echo`` is set or a message holds non-text content,
so those turns (``takes_ids`` false, judged on the whole conversation) keep generate and derender, as do
turns whose prompt holds an earlier reply's reasoning (``tito_plan.State.reasoned``: the chat route's
parsers would read its end marker). The chat route's replies carry no ``weight_versions``: a keep swap's
split is the relayed count, as for any stream (weights/spans.py).
"""

from __future__ import annotations

from typing import Any

PROMPT_TAIL = 64  # ids a non-streamed derender is sent (it seeds its detokenizer from the last few)


def takes_ids(chat: dict[str, Any]) -> bool:
    """Whether vLLM's chat route generates from ``kv_transfer_params.prompt_token_ids`` for ``chat``: no
    ``echo``, every message's content a string or text parts (stricter than vLLM's own check, so the ids are
    never silently ignored)."""
    if chat.get("echo"):
        return False
    for m in chat.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and not all(
                isinstance(p, dict) and p.get("type", "text") == "text" and p.keys() <= _TEXT_PART
                for p in content):
            return False
    return True


_TEXT_PART = {"type", "text"}


def chat_request(chat: dict[str, Any], last: bool = False) -> dict[str, Any]:
    """``chat`` as derender needs it: the conversation cut to the assistant messages' tool calls. ``last``:
    and its last message, for vLLM's chat route on ids (which renders nothing and reads the conversation
    only for the tool calls and, without a generation prompt, the last message's role)."""
    messages = chat.get("messages")
    if not isinstance(messages, list):
        return chat
    calls = [{"role": "assistant", "content": None, "tool_calls": m["tool_calls"]} for m in messages
             if isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls")]
    end = messages[-1] if last and messages else None
    if isinstance(end, dict) and not (end.get("role") == "assistant" and end.get("tool_calls")):
        calls.append(end)
    return {**chat, "messages": calls}


def merge(gens: list[dict[str, Any]]) -> dict[str, Any]:
    """Consecutive generate stream chunks of one choice as one: their ids and logprobs in order, the rest
    (finish reason, weight versions) of the last."""
    if len(gens) == 1:
        return gens[0]
    last = gens[-1]
    choices = [g["choices"][0] for g in gens]
    merged = {**choices[-1], "token_ids": [t for c in choices for t in c.get("token_ids") or ()]}
    if any(c.get("logprobs") for c in choices):
        content = [x for c in choices for x in ((c.get("logprobs") or {}).get("content") or ())]
        merged["logprobs"] = {**(choices[-1].get("logprobs") or {}), "content": content}
    return {**last, "choices": [merged]}


def without_eos(gen: dict[str, Any]) -> dict[str, Any]:
    """The generate result as derender should see it: without the end-of-sequence or stop token that ended a
    choice (vLLM's chat route leaves it out of the text; derender would detokenize it into the content). A
    stop string is not cut from the text by derender: such calls are rendered (``tito_plan.plan``)."""
    choices = []
    for ch in gen.get("choices") or ():
        ids = ch.get("token_ids") or []
        if (ch.get("finish_reason") == "stop" and (ch.get("stop_reason") is None or isinstance(
                ch.get("stop_reason"), int)) and ids):
            lp = ch.get("logprobs") or {}
            ch = {**ch, "token_ids": ids[:-1]}
            if lp.get("content"):
                ch["logprobs"] = {**lp, "content": lp["content"][:-1]}
        choices.append(ch)
    return {**gen, "choices": choices}


def chat_logprobs(derendered: Any, generated: list[dict[str, Any]]) -> dict[str, Any]:
    """Chat-shaped logprobs whose values are the generated tokens' (one per token id, the end token
    included); the token text derender gave is kept where it lines up."""
    content = list((derendered or {}).get("content") or [])
    if len(content) == len(generated) - 1:  # the end token derender did not see
        content.append({"token": "", "logprob": 0.0, "bytes": [], "top_logprobs": []})
    if len(content) == len(generated):
        return {"content": [{**c, "logprob": g["logprob"]} for c, g in zip(content, generated, strict=True)]}
    return {"content": [{"token": f"token_id:{g['token_id']}", "logprob": g["logprob"], "bytes": None,
                         "top_logprobs": []} for g in generated]}
