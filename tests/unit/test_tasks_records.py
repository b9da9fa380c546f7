"""Schema 9 (task episodes): a trajectory may end as an infrastructure error with its cause and carries how
its agent and verifier ended; a committed schema-8 log still decodes; the finish route takes them, checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from steptap.middleware.client import SteptapClient, SteptapError
from steptap.middleware.records import (
    SCHEMA_VERSION,
    LogRecord,
    ProcessEnd,
    TaskRun,
    Trajectory,
    log_decoder,
    msgpack_encoder,
)

FIXTURE_V8 = Path(__file__).parent.parent / "fixtures" / "records-v8.msgpack"


def test_a_v8_log_still_decodes() -> None:
    records = msgspec.msgpack.Decoder(list[LogRecord]).decode(FIXTURE_V8.read_bytes())
    assert [type(r).__name__ for r in records] == ["SessionOpened", "Step", "RewardAdded", "Trajectory"]
    traj = records[3]
    assert isinstance(traj, Trajectory) and traj.schema_version == 8 and SCHEMA_VERSION == 9
    assert (traj.status, traj.error, traj.rewards) == ("aborted", "a reason", {"reward": 1.0})
    assert traj.infra_cause is None and traj.task_run is None  # the defaults of what v9 added


def test_the_new_fields_round_trip() -> None:
    run = TaskRun(agent=ProcessEnd(exit_code=None, timed_out=True, seconds=30.0, output="killed"),
                  verifier=ProcessEnd(exit_code=3, seconds=1.5, output="oops"))
    traj = Trajectory(id="t", status="infra_error", error="the verifier crashed",
                      infra_cause="verifier_crash", task_run=run)
    again = log_decoder.decode(msgpack_encoder.encode(traj))
    assert again == traj and again.reward == 0.0


async def test_the_finish_route_takes_an_infrastructure_error(make_proxy: Any) -> None:
    proxy = await make_proxy("http://127.0.0.1:9")
    run = TaskRun(verifier=ProcessEnd(exit_code=2, seconds=0.5, output="Traceback ...\nKeyError"))
    async with SteptapClient(proxy.url, proxy.token) as client:
        s = await client.open_session(group_id="g", group_size=2)
        reply = await client.finish(s.id, status="infra_error", error="the verifier exited 2",
                                    infra_cause="verifier_crash", task_run=run)
        assert reply["status"] == "infra_error" and reply["infra_cause"] == "verifier_crash"
        traj = await client.get_session(s.id)
        assert (traj.status, traj.infra_cause, traj.task_run, traj.rewards) == (
            "infra_error", "verifier_crash", run, {})
        group = await client._request("GET", "/groups/g")  # an infrastructure error is no member
        assert msgspec.json.decode(group)["complete"] is False
        done = await client.open_session()
        reply = await client.finish(done.id, reward=0.5, task_run=run)  # a verdict may carry its run too
        assert (reply["status"], reply["reward"]) == ("finished", 0.5)
        assert (await client.get_session(done.id)).task_run == run
        bad = [
            ({"status": "infra_error", "error": "x", "reward": 1.0}, "an infrastructure error has no reward"),
            ({"status": "infra_error"}, 'needs its reason in "error"'),
            ({"status": "finished", "infra_cause": "sandbox"}, 'infra_cause goes with "status"'),
            ({"status": "finished", "error": "x"}, 'error goes with "status": "aborted" or "infra_error"'),
            ({"status": "infra_error", "error": "x", "infra_cause": "cosmic_rays"}, "infra_cause"),
            ({"status": "infra_error", "error": "x" * 2001}, "error"),
            ({"status": "infra_error", "error": "x", "task_run": {"agent": {"output": "y" * 16385}}},
             "at most 16384 characters"),
        ]
        for body, message in bad:
            s = await client.open_session()
            with pytest.raises(SteptapError) as err:
                await client._request("POST", f"/sessions/{s.id}/finish", body)
            assert err.value.status == 400 and message in str(err.value), (body, err.value)
            assert (await client.get_session(s.id)).status == "running"  # refused: nothing changed
        s = await client.open_session()
        reply = await client.finish(s.id, status="infra_error", error="why")  # the cause defaults to other
        assert reply["infra_cause"] == "other"
