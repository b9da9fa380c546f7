"""Fuzzing every route of the proxy in front of the real vLLM server (strategies in tests/fuzzing.py):
no 5xx other than the documented backend errors, no hang, every error in OpenAI's body; afterwards the log
reads back completely (every step and trajectory the proxy counted) and a new proxy starts on it.

Deterministic in CI (``derandomize=True``, no example database); ``bench/fuzz_long.py`` is the long random
run. The hypothesis loop runs in a thread with a blocking client, so the in-process proxy keeps serving on
the test's event loop."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import aiohttp
import pytest
from conftest import Backend, Proxy, ndjson_trajectories
from fuzzing import Request, control_call, model_call, send
from hypothesis import HealthCheck, given, settings

from steptap.middleware.delta import steps_of
from steptap.middleware.metrics import METRICS_KEY
from steptap.middleware.records import Trajectory
from steptap.middleware.sessions.control import SESSIONS_KEY

pytestmark = pytest.mark.vllm

EXAMPLES = 150  # per strategy; about 30 s on the tiny model on 2 busy cores


def _settings() -> settings:
    return settings(
        derandomize=True, database=None, max_examples=EXAMPLES, deadline=None,
        suppress_health_check=list(HealthCheck),
    )


async def _open(http: aiohttp.ClientSession, proxy: Proxy, n: int) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        async with http.post(f"{proxy.url}/sessions", json={"group_id": f"fz{i % 2}"},
                             headers=proxy.control) as r:
            assert r.status == 201
            out.append(await r.json())
    return out


def _statuses(statuses: Counter) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items()))


async def test_fuzz_every_route_then_the_log_reads_back(
    make_proxy: Any, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    # --any-model: any model name reaches the backend and the record, the widest path a body can take
    proxy = await make_proxy(vllm_server.url, any_model=True)
    sessions = await _open(http, proxy, 4)
    keys, ids = [s["api_key"] for s in sessions], [s["id"] for s in sessions]
    statuses: Counter = Counter()

    @_settings()
    @given(model_call(vllm_server.served_model, keys))
    def fuzz_models(req: Request) -> None:
        statuses[send(proxy.url, req)[0]] += 1

    @_settings()
    @given(control_call(proxy.token, ids))
    def fuzz_control(req: Request) -> None:
        statuses[send(proxy.url, req)[0]] += 1

    await asyncio.to_thread(fuzz_models)
    await asyncio.to_thread(fuzz_control)
    print("statuses:", _statuses(statuses))
    assert statuses[200] > 0 and statuses[400] > 0  # both the good and the refused paths were exercised
    # still serving
    body = {"model": vllm_server.served_model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1}
    async with http.post(f"{proxy.url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200

    await asyncio.sleep(0.3)  # anonymous closes run in the background
    manager = proxy.app[SESSIONS_KEY]  # type: ignore[index]
    records = list(manager.log.records())
    steps = list(steps_of(records))
    closed = [r for r in records if isinstance(r, Trajectory)]
    metrics = proxy.app[METRICS_KEY]  # type: ignore[index]
    counted_steps = sum(s.value for m in metrics.steps.collect() for s in m.samples
                        if s.name.endswith("_total"))
    counted_closed = sum(
        s.value for m in metrics.trajectories.collect() for s in m.samples if s.name.endswith("_total")
    )
    assert len(steps) == counted_steps and len(closed) == counted_closed, (len(steps), counted_steps)
    open_before = set(manager.sessions)
    await proxy.server.close()  # type: ignore[attr-defined]

    again = await make_proxy(vllm_server.url, log_dir=proxy.log_dir, any_model=True)
    assert set(again.app[SESSIONS_KEY].sessions) == open_before  # type: ignore[index]
    async with http.get(
        f"{again.url}/trajectories", params={"consumer": "check", "follow": "0"}, headers=again.control
    ) as resp:
        assert resp.status == 200
        delivered = ndjson_trajectories(await resp.read())
    assert len(delivered) == len(closed)
    assert sum(len(t["steps"]) for t in delivered) <= len(steps)
