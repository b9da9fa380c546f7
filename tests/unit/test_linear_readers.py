"""What a finished long session costs its readers is linear in what it logged, not turns x context: the NDJSON
stream carries it as logged (delta steps stay deltas, resolved by the reader), the reward callback is handed
steps built as it reads them, and the learner's samples refer to their packed sequence instead of copying
their prompts. A real log, session manager and stream routes; steps built as capture builds them
(test_delta_steps.turns)."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import msgspec
import pytest
from test_delta_steps import TOKEN, make_stream_app, turns

from steptap.learner.rows import build_batch
from steptap.middleware.client import SteptapClient
from steptap.middleware.config import ProxyConfig
from steptap.middleware.delta import LazySteps
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.metrics import Metrics
from steptap.middleware.records import Step, Trajectory, msgpack_encoder
from steptap.middleware.sessions.manager import SessionManager
from steptap.middleware.wire import StreamMessage, decode_envelope, decode_trajectory, encode_message

enc = msgpack_encoder.encode
N = 50


async def finished_session(tmp_path: Path, reward_fn: Any = None) -> tuple[TrajectoryLog, list[Step]]:
    """A 50-turn session over a context growing 162 ids a turn (3,000 -> ~11,000), finished, on a real log."""
    log = await TrajectoryLog.open(str(tmp_path / "log"))
    manager = SessionManager(ProxyConfig(log=str(tmp_path / "log")), log, Metrics(), reward_fn, set())
    steps = turns(N)
    session = await manager.open(session_id="long")
    for step in steps:
        await manager.record(session, [step])
    await manager.finish(session, reward=1.0)
    return log, steps


def json_size(steps: list[Step]) -> int:
    return sum(len(msgspec.json.encode(s)) for s in steps)


async def test_an_ndjson_line_costs_the_sessions_new_tokens_not_its_context(
    tmp_path: Path, aiohttp_server: Any
) -> None:
    log, steps = await finished_session(tmp_path)
    logged = [r for r in log.records() if isinstance(r, Step)]
    server = await aiohttp_server(make_stream_app(log))
    url = str(server.make_url("")).rstrip("/")
    async with SteptapClient(url, TOKEN) as client:
        async with client._http().get(url + "/trajectories", params={"follow": "0"},
                                      headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            body = await resp.read()
        got = [d.trajectory async for d in client.trajectories("c", follow=False, format="ndjson")]
    [line] = [json.loads(x) for x in body.splitlines() if b'"trajectory"' in x]
    # What a line holds: the Trajectory record (references, no steps) and the logged steps, deltas as deltas
    assert line["trajectory"]["steps"] == [] and len(line["trajectory"]["step_refs"]) == N
    assert len(line["steps"]) == N and line["steps"][2]["delta"]["base"] == 1
    assert len(line["steps"][2]["prompt_token_ids"]) == 150  # only the new ids
    # O(new tokens): about what the log holds, a small part of the full steps (each its whole context)
    assert len(body) < 1.2 * json_size(logged) + 10_000
    assert 10 * len(body) < json_size(steps)
    # the client resolves the line into the steps as made (NaN logprobs read back from JSON null)
    assert [enc(s) for s in got[0].steps] == [enc(s) for s in steps]
    await log.close()


def test_an_older_full_step_ndjson_line_still_reads() -> None:
    """A line as the stream wrote it before it carried logged steps: full steps embedded, no ``steps``."""
    steps = turns(6)
    for i, s in enumerate(steps):
        s.index = i
    traj = Trajectory(id="old", steps=steps, status="finished")
    line = encode_message(StreamMessage(cursor="1:10", trajectory=traj), "ndjson")
    assert b'"steps":[{' in line and b'"step_refs":[]' in line
    msg = decode_envelope(line.rstrip(b"\n"), "ndjson")
    assert msg.steps == []
    assert [enc(s) for s in decode_trajectory(msg.trajectory, "ndjson", msg.steps).steps] == [enc(s)
                                                                                               for s in steps]


async def test_the_reward_callback_builds_only_the_steps_it_reads(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    def reward(traj: Trajectory) -> list[float]:
        seen["len"] = len(traj.steps)
        seen["last"] = enc(traj.steps[-1])
        seen["after_last"] = traj.steps.materialized  # type: ignore[attr-defined]
        seen["one"] = enc(traj.steps[12])
        seen["after_one"] = traj.steps.materialized  # type: ignore[attr-defined]
        seen["all"] = [enc(s) for s in traj.steps]
        seen["after_all"] = traj.steps.materialized  # type: ignore[attr-defined]
        return [0.5 * i for i in range(len(traj.steps))]

    log, steps = await finished_session(tmp_path, reward)
    full = [enc(msgspec.structs.replace(s, rewards={})) for s in steps]
    # the rewards applied after the call: compare the steps as the callback saw them
    assert seen["len"] == N and seen["last"] == full[-1] and seen["one"] == full[12]
    assert seen["all"] == full
    assert seen["after_last"] == 0  # the latest call's steps are held in full: nothing built
    # step 12 from the re-rendered (whole) step 5: steps 6..12 built once each
    assert seen["after_one"] == sum(len(steps[i].prompt_token_ids) for i in range(6, 13) if i != 9)
    # every step read in order: each built once (the one before is kept), never a chain rebuilt per step
    built_once = sum(len(s.prompt_token_ids) for s in steps if s.prefix == "extends")
    assert seen["after_one"] < seen["after_all"] <= seen["after_one"] + built_once
    [(_, traj)] = [x async for x in log.follow(until_idle=0)]
    assert [s.rewards.get("callback") for s in traj.steps] == [0.5 * i for i in range(N)]
    await log.close()


async def test_learner_samples_refer_to_their_sequence_in_linear_memory(tmp_path: Path) -> None:
    log, steps = await finished_session(tmp_path)
    records = list(log.records())
    record = records[-1]
    assert isinstance(record, Trajectory)
    # As the client's full=False hands it (delta.embed): the logged steps, deltas as deltas
    logged = msgspec.structs.replace(record, steps=[r for r in records if isinstance(r, Step)], step_refs=[])
    assert sum(s.delta is not None for s in logged.steps) == N - 3
    tracemalloc.start()
    batch = build_batch([logged], version=0)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    whole = msgspec.structs.replace(record, steps=steps, step_refs=[])
    again = build_batch([whole], version=0)
    assert batch.sequences == again.sequences and repr(batch.samples) == repr(again.samples)
    assert batch.counts == again.counts and batch.counts["trained_steps"] == N - 1
    assert not hasattr(batch.samples[0], "prompt_ids")  # an offset into the sequence, not a copy
    for i, s in enumerate(batch.samples):
        assert batch.prompt_ids(i) == steps[s.step_index].prompt_token_ids
    # Memory: the two sequences (before and after the re-render) and the steps at hand, not 50 full prompts
    full_ids = sum(len(s.prompt_token_ids) for s in steps)
    held_ids = sum(len(q.input_ids) for q in batch.sequences)
    assert full_ids > 15 * held_ids
    assert peak < 4 * 8 * held_ids + 100_000  # 8 bytes an id (list slots), a few copies at once
    await log.close()


async def test_lazy_steps_read_in_any_order_are_the_full_steps(tmp_path: Path) -> None:
    log, steps = await finished_session(tmp_path)
    logged = [r for r in log.records() if isinstance(r, Step)]
    full = [enc(msgspec.structs.replace(s, rewards={})) for s in steps]
    lazy = LazySteps(logged)  # nothing at hand: every delta built from its chain
    assert len(lazy) == N and [enc(lazy[i]) for i in reversed(range(N))] == full[::-1]
    assert [enc(s) for s in lazy[40:44]] == full[40:44] and enc(lazy[-3]) == full[-3]
    with pytest.raises(IndexError):
        lazy[N]
    assert lazy[7].rewards is logged[7].rewards  # a reward set through it lands on the held step
    await log.close()
