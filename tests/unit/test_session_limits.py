"""The session domain under pressure, over HTTP, with no model call (the backend is a refused address: the
control plane needs none): a reward racing ``finish`` is either in the delivered trajectory or refused, ids
with a trailing newline are refused, sessions time out by default, and what closed sessions leave behind is
bounded (checked with the proxy's own gauges and dictionaries); and the JSON value count that bounds a body
before it is decoded."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from conftest import Proxy, ndjson_trajectories
from faults import MODEL, FaultInjector, refused_address
from hypothesis import given
from hypothesis import strategies as st

from steptap.middleware.config import ProxyConfig
from steptap.middleware.sessions.control import SESSIONS_KEY
from steptap.middleware.sessions.identity import Identity
from steptap.middleware.sessions.limits import json_nodes


@pytest.fixture
async def control_proxy(make_proxy: Any) -> Any:
    sock, url = refused_address()
    try:
        yield lambda **kw: make_proxy(url, **kw)
    finally:
        sock.close()


async def post(http: aiohttp.ClientSession, proxy: Proxy, path: str, body: Any) -> tuple[int, Any]:
    async with http.post(f"{proxy.url}{path}", data=json.dumps(body), headers=proxy.control) as resp:
        return resp.status, await resp.json(content_type=None)


async def delivered(http: aiohttp.ClientSession, proxy: Proxy) -> dict[str, dict[str, Any]]:
    async with http.get(
        f"{proxy.url}/trajectories", params={"consumer": "t", "follow": "0"}, headers=proxy.control
    ) as resp:
        assert resp.status == 200
        return {t["id"]: t for t in ndjson_trajectories(await resp.read())}


async def test_a_reward_racing_finish_is_in_the_trajectory_or_refused(
    control_proxy: Any, http: aiohttp.ClientSession
) -> None:
    proxy = await control_proxy()
    rounds, rewards = 6, 40
    answered: dict[str, set[str]] = {}
    for _r in range(rounds):
        status, info = await post(http, proxy, "/sessions", {})
        assert status == 201
        sid = info["id"]

        async def reward(i: int, sid: str = sid) -> tuple[str, int]:
            status, body = await post(http, proxy, f"/sessions/{sid}/rewards",
                                      {"value": 1.0, "name": f"r{i}"})
            assert status in (200, 409), body
            return f"r{i}", status

        # the finish is sent from the middle of the rewards, so some land before it and some race it
        tasks = [asyncio.ensure_future(reward(i)) for i in range(rewards // 2)]
        finish = asyncio.ensure_future(post(http, proxy, f"/sessions/{sid}/finish", {}))
        tasks += [asyncio.ensure_future(reward(i)) for i in range(rewards // 2, rewards)]
        results = await asyncio.gather(*tasks)
        assert (await finish)[0] == 200
        answered[sid] = {name for name, status in results if status == 200}
        refused = [name for name, status in results if status == 409]
        assert len(answered[sid]) + len(refused) == rewards
    got = await delivered(http, proxy)
    for sid, names in answered.items():
        # every 200'd reward is in the delivered trajectory; nothing refused is
        assert set(got[sid]["rewards"]) == names, (sid, sorted(names - set(got[sid]["rewards"])))


async def test_session_ids_are_matched_whole(control_proxy: Any, http: aiohttp.ClientSession) -> None:
    proxy = await control_proxy()
    for bad in ("abc\n", "abc\r\n", "-abc", "a" * 129, "auto:taken"):
        status, body = await post(http, proxy, "/sessions", {"id": bad})
        assert status == 400 and body["error"]["code"] == "invalid_session_id", (bad, body)
    status, _ = await post(http, proxy, "/sessions", {"id": "a" * 128})
    assert status == 201
    # on an agent's path too (%0A is a newline once the path is decoded)
    async with http.post(f"{proxy.url}/s/abc%0A/v1/chat/completions", json={"messages": []}) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_session_id"


async def test_sessions_time_out_by_default(control_proxy: Any, http: aiohttp.ClientSession) -> None:
    assert ProxyConfig(backend="x").session_idle_timeout_s == 600.0
    proxy = await control_proxy()
    status, info = await post(http, proxy, "/sessions", {})
    async with http.get(f"{proxy.url}/sessions/{info['id']}", headers=proxy.control) as resp:
        assert (await resp.json())["idle_timeout_s"] == 600.0


async def test_closed_sessions_leave_bounded_state(control_proxy: Any, http: aiohttp.ClientSession) -> None:
    proxy = await control_proxy(max_closed_sessions=3, max_groups=2)
    ids = []
    for i in range(7):
        status, info = await post(http, proxy, "/sessions", {"group_id": f"g{i}", "group_size": 1})
        assert status == 201
        ids.append(info["id"])
        assert (await post(http, proxy, f"/sessions/{info['id']}/finish", {}))[0] == 200
    status, still_open = await post(http, proxy, "/sessions", {"group_id": "open"})
    manager = proxy.app[SESSIONS_KEY]  # type: ignore[index]
    assert list(manager.closed) == ids[-3:]
    assert len(manager.keys) <= 3 + 1 and still_open["api_key"] in manager.keys
    assert len(manager.groups) <= 2 and "open" in manager.groups
    assert len(await delivered(http, proxy)) == 7  # the log keeps them all
    # the most recent closed ids still answer 409, as before
    assert (await post(http, proxy, f"/sessions/{ids[-1]}/finish", {}))[0] == 409


def test_limits_are_checked_at_start() -> None:
    with pytest.raises(ValueError, match="max_session_bytes"):
        ProxyConfig(backend="x", max_record_bytes=1000, max_session_bytes=2000)
    with pytest.raises(ValueError, match="max_concurrent_calls"):
        ProxyConfig(backend="x", max_concurrent_calls=0)


def test_serve_flags_set_every_limit(capsys: pytest.CaptureFixture[str]) -> None:
    from steptap.middleware.server.serve import config_from_args

    # every limit of docs/limits.md has its generated flag (flags.py), defaults from ProxyConfig
    fields = ["max_record_bytes", "max_n", "max_session_steps", "max_session_bytes", "max_concurrent_calls",
              "max_open_sessions", "upstream_max_connections", "max_closed_sessions", "max_groups"]
    _LIMITS = [("--" + f.replace("_", "-"), f, "") for f in fields]
    args = ["--backend", "http://127.0.0.1:9"]
    for i, (flag, _, _) in enumerate(_LIMITS):
        args += [flag, str(1000 + i)]
    args[args.index("--max-record-bytes") + 1] = str(10**9)  # above max_session_bytes
    config = config_from_args(args)
    assert [getattr(config, field) for _, field, _ in _LIMITS] == [10**9] + [1000 + i
                                                                             for i in range(1, len(_LIMITS))]
    assert config_from_args(["--backend", "x"]).session_idle_timeout_s == 600.0
    assert config_from_args(["--backend", "x", "--session-idle-timeout", "0"]).session_idle_timeout_s is None
    with pytest.raises(SystemExit):
        config_from_args(["--backend", "x", "--max-record-bytes", "1000", "--max-session-bytes", "2000"])
    assert "must not exceed max_record_bytes" in capsys.readouterr().err


async def test_reward_names_count_toward_the_session_bytes(control_proxy: Any,
                                                           http: aiohttp.ClientSession) -> None:
    proxy = await control_proxy(max_session_bytes=2000)
    status, info = await post(http, proxy, "/sessions", {})
    answered = []
    for i in range(100):  # each new name grows the Trajectory record: the session fills up
        status, body = await post(http, proxy, f"/sessions/{info['id']}/rewards",
                                  {"value": 1, "name": f"n{i:03d}"})
        if status != 200:
            assert status == 409 and body["error"]["code"] == "session_full", body
            break
        answered.append(f"n{i:03d}")
    assert 10 < len(answered) < 100
    # a name already there takes no room
    assert (await post(http, proxy, f"/sessions/{info['id']}/rewards",
                       {"value": 2, "name": "n000"}))[0] == 200
    assert (await post(http, proxy, f"/sessions/{info['id']}/finish", {}))[0] == 200
    assert sorted((await delivered(http, proxy))[info["id"]]["rewards"]) == answered
    status, body = await post(http, proxy, "/sessions", {"metadata": {"blob": "x" * 3000}})
    assert status == 413 and body["error"]["code"] == "record_too_large", body


async def test_a_pending_auto_session_no_call_holds_is_forgotten_after_the_idle_timeout(
        control_proxy: Any) -> None:
    """Issue 42, item 1: a pending auto session (its first call not yet recorded) counts against
    max_auto_sessions; one that no call holds any more is forgotten by the idle sweep, never kept for good."""
    proxy = await control_proxy(sweep_interval_s=3600)  # swept here, by hand
    manager = proxy.app[SESSIONS_KEY]  # type: ignore[index]
    session = await manager.resolve(Identity("path", session_id="made-up"), "10.0.0.1")
    assert manager.pending == {"auto:made-up": session} and manager.auto_peers == {"10.0.0.1": 1}
    with manager.first_call(session):  # a call reading its images: held, however long it takes
        session.last_active -= 3600
        manager.sweep()
        assert "auto:made-up" in manager.pending
    manager.sweep()
    assert manager.pending == {} and manager.auto_peers == {}


async def test_held_trajectories_are_bounded(control_proxy: Any, http: aiohttp.ClientSession) -> None:
    proxy = await control_proxy(max_held_trajectories=2)
    for i in range(3):
        status, info = await post(http, proxy, "/sessions", {})
        status, body = await post(http, proxy, f"/sessions/{info['id']}/finish", {"reward": "pending"})
        if i < 2:
            assert status == 200, body
    assert status == 429 and "max_held_trajectories" in body["error"]["message"], body


async def test_the_bytes_open_sessions_hold_are_bounded(aiohttp_server: Any, make_proxy: Any,
                                                        http: aiohttp.ClientSession) -> None:
    backend = await aiohttp_server(FaultInjector().app)
    proxy = await make_proxy(str(backend.make_url("")).rstrip("/"), max_bytes_held=20_000)
    status, info = await post(http, proxy, "/sessions", {})
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 1000}]}
    statuses = []
    for _ in range(30):
        async with http.post(f"{info['base_url']}/chat/completions", json=chat,
                             headers={"Authorization": f"Bearer {info['api_key']}"}) as resp:
            statuses.append(resp.status)
            if resp.status != 200:
                body = await resp.json()
                break
    assert statuses[0] == 200 and statuses[-1] == 429, statuses
    assert "max_bytes_held" in body["error"]["message"], body
    assert proxy.app[SESSIONS_KEY].bytes_held <= 20_000  # type: ignore[index]


@given(st.recursive(st.none() | st.integers() | st.text(alphabet=',{["\\ a'),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner,
                                                                                  max_size=4), max_leaves=20))
def test_json_nodes_counts_openings_and_commas(value: Any) -> None:
    raw = json.dumps(value).encode()
    quick = raw.count(b",") + raw.count(b"{") + raw.count(b"[")  # the bound: every opening and comma
    assert json_nodes(raw, 10**9) == quick
    # past the cap, counted again outside strings: braces and commas in text are not values
    assert json_nodes(raw, -1) == _openings_and_commas(value)


def _openings_and_commas(value: Any) -> int:
    items = list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else None
    if items is None:
        return 0
    return 1 + max(0, len(items) - 1) + sum(_openings_and_commas(v) for v in items)


@pytest.mark.parametrize("cap", [10**6, 40])
def test_a_small_body_is_charged_its_worst_case_and_a_large_one_its_count(cap: int) -> None:
    from steptap.middleware.exceptions import RequestTooComplex
    from steptap.middleware.metrics import Metrics
    from steptap.middleware.sessions.limits import CALL_COPIES, NODE_BYTES, SMALL_BODY, Holdings
    holdings = Holdings(ProxyConfig(max_json_nodes=cap), Metrics())
    small = json.dumps({"messages": [{"role": "user", "content": "x" * 100}]}).encode()
    large = json.dumps({"messages": [{"role": "user", "content": "x" * SMALL_BODY}]}).encode()
    with holdings.body_memory(len(small)) as hold:
        hold.read(small)
        # uncounted (a value per byte) while the cap is above its length; counted when it is not
        nodes = len(small) if cap >= len(small) else json_nodes(small, cap)
        assert hold.size == holdings.body_bytes == CALL_COPIES * len(small) + NODE_BYTES * nodes
    with holdings.body_memory(len(large)) as hold:
        hold.read(large)
        counted = json_nodes(large, cap)
        assert hold.size == CALL_COPIES * len(large) + NODE_BYTES * counted and counted < len(large)
    assert holdings.body_bytes == 0
    bomb = b"[" + b"{}," * 100 + b"{}]"  # under SMALL_BODY, 101 values: past a cap below that, still a 413
    with holdings.body_memory(len(bomb)) as hold:
        if cap < 101:
            with pytest.raises(RequestTooComplex):
                hold.read(bomb)
        else:
            hold.read(bomb)
