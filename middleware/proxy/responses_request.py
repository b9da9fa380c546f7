"""A Responses request body as a chat body: every top-level field, input item and tool is either served,
dropped with a note, or refused with a 400 naming it.

What the model cannot see as a Responses tool is flattened into a chat function: a ``namespace`` tool's
children become ``<namespace>.<name>`` functions, a ``custom`` (freeform) tool a function of one string
argument ``input``. ``Translation.namespaced`` and ``Translation.custom`` map those flat names back, so the
reply side returns the call the agent expects (``function_call`` with its ``namespace``, or
``custom_tool_call``). Hosted tools
(``web_search``, ...) need a server that runs them: they are dropped from what the model sees and noted. The
notes (``Translation.notes``) are recorded on the step (``Step.notes``, as for every protocol) and counted in
/metrics (``steptap_dropped_fields_total{endpoint, field}``, the label), so a capture never silently differs
from what the agent asked for.
"""

from __future__ import annotations

import json
from typing import Any

from steptap.middleware.proxy.translation import HANDLE_KEY, MAX_NOTES, carry_over, take_handles, text_of
from steptap.middleware.proxy.translation import bad as _bad

# Chat parameters a Responses body may carry that mean the same on both routes (vLLM's extras included).
SAME = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "structured_outputs", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "parallel_tool_calls", "user", "logit_bias",
)
# Read by the translation or the reply (echoed), or bookkeeping that does not change what the model samples:
# prompt_cache_key (vLLM caches prefixes by itself), client_metadata / safety_identifier / service_tier.
_SERVED = {
    "model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "stream", "store",
    "previous_response_id", "metadata", "text", "reasoning", "include", "truncation", "prompt_cache_key",
    "safety_identifier", "service_tier", "client_metadata", "stream_options", *SAME,
}
# Served only as off: a value that asks for them is refused, naming what to change.
_REFUSED = {
    "background": "background responses are not served: send background false (or leave it out)",
    "conversation": "the Conversations API is not served: send the history in 'input' or use "
                    "previous_response_id",
    "prompt": "reusable prompt templates are not served: send 'instructions' and 'input' instead",
}
# Known but not honoured: dropped with a note (the model samples as if they were absent).
_DROPPED = {"max_tool_calls", "top_logprobs"}
# Tools a server runs (OpenAI's): the backend cannot, so the model never sees them. Named in the metric label.
HOSTED_TOOLS = (
    "web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview",
    "computer_use", "image_generation", "mcp", "local_shell", "shell", "tool_search",
)
_INCLUDE_SERVED = {"reasoning.encrypted_content"}
_EFFORTS = ("low", "medium", "high")  # what vLLM's chat route takes as reasoning_effort
NAMESPACE_SEP = "."  # a namespace child's function name is "<namespace>.<name>", as OpenAI's models see it

CUSTOM_ARG = "input"  # the one string argument of a custom tool's function


class Translation:
    """A Responses body translated: the chat body, the notes on what was dropped, and the flat function names
    that stand for namespace children (``(name, namespace)``) or custom tools (``(name, None)`` in
    ``custom``)."""

    def __init__(self) -> None:
        self.chat: dict[str, Any] = {}
        self.notes: list[dict[str, str]] = []
        self.namespaced: dict[str, tuple[str, str]] = {}  # flat name -> (name, namespace)
        self.custom: set[str] = set()
        # Assistant message -> its replayed reasoning handle (translation.py)
        self.handles: dict[int, str] = {}

    def note(self, field: str, label: str, reason: str) -> None:
        """``field``: where in the body; ``label``: the metric's bounded label; ``reason``: why."""
        if len(self.notes) < MAX_NOTES:
            self.notes.append({"field": field, "label": label, "reason": reason})
        elif len(self.notes) == MAX_NOTES:
            self.notes.append({"field": "...", "label": "other",
                               "reason": "more fields dropped (not listed)"})


# --- input items --------------------------------------------------------------------------------------------


