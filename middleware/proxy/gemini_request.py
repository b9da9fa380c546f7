"""Google's Gemini API, the request side: a ``generateContent`` body as the chat body it is served as
(``translate``). Every field is served, dropped with a note (on the step, counted by bounded label), or
refused with a 400 naming it. The conversation (``contents``): ``gemini_contents.py``; the reply side and the
errors: ``gemini.py``.
"""

from __future__ import annotations

import math
from typing import Any

from steptap.middleware.proxy.gemini_contents import Translation, get, messages_of, obj, snake, unknown
from steptap.middleware.proxy.translation import bad as _bad

_TOP = ("contents", "systemInstruction", "tools", "toolConfig", "generationConfig", "safetySettings",
        "cachedContent", "labels", "model", "structured_outputs")
# Tools Google's servers run: the backend cannot, so the model is not offered them (noted, by name)
HOSTED_TOOLS = ("googleSearch", "googleSearchRetrieval", "codeExecution", "urlContext", "computerUse",
                "fileSearch", "googleMaps", "retrieval", "enterpriseWebSearch", "mcpServers")
# generationConfig fields no local model honours: dropped with a note, counted under their own name
_GEN_DROPPED = ("responseLogprobs", "logprobs", "speechConfig", "mediaResolution", "audioTimestamp",
                "enableEnhancedCivicAnswers", "routingConfig", "modelSelectionConfig", "imageConfig")
_FLOATS = {"temperature": "temperature", "topP": "top_p", "presencePenalty": "presence_penalty",
           "frequencyPenalty": "frequency_penalty"}
_INTS = {"topK": ("top_k", -1), "candidateCount": ("n", 1), "maxOutputTokens": ("max_tokens", 1),
         "seed": ("seed", None)}  # -> (the chat key, the least value)
_GEN_SERVED = (*_FLOATS, *_INTS, "stopSequences", "responseMimeType", "responseSchema", "responseJsonSchema",
               "thinkingConfig", "responseModalities", *_GEN_DROPPED)
_THINKING = ("thinkingBudget", "thinkingLevel", snake("thinkingBudget"), snake("thinkingLevel"))
_MODES = {"AUTO": "auto", "MODE_UNSPECIFIED": "auto", "VALIDATED": "auto", "NONE": "none", "ANY": "required"}
# Gemini's Schema keys in snake_case -> JSON Schema's (a Schema is read as the JSON Schema it stands for)
_SCHEMA_KEYS = {snake(k): k for k in ("anyOf", "maxItems", "minItems", "maxLength", "minLength",
                                      "maxProperties", "minProperties", "propertyOrdering")}


def json_schema(schema: Any) -> Any:
    """Gemini's OpenAPI-style ``Schema`` (``"type": "OBJECT"``, ``nullable``) as a JSON Schema: types lower
    case, ``nullable`` as a ``null`` type; property names and everything else as sent."""
    if isinstance(schema, list):
        return [json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for name, value in schema.items():
        key = str(_SCHEMA_KEYS.get(name, name))
        if key == "type" and isinstance(value, str):
            out[key] = value.lower()
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: json_schema(s) for name, s in value.items()}
        elif key in ("items", "anyOf", "oneOf", "allOf", "not", "additionalProperties"):
            out[key] = json_schema(value)
        elif key != "nullable":
            out[key] = value
    if schema.get("nullable") is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def _function(decl: Any, where: str, tr: Translation) -> dict[str, Any]:
    decl = obj(decl, where)
    name = decl.get("name")
    if not isinstance(name, str) or not name:
        raise _bad("a function declaration needs a string 'name'", where)
    schema, params = get(decl, "parametersJsonSchema"), decl.get("parameters")
    if schema is not None and params is not None:
        raise _bad("give 'parameters' or 'parametersJsonSchema', not both", where)
    fn: dict[str, Any] = {"name": name, "parameters": schema if schema is not None else json_schema(params)
                          if params is not None else {"type": "object", "properties": {}}}
    if isinstance(decl.get("description"), str) and decl["description"]:
        fn["description"] = decl["description"]
    for key in unknown(decl, ("name", "description", "parameters", "parametersJsonSchema")):
        tr.note(f"{where}.{key}", "tools:declaration_other", "not shown to the model")
    return {"type": "function", "function": fn}


def tools_of(tools: Any, tr: Translation) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        decls = get(obj(tool, where), "functionDeclarations")
        if decls is not None:
            if not isinstance(decls, list):
                raise _bad("'functionDeclarations' must be a list", f"{where}.functionDeclarations")
            out += [_function(d, f"{where}.functionDeclarations[{j}]", tr) for j, d in enumerate(decls)]
        for key in unknown(tool, ("functionDeclarations",)):
            hosted = next((h for h in HOSTED_TOOLS if key in (h, snake(h))), None)
            tr.note(f"{where}.{key}", f"tools:{hosted or 'other'}",
                    "a tool Google's servers run: the backend cannot, so the model is not offered it")
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise _bad(f"two function declarations are named {dup!r}", "tools")
    return out


