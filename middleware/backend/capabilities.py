"""What one vLLM server can do for steptap, read once from its own ``/openapi.json``.

vLLM's routes and wire formats move between releases (docs/platform.md, "Older vLLM releases"): vLLM 0.26 (the
CUDA build that runs on torch 2.11) has no ``/update_weight_version`` or ``/weight_info``, no
``/shutdown_weight_transfer_engine``, and its ``/inference/v1/generate`` returns chat-shaped logprobs without
token ids and no ``weight_versions``; older ones lack ``pause?mode=keep`` or the scale-out routes altogether.
The server's OpenAPI document names every route it serves and the schema of every body, so one read tells
what is there; the proxy says so at start-up and takes the fallback each lacking piece has (``missing``).
A server whose document cannot be read (``--disable-fastapi-docs``) is taken to have everything, as before.
"""

from __future__ import annotations

from typing import Any

import msgspec

# Fallbacks, by capability: what the proxy does without it (said once per replica at start-up)
FALLBACKS = {
    "pause_keep": "keep-mode swaps of full weights drain instead (pause?mode=wait)",
    "tito": "token-in-token-out sessions are refused; --tito calls take the normal path",
    "weight_versions": "token-in-token-out turns cannot split their tokens by weight version",
    "labels": "vLLM's own weight label is not set; a replica is reconciled by the proxy's version alone",
    "transfer": "weight_sync = \"collective\" swaps are refused: publish through disk",
    "transfer_shutdown": "a transfer's group is left to vLLM (no shutdown route)",
    "lora": "LoRA adapter swaps fail: start vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1",
    "pause": "weight swaps fail: start vLLM with VLLM_SERVER_DEV_MODE=1 (its dev-mode routes)",
    "token_ids": "chat replies carry no token ids: nothing exact can be recorded from this server",
}
ROUTES = {
    "tito": ("/v1/chat/completions/render", "/inference/v1/generate", "/v1/chat/completions/derender"),
    "labels": ("/update_weight_version", "/weight_info"),
    "transfer": ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                 "/finish_weight_update"),
    "transfer_shutdown": ("/shutdown_weight_transfer_engine",),
    "lora": ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"),
    "pause": ("/pause", "/resume", "/collective_rpc"),
}


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """``known``: read from the server (else every field is True: the behaviour of a proxy that never
    asked). ``why``: for each missing capability, what in the server's document showed it."""

    known: bool = False
    version: str | None = None
    pause: bool = True
    pause_keep: bool = True
    tito: bool = True
    weight_versions: bool = True
    labels: bool = True
    transfer: bool = True
    transfer_shutdown: bool = True
    lora: bool = True
    token_ids: bool = True
    why: dict[str, str] = {}

    def missing(self) -> list[str]:
        """One line per missing capability: what showed it, and the fallback."""
        return [f"{name}: {self.why.get(name, 'missing')} -> {FALLBACKS[name]}"
                for name in FALLBACKS if not getattr(self, name)]

    def summary(self, name: str) -> str:
        version = f"vLLM {self.version}" if self.version else "vLLM (version unknown)"
        if not self.known:
            return f"backend {name}: {version}: no /openapi.json to read; every route steptap uses is assumed"
        lines = self.missing()
        if not lines:
            return f"backend {name}: {version} serves every route steptap uses"
        return f"backend {name}: {version} lacks what steptap uses: " + "; ".join(lines)


def from_openapi(doc: Any, version: str | None = None) -> Capabilities:
    """The capabilities an OpenAPI document (vLLM's ``/openapi.json``) shows."""
    if not isinstance(doc, dict) or not isinstance(doc.get("paths"), dict):
        return Capabilities(version=version)
    paths: dict[str, Any] = doc["paths"]
    schemas = (doc.get("components") or {}).get("schemas") or {}
    have: dict[str, bool] = {}
    why: dict[str, str] = {}
    for cap, routes in ROUTES.items():
        absent = [r for r in routes if r not in paths]
        have[cap] = not absent
        if absent:
            why[cap] = f"no {', '.join(absent)}"
    modes = _enum(_param(paths.get("/pause"), "mode"), schemas)
    have["pause_keep"] = have["pause"] and (modes is None or "keep" in modes)
    if have["pause"] and not have["pause_keep"]:
        why["pause_keep"] = (f"/pause takes mode {', '.join(sorted(modes))}" if modes
                             else "/pause takes no mode")
    derender = _body(paths.get("/v1/chat/completions/derender"))
    choice = ("generate_response", "choices")
    if have["tito"] and not _has(derender, (*choice, "logprobs", "content", "token_id"), schemas):
        have["tito"] = False
        why["tito"] = "its generate route's logprobs carry no token ids (an older wire format)"
    have["weight_versions"] = have["tito"] and _has(derender, (*choice, "weight_versions"), schemas)
    if not have["weight_versions"]:
        why["weight_versions"] = why.get("tito") or "its generate route reports no weight_versions"
    chat = _body(paths.get("/v1/chat/completions"))
    have["token_ids"] = chat is None or _has(chat, ("return_token_ids",), schemas)
    if not have["token_ids"]:
        why["token_ids"] = "its chat route takes no return_token_ids"
    return Capabilities(known=True, version=version, why=why, **have)


def _body(path_item: Any) -> Any:
    try:
        return path_item["post"]["requestBody"]["content"]["application/json"]["schema"]
    except (KeyError, TypeError):
        return None


def _param(path_item: Any, name: str) -> Any:
    try:
        params = path_item["post"].get("parameters") or []
    except (KeyError, TypeError, AttributeError):
        return None
    return next((p.get("schema") for p in params if isinstance(p, dict) and p.get("name") == name), None)


def _alternatives(schema: Any, schemas: dict[str, Any], depth: int = 0) -> list[dict[str, Any]]:
    """``schema`` with its ``$ref`` resolved and its ``anyOf``/``oneOf``/``allOf`` spread out."""
    if not isinstance(schema, dict) or depth > 12:
        return []
    ref = schema.get("$ref")
    if isinstance(ref, str):
        return _alternatives(schemas.get(ref.rsplit("/", 1)[-1]), schemas, depth + 1)
    out = [schema]
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or ():
            out += _alternatives(sub, schemas, depth + 1)
    return out


def _has(schema: Any, path: tuple[str, ...], schemas: dict[str, Any]) -> bool:
    """Whether some alternative of ``schema`` has the property path (arrays walked through their items)."""
    if not path:
        return True
    for alt in _alternatives(schema, schemas):
        if "items" in alt and _has(alt["items"], path, schemas):
            return True
        props = alt.get("properties")
        if isinstance(props, dict) and path[0] in props and _has(props[path[0]], path[1:], schemas):
            return True
    return False


def _enum(schema: Any, schemas: dict[str, Any]) -> set[str] | None:
    """The values an enum-like schema admits; None when it names none (a plain string: anything)."""
    values: set[str] = set()
    for alt in _alternatives(schema, schemas):
        values |= {str(v) for v in alt.get("enum") or ()}
        if "const" in alt:
            values.add(str(alt["const"]))
    return values or None