def _text_of(content: Any, where: str) -> str:
    return text_of(content, where, ("input_text", "output_text", "text"), "text parts")


def _user_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A user message's (or a tool output's) content: its text, or (with ``input_image`` parts) its text and
    image parts in order as chat parts (proxy/vision.py reads them)."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "input_image"
                                                for p in content):
        return _text_of(content, where)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise _bad("an input_image needs an 'image_url' (a data URL or an http(s) URL; file_id is "
                           "not served)", f"{where}[{i}]")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": _text_of([part], f"{where}[{i}]")})
    return parts


def custom_arguments(text: str) -> str:
    """A custom tool call's input as the arguments of its function (as vLLM's tool parsers serialize them)."""
    return json.dumps({CUSTOM_ARG: text}, ensure_ascii=False)


def _strings(item: dict[str, Any], where: str, *keys: str) -> list[str]:
    values = [v for v in (item.get(k) for k in keys) if isinstance(v, str)]
    if len(values) != len(keys):
        raise _bad(f"a {item.get('type')} item needs string {', '.join(repr(k) for k in keys)}", where)
    return values


def _join_call(out: list[dict[str, Any]], call: dict[str, Any]) -> None:
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant":  # one reply: its text, then its calls
        last.setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})


def input_messages(items: Any, tr: Translation | None = None) -> list[dict[str, Any]]:
    """Responses input items as chat messages. Calls join the assistant message before them (as a chat reply
    with content and tool calls comes back as a message item then call items)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _bad("'input' must be a string or a list of items", "input")
    out: list[dict[str, Any]] = []
    reasoning: dict[str, Any] | None = None  # a reasoning item's text and handle, for the reply it precedes
    mark = 0  # where that reply's assistant message will be
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if reasoning is not None and len(out) > mark:
            _attach(out[mark], reasoning)
            reasoning = None
        if not isinstance(item, dict):
            raise _bad("an input item must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"unsupported role {role!r}", where)
            content = item.get("content")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _user_content(content, f"{where}.content") if role == "user"
                        else _text_of(content, f"{where}.content")})
        elif kind == "function_call":
            name, args, call_id = _strings(item, where, "name", "arguments", "call_id")
            namespace = item.get("namespace")
            if namespace is not None:
                if not isinstance(namespace, str):
                    raise _bad("a function_call's 'namespace' must be a string", where)
                name = f"{namespace}{NAMESPACE_SEP}{name}"
            _join_call(out, {"id": call_id, "type": "function",
                             "function": {"name": name, "arguments": args}})
        elif kind == "custom_tool_call":
            name, text, call_id = _strings(item, where, "name", "input", "call_id")
            _join_call(out, {"id": call_id, "type": "function",
                             "function": {"name": name, "arguments": custom_arguments(text)}})
        elif kind == "local_shell_call":  # history from a server that ran OpenAI's local_shell tool
            given_id = item.get("call_id") or item.get("id")
            if not isinstance(given_id, str) or not isinstance(item.get("action"), dict):
                raise _bad("a local_shell_call needs a string 'call_id' and an 'action' object", where)
            _join_call(out, {"id": given_id, "type": "function", "function": {
                "name": "local_shell", "arguments": json.dumps(item["action"], ensure_ascii=False)}})
        elif kind in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
            out.append(_tool_output(item, kind, where))
        elif kind == "reasoning":
            # The reasoning of the reply that follows: its text goes to the template as the assistant
            # message's reasoning (rendered where the template renders it); its encrypted_content, when the
            # proxy made it, names the step it came from (translation.reasoning_handle), for a
            # token-in-token-out splice.
            enc = item.get("encrypted_content")
            if enc is not None and not isinstance(enc, str):
                raise _bad("a reasoning item's 'encrypted_content' must be a string or null", where)
            parts = item.get("content") or []
            if not isinstance(parts, list):
                raise _bad("a reasoning item's 'content' must be a list", where)
            text = "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
            reasoning = {k: v for k, v in (("reasoning", text or None), (HANDLE_KEY, enc)) if v is not None}
            mark = len(out)
        elif kind in ("web_search_call", "file_search_call", "image_generation_call",
                      "code_interpreter_call"):
            if tr is not None:  # a hosted tool's result from another server: nothing the model can be shown
                tr.note(where, f"input:{kind}", f"{kind} items are dropped (hosted tools are not served)")
        else:
            raise _bad(f"unsupported input item type {kind!r}", where)
    if reasoning is not None and len(out) > mark:
        _attach(out[mark], reasoning)
    return out


def _tool_output(item: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
    """A tool's output as a chat ``tool`` message: the answer to the call its ``call_id`` names, or, for a
    ``function_call_output`` with no ``call_id`` but a ``name`` (and a ``namespace``), output the agent's
    runtime hands the model in that tool's name with no call before it (Codex's goal objective, ``agent`` /
    ``goal_objective``, after ``create_goal``): a tool message named as the flattened tool
    (``<namespace>.<name>``), with no call id, as the template renders a tool's output."""
    content = _user_content(item.get("output"), f"{where}.output")
    given_id = item.get("call_id")
    if isinstance(given_id, str):
        return {"role": "tool", "tool_call_id": given_id, "content": content}
    name, namespace = item.get("name"), item.get("namespace")
    if given_id is None and kind == "function_call_output" and isinstance(name, str) and name \
            and (namespace is None or isinstance(namespace, str)):
        return {"role": "tool", "name": f"{namespace}{NAMESPACE_SEP}{name}" if namespace else name,
                "content": content}
    raise _bad(f"a {kind} needs a string 'call_id' (or, with none, a string 'name')", where)


