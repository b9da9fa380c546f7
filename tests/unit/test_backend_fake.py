"""What the proxy does with a backend failure once ``backend/`` mapped it, on ``tests/faults.py``'s
``FaultBackend`` (the ``Backend`` protocol with no HTTP below it): a token-in-token-out route's error status,
a generate stream cut or malformed mid-way. The mapping itself (aiohttp's errors to ``Backend*``) is tested
on a real connection (tests/integration/test_proxy_errors.py, FaultInjector)."""

from __future__ import annotations

from typing import Any

import pytest
from faults import FaultBackend

from steptap.middleware.backend.boundary import Backend
from steptap.middleware.backend.client import BackendClient
from steptap.middleware.exceptions import BackendCut, BackendMalformed, BackendStatus
from steptap.middleware.proxy import protocols, tito
from steptap.middleware.proxy.tito_plan import Plan

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
GENERATE = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}, "stream": True}


def test_the_client_and_the_fake_stand_behind_one_protocol() -> None:
    assert isinstance(BackendClient("http://127.0.0.1:1"), Backend)
    assert isinstance(FaultBackend({}), Backend)


async def _drain(turn: tito.Turn) -> list[list[bytes]]:
    got = []
    async for batch in turn.chunks(GENERATE):
        got.append(batch)
    return got


async def test_a_render_route_missing_is_asked_again_and_a_refusal_is_kept() -> None:
    missing = FaultBackend({"chat.render": [(404, b'{"detail":"Not Found"}')] * 2})
    assert await protocols.keeps_mid_system(missing, "fake-404")  # no scale-out: kept, not cached
    assert await protocols.keeps_mid_system(missing, "fake-404")
    assert [c[0] for c in missing.calls] == ["chat.render", "chat.render"]
    refused = FaultBackend({"chat.render": [(400, b'{"error":{"message":"no system here"}}')]})
    assert not await protocols.keeps_mid_system(refused, "fake-400")  # the template raised on it: cached
    assert not await protocols.keeps_mid_system(refused, "fake-400")
    assert len(refused.calls) == 1


async def test_a_generate_error_status_is_backend_status_and_the_stream_released() -> None:
    fake = FaultBackend({"generate": [(404, [])]})
    with pytest.raises(BackendStatus) as caught:
        await _drain(tito.Turn(fake, CHAT, Plan([], None, "tokens")))
    assert caught.value.status == 404
    assert "--enable-scale-out" in tito.backend_error(fake.name, caught.value).message
    assert fake.released == 1


@pytest.mark.parametrize(("batches", "error", "says"), [
    ([[b""], BackendCut("backend fault://backend cut the stream: reset")], BackendCut, "cut the stream"),
    ([[b'data: {"choices": [{"index": 0'], [b"data: [DONE]"]], BackendMalformed,
     "fault://backend sent a malformed token-in-token-out answer"),
])
async def test_a_generate_stream_cut_or_malformed_mid_way_ends_as_its_backend_error(
        batches: list[Any], error: type[Exception], says: str) -> None:
    fake = FaultBackend({"generate": [(200, batches)]})
    with pytest.raises(error, match=says):
        await _drain(tito.Turn(fake, CHAT, Plan([], None, "tokens")))
    assert fake.released == 1
    assert fake.calls[0][0] == "generate" and b'"token_ids":[1,2,3]' in fake.calls[0][1]