def _tool_choice(config: Any, names: list[str], tr: Translation) -> Any:
    """``toolConfig.functionCallingConfig`` as the chat ``tool_choice`` (None: the default, auto)."""
    fcc = get(obj(config, "toolConfig"), "functionCallingConfig")
    for key in unknown(config, ("functionCallingConfig",)):
        tr.note(f"toolConfig.{key}", "toolConfig:other", "not honoured by this proxy")
    if fcc is None:
        return None
    fcc = obj(fcc, "toolConfig.functionCallingConfig")
    mode = fcc.get("mode", "AUTO")
    if mode not in _MODES:
        raise _bad(f"'mode' must be one of {', '.join(_MODES)}", "toolConfig.functionCallingConfig.mode")
    allowed = get(fcc, "allowedFunctionNames")
    if allowed is not None and not (isinstance(allowed, list) and all(isinstance(n, str) for n in allowed)):
        raise _bad("'allowedFunctionNames' must be a list of strings",
                   "toolConfig.functionCallingConfig.allowedFunctionNames")
    if mode == "VALIDATED":
        tr.note("toolConfig.functionCallingConfig.mode", "toolConfig.mode",
                "VALIDATED served as AUTO (calls are parsed, not held to their schema)")
    if not names:
        if mode == "ANY":
            tr.note("toolConfig.functionCallingConfig", "toolConfig.mode",
                    "ANY dropped: no function is offered")
        return None
    if mode == "ANY" and allowed and len(allowed) == 1:
        return {"type": "function", "function": {"name": allowed[0]}}
    if mode == "ANY" and allowed and set(allowed) != set(names):
        tr.note("toolConfig.functionCallingConfig.allowedFunctionNames", "toolConfig.allowedFunctionNames",
                "not enforced: the model may call any offered function")
    return _MODES[mode]


def _number(config: dict[str, Any], name: str, integer: bool) -> Any:
    value = get(config, name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad("must be a finite number", f"generationConfig.{name}")
    if integer:
        if value != int(value):
            raise _bad("must be an integer", f"generationConfig.{name}")
        return int(value)
    return value


def _generation(config: Any, chat: dict[str, Any], tr: Translation) -> None:
    config = obj(config, "generationConfig")
    for name, key in _FLOATS.items():
        if (value := _number(config, name, False)) is not None:
            chat[key] = value
    for name, (key, least) in _INTS.items():
        if (value := _number(config, name, True)) is not None:
            if least is not None and value < least:
                raise _bad(f"must be at least {least}", f"generationConfig.{name}")
            chat[key] = value
    stop = get(config, "stopSequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _bad("must be a list of strings", "generationConfig.stopSequences")
        chat["stop"] = stop
    modalities = get(config, "responseModalities")
    if modalities is not None and (not isinstance(modalities, list) or set(modalities) - {"TEXT"}):
        raise _bad("only TEXT is served", "generationConfig.responseModalities")
    _response_format(config, chat)
    thinking = get(config, "thinkingConfig")
    if thinking is not None:  # includeThoughts is the reply's (gemini.Shape); the model reasons as it does
        for key in unknown(obj(thinking, "generationConfig.thinkingConfig"), ("includeThoughts",)):
            label = f"thinkingConfig.{key}" if key in _THINKING else "thinkingConfig:other"
            tr.note(f"generationConfig.thinkingConfig.{key}", label,
                    "not honoured: the served model reasons as its template says")
    for key in unknown(config, _GEN_SERVED):
        tr.note(f"generationConfig.{key}", "generationConfig:other", "not honoured by this proxy")
    for key in _GEN_DROPPED:
        if get(config, key) is not None:
            tr.note(f"generationConfig.{key}", f"generationConfig.{key}", "not honoured by this proxy")


def _response_format(config: dict[str, Any], chat: dict[str, Any]) -> None:
    """``responseMimeType`` JSON (with a schema: vLLM's JSON-schema grammar holds the reply to it)."""
    mime = get(config, "responseMimeType")
    schema, raw = get(config, "responseJsonSchema"), get(config, "responseSchema")
    if mime not in (None, "text/plain", "application/json"):
        raise _bad("only 'text/plain' and 'application/json' are served", "generationConfig.responseMimeType")
    if (schema is not None or raw is not None) and mime != "application/json":
        raise _bad("a response schema needs responseMimeType 'application/json'", "generationConfig")
    if mime != "application/json":
        return
    if schema is None and raw is None:
        chat["response_format"] = {"type": "json_object"}
        return
    schema = schema if schema is not None else json_schema(raw)
    if not isinstance(schema, dict):
        raise _bad("a response schema must be an object", "generationConfig.responseJsonSchema")
    chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


def translate(body: dict[str, Any], model: str, stream: bool = False,
              count_only: bool = False) -> Translation:
    """The chat body of a ``generateContent`` body for ``model`` (the path's). ``count_only``: a
    ``countTokens`` body (``contents``, or a whole ``generateContentRequest``)."""
    tr = Translation()
    if count_only and get(body, "generateContentRequest") is not None:
        body = obj(get(body, "generateContentRequest"), "generateContentRequest")
    chat: dict[str, Any] = {"model": model, "messages": messages_of(body, tr)}
    tools = get(body, "tools")
    if tools is not None:
        offered = tools_of(tools, tr)
        if offered:
            chat["tools"] = offered
    if get(body, "toolConfig") is not None:
        choice = _tool_choice(get(body, "toolConfig"), [t["function"]["name"] for t in chat.get("tools", ())],
                              tr)
        if choice is not None:
            chat["tool_choice"] = choice
    if get(body, "generationConfig") is not None:
        _generation(get(body, "generationConfig"), chat, tr)
    if get(body, "cachedContent") is not None:
        raise _bad("cached contents are not served: send the contents themselves", "cachedContent")
    if get(body, "safetySettings") is not None:
        tr.note("safetySettings", "safetySettings", "not honoured: the served model has no safety filter")
    for key in unknown(body, _TOP):
        tr.note(key if len(key) <= 64 else key[:64] + "...", "other", "not honoured by this proxy")
    if isinstance(body.get("structured_outputs"), dict):  # vLLM's own extra, as the other protocols pass it
        chat["structured_outputs"] = body["structured_outputs"]
    if count_only:
        chat["max_tokens"] = 1
    elif stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    tr.chat = chat
    return tr