def _attach(msg: dict[str, Any], reasoning: dict[str, Any]) -> None:
    """A reasoning item's text and handle onto the reply that followed it (dropped when a user turn did)."""
    if msg["role"] == "assistant" and "reasoning" not in msg and HANDLE_KEY not in msg:
        msg.update(reasoning)


# --- tools --------------------------------------------------------------------------------------------------


def _function(tool: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise _bad("a function tool needs a string 'name'", where)
    fn: dict[str, Any] = {"name": name,
                          "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
    if tool.get("description"):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _custom(tool: dict[str, Any], where: str, tr: Translation) -> dict[str, Any]:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise _bad("a custom tool needs a string 'name'", where)
    description = tool.get("description") or ""
    fmt = tool.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar":
        # vLLM constrains a whole reply, not one argument of a tool call: the model is shown the grammar
        description += (f"\n\nThe input follows this {fmt.get('syntax', '')} "
                        f"grammar:\n{fmt.get('definition', '')}")
        tr.note(f"{where}.format", "tools:custom_grammar",
                "a custom tool's grammar is shown to the model in the description, not enforced")
    tr.custom.add(name)
    params = {"type": "object", "properties": {CUSTOM_ARG: {"type": "string"}}, "required": [CUSTOM_ARG]}
    fn: dict[str, Any] = {"name": name, "parameters": params}
    if description:
        fn["description"] = description
    return {"type": "function", "function": fn}


def tools_of(tools: Any, tr: Translation) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad("a tool must be an object", where)
        kind = tool.get("type")
        if kind == "function":
            out.append(_function(tool, tool.get("name") or "", where))
        elif kind == "custom":
            out.append(_custom(tool, where, tr))
        elif kind == "namespace":
            ns = tool.get("name")
            if not isinstance(ns, str) or not ns or not isinstance(tool.get("tools"), list):
                raise _bad("a namespace tool needs a string 'name' and a list 'tools'", where)
            for j, child in enumerate(tool["tools"]):
                at = f"{where}.tools[{j}]"
                if not isinstance(child, dict) or child.get("type") != "function":
                    raise _bad("a namespace holds function tools only", at)
                flat = f"{ns}{NAMESPACE_SEP}{child.get('name')}"
                out.append(_function(child, flat, at))
                tr.namespaced[flat] = (child["name"], ns)
        elif isinstance(kind, str) and kind:
            label = kind if kind in HOSTED_TOOLS else "other"
            tr.note(where, f"tools:{label}",
                    f"hosted tool {kind!r} dropped: the backend cannot run it, so the model is not "
                    "offered it")
        else:
            raise _bad("a tool needs a string 'type'", where)
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise _bad(f"two tools are named {dup!r} (namespace children are named '<namespace>.<name>')",
                   "tools")
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom") and isinstance(
            choice.get("name"), str):
        name = choice["name"]
        if isinstance(choice.get("namespace"), str):
            name = f"{choice['namespace']}{NAMESPACE_SEP}{name}"
        return {"type": "function", "function": {"name": name}}
    raise _bad("'tool_choice' must be auto, none, required, a function or a custom tool", "tool_choice")


# --- the body -----------------------------------------------------------------------------------------------


def _fields(body: dict[str, Any], tr: Translation) -> None:
    """Top-level fields: refused when they ask for what is not served, noted when dropped."""
    for key, why in _REFUSED.items():
        if body.get(key) not in (None, False):
            raise _bad(why, key)
    for key in body:
        if key in _DROPPED and body[key] is not None:
            tr.note(key, key, f"{key!r} is not honoured by the proxy (dropped)")
        elif key not in _SERVED and key not in _REFUSED and key not in _DROPPED:
            tr.note(key, "other", f"unknown field {key!r} dropped")
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
            raise _bad("'include' must be a list of strings", "include")
        for x in include:
            if x not in _INCLUDE_SERVED:
                tr.note("include", "include", f"include {x!r} is not served (dropped)")
    if body.get("truncation") not in (None, "disabled"):
        tr.note("truncation", "truncation",
                "truncation is not served: an input longer than the model's context fails instead")
    text = body.get("text")
    if isinstance(text, dict):
        if text.get("verbosity") is not None:
            tr.note("text.verbosity", "text", "text verbosity is not served (dropped)")
        kind = (text.get("format") or {}).get("type") if isinstance(text.get("format"), dict) else None
        if kind not in (None, "text", "json_schema", "json_object"):
            tr.note("text.format", "text", f"text format {kind!r} is not served (dropped)")
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise _bad("'reasoning' must be an object", "reasoning")
        effort = reasoning.get("effort")
        if effort in _EFFORTS:
            tr.chat["reasoning_effort"] = effort
        elif effort is not None:
            tr.note("reasoning.effort", "reasoning", f"reasoning effort {effort!r} is not served (dropped)")
        if reasoning.get("summary") is not None:
            tr.note("reasoning.summary", "reasoning",
                    "reasoning summaries are not made: the reasoning item carries the model's own reasoning "
                    "text")


def translate(body: dict[str, Any], history: list[dict[str, Any]]) -> Translation:
    """The chat body for a Responses body; ``history`` is the conversation of ``previous_response_id``."""
    tr = Translation()
    chat = tr.chat
    chat["model"] = body.get("model")
    if "input" not in body:
        raise _bad("'input' is required", "input")
    _fields(body, tr)
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    chat["messages"] = messages + history + input_messages(body["input"], tr)
    tr.handles = take_handles(chat["messages"])
    tools = tools_of(body["tools"], tr) if body.get("tools") else []
    if tools:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if choice is not None and (tools or choice == "none"):
        chat["tool_choice"] = _tool_choice(choice)
    elif choice not in (None, "auto"):  # only hosted tools were offered: nothing left to choose from
        tr.note("tool_choice", "tool_choice", "tool_choice dropped: no tool the model can call is left")
    if body.get("max_output_tokens") is not None:
        if not isinstance(body["max_output_tokens"], int) or body["max_output_tokens"] < 1:
            raise _bad("'max_output_tokens' must be a positive integer", "max_output_tokens")
        chat["max_tokens"] = body["max_output_tokens"]
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    carry_over(chat, body, SAME)
    return tr


def to_chat(body: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    return translate(body, history).chat
