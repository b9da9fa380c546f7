"""The control plane: trust (control token vs agent credentials), rewards and their validation, finishing,
reward callbacks, idle timeouts, groups, metrics, and rebuilding open sessions from the log after a
restart."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from conftest import Backend, Proxy, ndjson_trajectories

from steptap.middleware.records import RewardAdded, Trajectory
from steptap.middleware.sessions.control import SESSIONS_KEY

pytestmark = pytest.mark.vllm


async def req(
    http: aiohttp.ClientSession,
    method: str,
    url: str,
    data: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    if data is not None and not isinstance(data, bytes):
        data = json.dumps(data).encode()
    async with http.request(
        method, url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    ) as resp:
        return resp.status, await resp.json(content_type=None)


async def open_session(http: aiohttp.ClientSession, proxy: Proxy, **body: Any) -> dict[str, Any]:
    status, info = await req(http, "POST", f"{proxy.url}/sessions", body, proxy.control)
    assert status == 201, info
    return info


async def model_calls(
    http: aiohttp.ClientSession, proxy: Proxy, backend: Backend, info: dict[str, Any], n: int
) -> None:
    """``n`` turns in the session ``info`` (from POST /sessions): its URL and its key, as an agent holds
    them."""
    sid = info["id"]
    messages: list[dict[str, Any]] = []
    for i in range(n):
        messages.append({"role": "user", "content": f"turn {i}"})
        status, reply = await req(
            http,
            "POST",
            f"{proxy.url}/s/{sid}/v1/chat/completions",
            {"model": backend.served_model, "messages": messages, "max_tokens": 2},
            {"Authorization": f"Bearer {info['api_key']}"},
        )
        assert status == 200, reply
        messages.append(reply["choices"][0]["message"])


async def delivered(http: aiohttp.ClientSession, proxy: Proxy) -> dict[str, dict[str, Any]]:
    """Every trajectory the stream delivers (from the start, not following), by id."""
    async with http.get(
        f"{proxy.url}/trajectories", params={"consumer": "test", "follow": "0"}, headers=proxy.control
    ) as resp:
        assert resp.status == 200, await resp.text()
        return {t["id"]: t for t in ndjson_trajectories(await resp.read())}


async def test_agent_credentials_cannot_use_control_routes(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    info = await open_session(http, proxy)
    sid = info["id"]
    routes = [
        ("POST", "/sessions", {}),
        ("GET", f"/sessions/{sid}", None),
        ("POST", f"/sessions/{sid}/rewards", {"value": 1}),
        ("POST", f"/sessions/{sid}/finish", {}),
        ("GET", "/groups/g", None),
        ("GET", "/trajectories?consumer=a&follow=0", None),
        ("POST", "/trajectories/ack", {"consumer": "a", "cursor": "1:8"}),
    ]
    if any(
        r.resource is not None and r.resource.canonical == "/admin/weights" for r in proxy.app.router.routes()
    ):  # type: ignore[attr-defined]
        routes.append(("POST", "/admin/weights", {"path": "/tmp/x"}))
    for method, path, body in routes:
        for headers in ({"Authorization": f"Bearer {info['api_key']}"}, {"X-Steptap-Session": sid}):
            status, err = await req(http, method, proxy.url + path, body, headers)
            expected = 403 if "Authorization" in headers else 401
            assert status == expected and err["error"]["message"], (method, path, headers, err)
        status, err = await req(
            http, method, f"{proxy.url}/s/{sid}{path}", body, {"Authorization": f"Bearer {info['api_key']}"}
        )
        assert status == 403 and err["error"]["code"] == "forbidden", (method, path)
        status, err = await req(http, method, proxy.url + path, body, {"Authorization": "Bearer wrong-token"})
        assert status == 403, (method, path)
    # nothing changed: the session is open, without rewards
    status, traj = await req(http, "GET", f"{proxy.url}/sessions/{sid}", None, proxy.control)
    assert status == 200 and traj["status"] == "running" and traj["rewards"] == {}
    # the session key still makes model calls
    status, _ = await req(
        http,
        "POST",
        f"{proxy.url}/v1/chat/completions",
        {"model": vllm_server.served_model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
        {"Authorization": f"Bearer {info['api_key']}"},
    )
    assert status == 200


@pytest.mark.parametrize(
    "body, status",
    [
        (b'{"value": NaN}', 400),
        (b'{"value": Infinity}', 400),
        (b'{"value": 1e999}', 400),
        ({"value": "1.0"}, 400),
        ({"value": True}, 400),
        ({"name": "x"}, 400),
        ({}, 400),
        (b"", 400),
        (b"{oops", 400),
        (b"[1]", 400),
        ({"value": 1, "step": 7}, 404),
        ({"value": 1, "step": -1}, 400),
        ({"value": 1, "step": "first"}, 400),
        ({"value": 1, "name": ""}, 400),
        ({"value": 1, "extra": 1}, 400),
        ({"value": None}, 400),
    ],
)
async def test_bad_reward_bodies_are_4xx_and_change_nothing(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession, body: Any, status: int
) -> None:
    info = await open_session(http, proxy)
    await model_calls(http, proxy, vllm_server, info, 1)
    got, err = await req(http, "POST", f"{proxy.url}/sessions/{info['id']}/rewards", body, proxy.control)
    assert got == status and err["error"]["message"], err
    _, traj = await req(http, "GET", f"{proxy.url}/sessions/{info['id']}", None, proxy.control)
    assert traj["rewards"] == {} and traj["steps"][0]["rewards"] == {}
    records = list(proxy.app[SESSIONS_KEY].log.records())  # type: ignore[index]
    assert not any(isinstance(r, RewardAdded) for r in records)


async def test_rewards_finish_and_their_errors(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    base = f"{proxy.url}/sessions"
    got, err = await req(http, "POST", f"{base}/nope/rewards", {"value": 1}, proxy.control)
    assert got == 404 and err["error"]["code"] == "session_not_found"
    info = await open_session(http, proxy)
    sid = info["id"]
    got, err = await req(http, "POST", f"{base}/{sid}/rewards", {"value": 1, "step": "last"}, proxy.control)
    assert got == 404 and err["error"]["code"] == "step_not_found"  # no steps yet
    for bad in ({"status": "done"}, {"reward": "x"}, b'{"reward": NaN}', {"status": "timed_out"}):
        got, _ = await req(http, "POST", f"{base}/{sid}/finish", bad, proxy.control)
        assert got == 400
    got, done = await req(
        http, "POST", f"{base}/{sid}/finish", {"reward": 1.5, "status": "aborted"}, proxy.control
    )
    assert got == 200 and done["status"] == "aborted" and done["reward"] == 1.5
    got, err = await req(http, "POST", f"{base}/{sid}/finish", {}, proxy.control)
    assert got == 409 and err["error"]["code"] == "session_closed"
    # a reward after the finish is recorded as late (never trained: test_pending_rewards.py)
    got, late = await req(http, "POST", f"{base}/{sid}/rewards", {"value": 1}, proxy.control)
    assert got == 200 and late["late"] is True
    got, _ = await req(
        http,
        "POST",
        f"{proxy.url}/s/{sid}/v1/chat/completions",
        {"model": vllm_server.served_model, "messages": [{"role": "user", "content": "x"}]},
        {"Authorization": f"Bearer {info['api_key']}"},
    )
    assert got == 409  # a closed session takes no more model calls
    got, traj = await req(http, "GET", f"{base}/{sid}", None, proxy.control)
    assert got == 200 and traj["status"] == "aborted"  # still readable after closing
    got, err = await req(http, "POST", f"{proxy.url}/sessions", {"id": sid}, proxy.control)
    assert got == 409
    got, err = await req(http, "POST", f"{proxy.url}/sessions", {"group_size": 0}, proxy.control)
    assert got == 400


async def test_process_rewards_arrive_on_the_right_steps(
    proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    info = await open_session(http, proxy, group_id="pr", mode="train")
    sid = info["id"]
    await model_calls(http, proxy, vllm_server, info, 3)
    for body in (
        {"value": 0.5, "step": 0, "name": "format"},
        {"value": 1, "step": "last"},
        {"value": -0.25, "step": 0},
        {"value": 0.1, "name": "length"},
    ):
        got, ok = await req(http, "POST", f"{proxy.url}/sessions/{sid}/rewards", body, proxy.control)
        assert got == 200, ok
    got, _ = await req(http, "POST", f"{proxy.url}/sessions/{sid}/finish", {"reward": 2}, proxy.control)
    assert got == 200
    traj = (await delivered(http, proxy))[sid]
    assert [s["rewards"] for s in traj["steps"]] == [{"format": 0.5, "reward": -0.25}, {}, {"reward": 1.0}]
    assert traj["rewards"] == {"length": 0.1, "reward": 2.0} and traj["status"] == "finished"
    assert [s["index"] for s in traj["steps"]] == [0, 1, 2] and traj["group_id"] == "pr"


def raising_reward(traj: Trajectory) -> float:
    raise RuntimeError("grader crashed")


async def test_a_reward_callback_that_raises_still_delivers(
    make_proxy: Any, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(vllm_server.url, reward_fn=raising_reward)
    info = await open_session(http, proxy)
    await model_calls(http, proxy, vllm_server, info, 1)
    got, done = await req(
        http, "POST", f"{proxy.url}/sessions/{info['id']}/finish", {"reward": 1}, proxy.control
    )
    assert got == 200 and "grader crashed" in done["error"]
    traj = (await delivered(http, proxy))[info["id"]]
    assert traj["status"] == "finished" and "RuntimeError: grader crashed" in traj["error"]
    assert traj["rewards"] == {"reward": 1.0} and len(traj["steps"]) == 1
    errors = proxy.app[SESSIONS_KEY].metrics.reward_errors  # type: ignore[index]
    assert errors.labels("error")._value.get() == 1


@pytest.mark.parametrize(
    "result, steps, total",
    [
        (0.75, [{}, {}], {"callback": 0.75}),
        ([0.1, 0.2], [{"callback": 0.1}, {"callback": 0.2}], {}),
        ({"1": 1.0}, [{}, {"callback": 1.0}], {}),
        ("async", [{}, {}], {"callback": 3.0}),
        ("slow", [{}, {}], {}),
        ([1.0], [{}, {}], {}),  # wrong length: recorded as an error, nothing applied
    ],
)
async def test_reward_callback_results(
    make_proxy: Any,
    vllm_server: Backend,
    http: aiohttp.ClientSession,
    result: Any,
    steps: list[Any],
    total: dict[str, float],
) -> None:
    if result == "async":

        async def fn(traj: Trajectory) -> float:
            await asyncio.sleep(0)
            return 3.0
    elif result == "slow":

        async def fn(traj: Trajectory) -> float:
            await asyncio.sleep(5)
            return 1.0
    else:

        def fn(traj: Trajectory) -> Any:
            assert len(traj.steps) == 2
            return result

    # only "slow" is meant to time out (its sleep's deadline comes after the timeout's, on one loop: always);
    # a callback that returns at once gets a bound no load reaches (0.3 s for all was passed once in CI)
    timeout = 0.3 if result == "slow" else 60.0
    proxy = await make_proxy(vllm_server.url, reward_fn=fn, reward_timeout_s=timeout)
    info = await open_session(http, proxy)
    await model_calls(http, proxy, vllm_server, info, 2)
    got, done = await req(http, "POST", f"{proxy.url}/sessions/{info['id']}/finish", None, proxy.control)
    assert got == 200
    traj = (await delivered(http, proxy))[info["id"]]
    assert [s["rewards"] for s in traj["steps"]] == steps and traj["rewards"] == total
    if result == "slow":
        assert "timed out" in traj["error"]
    elif result == [1.0]:
        assert "1 per-step rewards for 2 steps" in traj["error"]
    else:
        assert traj["error"] is None


async def test_idle_sessions_time_out_and_are_delivered(
    make_proxy: Any, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(vllm_server.url, session_idle_timeout_s=0.3)
    info = await open_session(http, proxy)
    keep = await open_session(http, proxy, idle_timeout_s=60)
    await model_calls(http, proxy, vllm_server, info, 1)
    for _ in range(100):
        await asyncio.sleep(0.05)
        if info["id"] not in proxy.app[SESSIONS_KEY].sessions:  # type: ignore[index]
            break
    got_all = await delivered(http, proxy)
    assert got_all[info["id"]]["status"] == "timed_out" and len(got_all[info["id"]]["steps"]) == 1
    assert keep["id"] not in got_all
    got, traj = await req(http, "GET", f"{proxy.url}/sessions/{keep['id']}", None, proxy.control)
    assert traj["status"] == "running"


async def test_groups_complete_when_full_or_timed_out(
    make_proxy: Any, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    # "g" fills with its third finish, ten calls after it opened: a timeout far above those calls under any
    # load (0.5 s could be reached on a loaded CI); "h" is waited for until the sweep times it out
    proxy = await make_proxy(vllm_server.url, group_timeout_s=5.0)
    members = [await open_session(http, proxy, group_id="g", group_size=3) for _ in range(3)]
    lonely = await open_session(http, proxy, group_id="h", group_size=4)
    for m, status in zip(members, ("finished", "aborted", "finished"), strict=False):
        got, _ = await req(http, "GET", f"{proxy.url}/groups/g", None, proxy.control)
        got, _ = await req(
            http, "POST", f"{proxy.url}/sessions/{m['id']}/finish", {"status": status}, proxy.control
        )
        assert got == 200
    got, group = await req(http, "GET", f"{proxy.url}/groups/g", None, proxy.control)
    assert got == 200 and group["complete"] and group["reason"] == "full"
    assert group["counts"] == {"finished": 2, "aborted": 1} and group["size"] == 3
    _, traj = await req(http, "GET", f"{proxy.url}/sessions/{members[0]['id']}", None, proxy.control)
    assert traj["group"]["complete"]  # the group's state is on each member too
    got, group = await req(http, "GET", f"{proxy.url}/groups/h", None, proxy.control)
    assert not group["complete"]
    for _ in range(600):
        got, group = await req(http, "GET", f"{proxy.url}/groups/h", None, proxy.control)
        if group["complete"]:
            break
        await asyncio.sleep(0.1)
    assert group["reason"] == "timeout" and group["members"] == {lonely["id"]: "running"}, group
    got, err = await req(http, "GET", f"{proxy.url}/groups/none", None, proxy.control)
    assert got == 404
    delivered_ids = set(await delivered(http, proxy))
    assert {m["id"] for m in members} <= delivered_ids  # the aborted member is delivered with its group


async def test_open_sessions_survive_a_restart(
    make_proxy: Any, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(vllm_server.url)
    info = await open_session(http, proxy, group_id="r", group_size=2, metadata={"k": 1})
    done = await open_session(http, proxy)
    await model_calls(http, proxy, vllm_server, info, 2)
    await req(
        http, "POST", f"{proxy.url}/sessions/{info['id']}/rewards", {"value": 0.5, "step": 1}, proxy.control
    )
    await req(http, "POST", f"{proxy.url}/sessions/{done['id']}/finish", {}, proxy.control)
    before = proxy.app[SESSIONS_KEY].sessions[info["id"]].trajectory  # type: ignore[index]
    await proxy.server.close()  # type: ignore[attr-defined]

    again = await make_proxy(vllm_server.url, log_dir=proxy.log_dir)
    got, traj = await req(http, "GET", f"{again.url}/sessions/{info['id']}", None, again.control)
    assert got == 200 and traj["status"] == "running" and traj["metadata"] == {"k": 1}
    assert [s["response_token_ids"] for s in traj["steps"]] == [s.response_token_ids for s in before.steps]
    assert traj["steps"][1]["rewards"] == {"reward": 0.5}
    got, _ = await req(http, "POST", f"{again.url}/sessions/{done['id']}/finish", {}, again.control)
    assert got == 409  # closed before the restart stays closed
    # the session key still works, and indexes continue
    got, _ = await req(
        http,
        "POST",
        f"{again.url}/v1/chat/completions",
        {"model": vllm_server.served_model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
        {"Authorization": f"Bearer {info['api_key']}"},
    )
    assert got == 200
    got, done_info = await req(http, "POST", f"{again.url}/sessions/{info['id']}/finish", {}, again.control)
    assert got == 200 and done_info["steps"] == 3


async def test_metrics_exposition(proxy: Proxy, vllm_server: Backend, http: aiohttp.ClientSession) -> None:
    info = await open_session(http, proxy)
    await model_calls(http, proxy, vllm_server, info, 1)
    await req(http, "POST", f"{proxy.url}/sessions/{info['id']}/finish", {"reward": 1}, proxy.control)
    async with http.get(f"{proxy.url}/metrics") as resp:
        assert resp.status == 200 and resp.content_type == "text/plain"
        text = await resp.text()
    for family in (
        "steptap_calls_total",
        "steptap_call_latency_seconds_bucket",
        "steptap_steps_total",
        "steptap_prompt_tokens_total",
        "steptap_response_tokens_total",
        "steptap_trajectories_total",
        "steptap_rewards_total",
        "steptap_prefix_steps_total",
        "steptap_log_commit_seconds_bucket",
        "steptap_reward_value_bucket",
        "steptap_sessions_open",
    ):
        assert family in text, family
    assert 'steptap_trajectories_total{status="finished"} 1.0' in text
    # The mean reward is readable (sum / count) even though the histogram has negative buckets.
    assert "steptap_reward_sum 1.0" in text and "steptap_reward_value_count 1.0" in text
    assert 'route="/s/{agent_session}/v1/chat/completions",status="200"' in text


async def test_metrics_can_require_the_control_token(
    make_proxy: Any, vllm_server: Backend, http: aiohttp.ClientSession
) -> None:
    proxy = await make_proxy(vllm_server.url, metrics_need_token=True)
    async with http.get(f"{proxy.url}/metrics") as resp:
        assert resp.status == 401
    async with http.get(f"{proxy.url}/metrics", headers=proxy.control) as resp:
        assert resp.status == 200 and "steptap_calls_total" in await resp.text()
