"""An anonymous call's one record is built and encoded once (``Recording._record_anonymous``), without the
classifier and without what a session holds for its next call: its steps must still be logged exactly as a
session's first call logs them (prefix, call class and rule, branch, indexes, each later choice a delta of the
first), in one finished ``Trajectory`` record whose bytes are the record's own encoding, and counted in the
same metrics. A real log and session manager; the steps built by capture from a vLLM-shaped reply."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from test_choice_steps import call_steps

from steptap.middleware.config import ProxyConfig
from steptap.middleware.exceptions import RecordTooLarge
from steptap.middleware.log.segments import FRAME, frame, parse_cursor, seg_name
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.metrics import Metrics
from steptap.middleware.records import Step, Trajectory, msgpack_encoder
from steptap.middleware.sessions.identity import Identity
from steptap.middleware.sessions.manager import SessionManager

enc = msgpack_encoder.encode
MESSAGES = [{"role": "system", "content": "agent"}, {"role": "user", "content": "do it"}]


def _as_logged_by(step: Step, trajectory_id: str) -> bytes:
    return enc(msgspec.structs.replace(step, trajectory_id=trajectory_id))


@pytest.mark.parametrize(("model", "n"), [("m", 1), ("m", 3), ("haiku", 2)])
async def test_an_anonymous_record_holds_what_a_first_call_logs(tmp_path: Path, model: str, n: int) -> None:
    log = await TrajectoryLog.open(str(tmp_path / "log"))
    manager = SessionManager(ProxyConfig(log=str(tmp_path / "log"), side_models=["haiku"]), log, Metrics(),
                             None, set())
    prompt = list(range(500))

    def steps() -> list[Step]:
        made = call_steps(0, prompt, MESSAGES, n=n)
        for s in made:
            s.model = model
        return made

    named = await manager.open(session_id="named")
    async with manager.call(named, steps=n, size=100):
        await manager.record(named, steps())
    anon = await manager.resolve(Identity(source="anonymous"))
    async with manager.call(anon, steps=n, size=100):
        await manager.record(anon, steps())
    assert anon.trajectory.id.startswith("anon-") and len(anon.trajectory.id) == 5 + 32
    await log.close()

    located = list((await TrajectoryLog.open(str(tmp_path / "log"), readonly=True)).located_records())
    logged_named = [r for _, r in located if isinstance(r, Step) and r.trajectory_id == "named"]
    [(at, record)] = [(at, r) for at, r in located if isinstance(r, Trajectory) and r.anonymous]
    assert record.status == "finished" and record.finished_at is not None and not record.steps_logged
    assert [_as_logged_by(s, "x") for s in record.steps] == [_as_logged_by(s, "x") for s in logged_named]
    side = model == "haiku"
    assert [(s.prefix, s.call_class, s.call_rule, s.branch, s.index, s.choice) for s in record.steps] == [
        ("first", "side" if side else "main", "side_model" if side else "first", 0, i, i) for i in range(n)]
    assert [s.delta.kind if s.delta else None for s in record.steps] == [None] + ["choice"] * (n - 1)
    # the frame the log holds is the record's own encoding (written once, as ``record`` encodes)
    segno, offset = parse_cursor(at)
    data = (tmp_path / "log" / seg_name(segno)).read_bytes()
    payload = enc(record)
    assert data[offset:offset + FRAME.size + len(payload)] == frame(payload)
    text = manager.metrics.render().decode()
    assert f'steptap_steps_total{{anonymous="true",status="ok"}} {float(n)}' in text


async def test_an_anonymous_record_over_the_limit_is_refused_and_nothing_is_logged(tmp_path: Path) -> None:
    steps = call_steps(0, list(range(2000)), MESSAGES, n=2)
    size = len(enc(Trajectory(id="anon-" + "0" * 32, anonymous=True, steps=steps)))
    log = await TrajectoryLog.open(str(tmp_path / "log"))
    manager = SessionManager(ProxyConfig(log=str(tmp_path / "log"), max_record_bytes=size // 2,
                                         max_session_bytes=size // 2), log, Metrics(), None, set())
    anon = await manager.resolve(Identity(source="anonymous"))
    before = log.disk_bytes
    with pytest.raises(RecordTooLarge, match="max_record_bytes"):
        async with manager.call(anon, steps=2, size=100):
            await manager.record(anon, steps)
    assert log.disk_bytes == before and anon.trajectory.steps == [] and anon.trajectory.status == "running"
    assert 'steptap_steps_total{anonymous="true",status="ok"}' not in manager.metrics.render().decode()
    await log.close()
