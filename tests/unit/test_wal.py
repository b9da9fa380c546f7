"""The trajectory log on real files: round trip, group commit, rollover, torn tails, corruption, remote
upload, compaction and following."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from pathlib import Path

import fsspec
import msgspec
import pytest

from steptap.middleware.errors import status_of
from steptap.middleware.log.wal import HEADER, LogInUseError, TrajectoryLog, parse_cursor
from steptap.middleware.records import (
    Held,
    HeldDropped,
    PolicyVersion,
    SessionOpened,
    Step,
    StepRef,
    Trajectory,
)


def _traj(i: int, status: str = "finished", steps: int = 1) -> Trajectory:
    return Trajectory(
        id=f"t{i}", status=status, rewards={"r": float(i)},
        steps=[Step(trajectory_id=f"t{i}", index=k, prompt_token_ids=list(range(20)),
                    response_token_ids=[i, k], response_logprobs=[-0.5, -0.25]) for k in range(steps)],
    )


def _segs(d: Path) -> list[Path]:
    return sorted(d.glob("seg-*.log"))


async def test_round_trip_and_reopen(tmp_path: Path) -> None:
    log = await TrajectoryLog.open(str(tmp_path))
    recs = [SessionOpened(trajectory_id="t0", metadata={"task": "x"}), _traj(0, steps=3),
            PolicyVersion(version=2)]
    cursors = [await log.append(r) for r in recs]
    assert [parse_cursor(c) for c in cursors] == sorted(parse_cursor(c) for c in cursors)
    assert len(set(cursors)) == 3
    assert list(log.records()) == recs
    assert log.end_cursor == cursors[-1]
    await log.close()

    log = await TrajectoryLog.open(f"file://{tmp_path}")
    assert list(log.records()) == recs
    assert log.stats.torn_records == 0
    more = await log.append(_traj(1))
    assert parse_cursor(more) > parse_cursor(cursors[-1])  # appends continue after what was there
    assert [r.id for r in log.records() if isinstance(r, Trajectory)] == ["t0", "t1"]
    await log.close()


async def test_group_commit_groups_under_concurrency(tmp_path: Path) -> None:
    log = await TrajectoryLog.open(str(tmp_path))
    cursors = await asyncio.gather(*(log.append(_traj(i)) for i in range(200)))
    assert len(set(cursors)) == 200
    assert log.stats.records == 200
    # Everything queued while one sync runs shares the next: a handful of syncs, not 200.
    assert log.stats.commits <= 20, log.stats
    assert [r.id for r in log.records()] == [f"t{i}" for i in range(200)]  # in append order
    await log.close()


async def test_lone_append_is_synced_at_once(tmp_path: Path) -> None:
    """Alone, each append is its own sync (the rate, and so the absence of a batching timer, is measured by
    bench/wal_commit_rate.py: a test counts, it never times)."""
    log = await TrajectoryLog.open(str(tmp_path))
    before = log.stats.commits
    for i in range(3):
        await log.append(_traj(i))
        assert log.stats.commits == before + i + 1 and log.stats.last_batch_records == 1
    cursor = await log.append(_traj(7))
    seg, off = parse_cursor(cursor)
    # It is on disk when append returns: a second reader (another process would see the same) finds it.
    assert (tmp_path / f"seg-{seg:08d}.log").stat().st_size == off
    await log.close()


async def test_rollover_and_follow_across_segments(tmp_path: Path) -> None:
    log = await TrajectoryLog.open(str(tmp_path), segment_bytes=2048)
    cursors = [await log.append(_traj(i, steps=2)) for i in range(30)]
    assert len(_segs(tmp_path)) > 3
    assert all(p.stat().st_size <= 2048 or p == _segs(tmp_path)[-1] for p in _segs(tmp_path))
    assert len({parse_cursor(c)[0] for c in cursors}) == len(_segs(tmp_path))
    got = [(c, t.id) async for c, t in log.follow(None, until_idle=0)]
    assert got == [(c, f"t{i}") for i, c in enumerate(cursors)]
    # Resuming from any cursor gives exactly what came after it.
    got = [t.id async for _, t in log.follow(cursors[11], until_idle=0)]
    assert got == [f"t{i}" for i in range(12, 30)]
    assert log.trajectories_after(cursors[11]) == 18 and log.trajectories_after(None) == 30
    assert log.trajectories_after(cursors[-1]) == 0
    await log.close()
    log = await TrajectoryLog.open(str(tmp_path), segment_bytes=2048)  # rebuilt from the segments at open
    assert log.trajectories_after(cursors[11]) == 18
    await log.close()


async def test_follow_waits_for_new_trajectories_and_skips_other_records(tmp_path: Path) -> None:
    log = await TrajectoryLog.open(str(tmp_path))
    await log.append(_traj(0))
    seen: list[str] = []

    async def consume() -> None:
        async for _, t in log.follow(None):
            seen.append(t.id)
            if len(seen) == 3:
                return

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.2)
    assert seen == ["t0"]
    await log.append(SessionOpened(trajectory_id="t1"))
    await log.append(_traj(1, status="running"))  # a snapshot of an open session is not delivered
    await log.append(Step(trajectory_id="t1"))
    await log.append(_traj(1, status="aborted"))
    await log.append(_traj(2, status="timed_out"))
    await asyncio.wait_for(task, 5)
    assert seen == ["t0", "t1", "t2"]
    await log.close()


async def test_torn_last_record_is_skipped_counted_and_reported(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    log = await TrajectoryLog.open(str(tmp_path), segment_bytes=4096)
    for i in range(12):
        await log.append(_traj(i))
    await log.close()
    last = _segs(tmp_path)[-1]
    size = last.stat().st_size
    with open(last, "r+b") as f:  # a crash in the middle of writing the last record
        f.truncate(size - 37)

    with caplog.at_level(logging.WARNING, logger="steptap.wal"):
        log = await TrajectoryLog.open(str(tmp_path), segment_bytes=4096)
    ids = [r.id for r in log.records()]
    assert ids == [f"t{i}" for i in range(11)]  # only the torn one is gone
    assert log.stats.torn_records == 1 and log.stats.torn_bytes > 0
    assert any("torn record" in r.getMessage() and last.name in r.getMessage() for r in caplog.records)
    assert list(tmp_path.glob(f"{last.name}.torn-*"))  # the cut bytes are kept for inspection
    await log.append(_traj(99))  # and the log goes on where the good records end
    await log.close()

    log = await TrajectoryLog.open(str(tmp_path), segment_bytes=4096)
    assert log.stats.torn_records == 0
    assert [r.id for r in log.records()][-2:] == ["t10", "t99"]
    await log.close()


async def test_torn_header_of_a_new_segment(tmp_path: Path) -> None:
    log = await TrajectoryLog.open(str(tmp_path))
    await log.append(_traj(0))
    await log.close()
    (tmp_path / "seg-00000002.log").write_bytes(HEADER[:3])  # crashed while creating the next segment
    log = await TrajectoryLog.open(str(tmp_path))
    await log.append(_traj(1))
    assert [r.id for r in log.records()] == ["t0", "t1"]
    await log.close()


async def test_bad_checksum_in_last_record_and_in_sealed_segment(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = await TrajectoryLog.open(str(tmp_path), segment_bytes=4096)
    cursors = [await log.append(_traj(i)) for i in range(20)]
    await log.close()
    segs = _segs(tmp_path)
    assert len(segs) >= 3
    # A flipped byte in the payload of the very last record: a torn tail.
    last = segs[-1]
    data = bytearray(last.read_bytes())
    data[-5] ^= 0xFF
    last.write_bytes(bytes(data))
    # A flipped byte inside the first sealed segment's second record: corruption, reported as such.
    seg1, off1 = parse_cursor(cursors[0])
    assert seg1 == 1
    data = bytearray(segs[0].read_bytes())
    data[off1 + 20] ^= 0xFF
    segs[0].write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING, logger="steptap.wal"):
        log = await TrajectoryLog.open(str(tmp_path), segment_bytes=4096)
    assert log.stats.torn_records == 1 and log.stats.corrupt_records == 1
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert errors and "corrupt" in errors[0].getMessage() and segs[0].name in errors[0].getMessage()
    ids = [r.id for r in log.records()]
    in_seg1 = sum(1 for c in cursors if parse_cursor(c)[0] == 1)
    assert ids[0] == "t0" and "t1" not in ids  # the rest of segment 1 is skipped...
    assert ids == ["t0"] + [f"t{i}" for i in range(in_seg1, 19)]  # ...later segments read on; t19 was torn
    got = [t.id async for _, t in log.follow(None, until_idle=0)]
    assert got == ids
    await log.close()


async def test_remote_url_uploads_sealed_segments(tmp_path: Path) -> None:
    url = f"memory://steptap-test-{uuid.uuid4().hex}/log"
    log = await TrajectoryLog.open(url, segment_bytes=2048, cache_dir=str(tmp_path / "wal"))
    for i in range(20):
        await log.append(_traj(i))
    local = _segs(tmp_path / "wal")
    assert len(local) >= 3
    await log.close()  # seals the active segment and waits for the uploads
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory://")
    remote = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    assert remote == [p.name for p in local]
    for p in local:
        assert fs.cat_file(f"{root}/{p.name}") == p.read_bytes()

    # A fresh machine (empty cache dir) restores the log from the remote copy.
    log = await TrajectoryLog.open(url, segment_bytes=2048, cache_dir=str(tmp_path / "other"))
    assert [r.id for r in log.records()] == [f"t{i}" for i in range(20)]
    await log.close()


async def test_a_restored_segment_is_private_whatever_the_umask(tmp_path: Path) -> None:
    """Issue 25 (lows): the restore from the remote copy wrote segments with the umask's mode (0644: prompts
    and replies readable by every local user) and without a sync. Now each arrives whole, 0600, under its
    name."""
    url = f"memory://steptap-test-{uuid.uuid4().hex}/log"
    log = await TrajectoryLog.open(url, segment_bytes=2048, cache_dir=str(tmp_path / "wal"))
    for i in range(8):
        await log.append(_traj(i))
    await log.close()
    old = os.umask(0o022)
    try:
        log = await TrajectoryLog.open(url, segment_bytes=2048, cache_dir=str(tmp_path / "other"))
    finally:
        os.umask(old)
    restored = [p for p in (tmp_path / "other").rglob("*") if p.is_file() and p.name.startswith("seg")]
    assert len(restored) >= 2 and [r.id for r in log.records()] == [f"t{i}" for i in range(8)]
    assert {oct(p.stat().st_mode & 0o777) for p in restored} == {oct(0o600)}
    assert not [p for p in (tmp_path / "other").rglob(".*tmp*")]
    await log.close()


async def test_upload_url_to_a_second_local_dir(tmp_path: Path) -> None:
    log = await TrajectoryLog.open(str(tmp_path / "wal"), segment_bytes=2048,
                                   upload_url=f"file://{tmp_path / 'archive'}")
    for i in range(10):
        await log.append(_traj(i))
    sealed = _segs(tmp_path / "wal")[:-1]
    assert sealed
    # Uploads run in the background as segments seal; close() waits for them (a file that merely exists may
    # still be mid-copy: waiting for its name raced with its content).
    await log.close()
    for p in sealed:
        assert (tmp_path / "archive" / p.name).read_bytes() == p.read_bytes()


async def test_compaction_keeps_open_sessions_and_policy_version(tmp_path: Path) -> None:
    log = await TrajectoryLog.open(str(tmp_path), segment_bytes=1024)
    await log.append(PolicyVersion(version=3, path="/w/3"))
    await log.append(SessionOpened(trajectory_id="open-1"))
    await log.append(Step(trajectory_id="open-1", index=0))
    c = ""
    for i in range(10):
        await log.append(SessionOpened(trajectory_id=f"t{i}"))
        c = await log.append(_traj(i))
    n_before = len(_segs(tmp_path))
    assert n_before >= 4

    # Session open-1 is still open: its SessionOpened is in segment 1, so nothing may go.
    assert await log.compact(c) == []
    assert len(_segs(tmp_path)) == n_before

    c = await log.append(msgspec.structs.replace(_traj(-1), id="open-1"))  # it finishes
    upto, _ = parse_cursor(c)
    deleted = await log.compact(c)
    assert deleted == list(range(1, upto))
    assert [int(p.name[4:12]) for p in _segs(tmp_path)][0] == upto
    # The policy version lived in a deleted segment: it was carried forward.
    versions = [r for r in log.records() if isinstance(r, PolicyVersion)]
    assert versions and versions[-1].version == 3 and versions[-1].path == "/w/3"
    # A consumer whose cursor points into a compacted segment resumes at the oldest retained one.
    ids = [t.id async for _, t in log.follow("1:8", until_idle=0)]
    assert ids[-1] == "open-1"
    await log.close()

    log = await TrajectoryLog.open(str(tmp_path), segment_bytes=1024)  # reopens fine after compaction
    assert [r.version for r in log.records() if isinstance(r, PolicyVersion)] == [3]
    assert await log.compact("1:8") == []  # a cursor below what is retained deletes nothing
    await log.close()


async def test_bad_cursors_are_rejected(tmp_path: Path) -> None:
    log = await TrajectoryLog.open(str(tmp_path))
    c = await log.append(_traj(0))
    await log.append(_traj(1))
    for bad in ("x", "1", "1:-3", "99:8", "1:999999"):
        with pytest.raises(ValueError):
            async for _ in log.follow(bad, until_idle=0):
                pass
        with pytest.raises(ValueError):
            log.check_cursor(bad)
    seg, off = parse_cursor(c)
    with pytest.raises(ValueError, match="does not point at a record"):
        log.check_cursor(f"{seg}:{off + 3}")  # inside a record
    for good in ("1:8", c, log.end_cursor):
        log.check_cursor(good)
    await log.close()


async def test_one_writer_per_directory(tmp_path: Path) -> None:
    log = await TrajectoryLog.open(str(tmp_path))
    with pytest.raises(LogInUseError):
        await TrajectoryLog.open(str(tmp_path))
    await log.close()
    log = await TrajectoryLog.open(str(tmp_path))  # free again once closed
    await log.close()


async def test_readonly_open_beside_the_writer(tmp_path: Path) -> None:
    log = await TrajectoryLog.open(str(tmp_path), segment_bytes=2048)
    for i in range(10):
        await log.append(_traj(i))
    with open(_segs(tmp_path)[-1], "ab") as f:
        f.write(b"\x50\x00\x00")  # a frame the writer has only begun: not torn, just not there yet
    before = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    ro = await TrajectoryLog.open(str(tmp_path), readonly=True)
    assert [r.id for r in ro.records()] == [f"t{i}" for i in range(10)]
    assert [t.id async for _, t in ro.follow(None, until_idle=0)] == [f"t{i}" for i in range(10)]
    assert ro.stats.torn_records == 0
    with pytest.raises(RuntimeError):
        await ro.append(_traj(99))
    await ro.close()
    assert {p.name: p.stat().st_size for p in tmp_path.iterdir()} == before  # nothing touched
    await log.close()
    with pytest.raises(FileNotFoundError):
        await TrajectoryLog.open(str(tmp_path / "nope"), readonly=True)


async def test_append_after_close_fails(tmp_path: Path) -> None:
    log = await TrajectoryLog.open(str(tmp_path))
    await log.close()
    with pytest.raises(RuntimeError):
        await log.append(_traj(0))
    assert os.listdir(tmp_path)


async def test_failed_upload_is_retried_and_blocks_compaction(tmp_path: Path) -> None:
    archive = tmp_path / "archive"
    archive.write_text("not a directory")  # the upload target is unusable at first
    log = await TrajectoryLog.open(str(tmp_path / "wal"), segment_bytes=1024, upload_url=f"file://{archive}")
    c = ""
    for i in range(6):
        c = await log.append(_traj(i))
    await asyncio.sleep(0.3)
    assert log.stats.uploads == 0
    assert await log.compact(c) == []  # the only copy of a segment the remote lacks is never deleted
    archive.unlink()
    for i in range(6, 12):  # the next seals retry what failed
        c = await log.append(_traj(i))
    await log.close()
    sealed = {p.name for p in _segs(tmp_path / "wal")[:-1]}  # the last is the fresh one close() started
    assert len(sealed) > 6 and sealed == {p.name for p in archive.glob("seg-*.log")}
    assert log.stats.uploads == len(sealed)


_FULL_DISK_WRITER = r"""
import asyncio, resource, signal, sys
from steptap.middleware.records import Step, Trajectory
from steptap.middleware.log.wal import LogUnavailable, TrajectoryLog

# A write past the limit then fails with EFBIG, like a full disk.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (48 * 1024, 48 * 1024))

async def main(path):
    log = await TrajectoryLog.open(path)
    ok = failed = 0
    for i in range(200):
        try:
            await log.append(Trajectory(id=f"t{i}", status="finished",
                                        steps=[Step(prompt_token_ids=list(range(300)))]))
            ok += 1
            print("OK", i, flush=True)
        except LogUnavailable as exc:
            failed += 1
    assert log.degraded and log.stats.write_errors >= 1, (log.degraded_reason, log.stats)
    print("FAILED", failed, flush=True)
    await log.close()

asyncio.run(main(sys.argv[1]))
"""


async def test_write_errors_fail_those_appends_and_leave_the_log_consistent(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FULL_DISK_WRITER, str(tmp_path)], capture_output=True,
                         text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    ok = [int(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("OK")]
    failed = int(out.stdout.split("FAILED")[1])
    assert ok and failed > 0 and len(ok) + failed == 200
    log = await TrajectoryLog.open(str(tmp_path))
    assert log.stats.torn_records == 0  # the failed group was cut back, not left half-written
    assert [r.id for r in log.records()] == [f"t{i}" for i in ok]
    await log.close()


async def test_followers_see_every_record_once_under_concurrent_appends_and_rollover(tmp_path: Path) -> None:
    log = await TrajectoryLog.open(str(tmp_path), segment_bytes=4096)
    n_writers, per = 20, 25
    got: list[list[tuple[str, str]]] = [[], []]

    async def follower(k: int) -> None:
        async for cur, t in log.follow(None):
            got[k].append((cur, t.id))
            if len(got[k]) == n_writers * per:
                return

    async def writer(w: int) -> list[str]:
        out = []
        for i in range(per):
            await log.append(SessionOpened(trajectory_id=f"w{w}-{i}"))  # interleaved non-trajectory records
            out.append(await log.append(Trajectory(id=f"w{w}-{i}", status="finished")))
        return out

    followers = [asyncio.create_task(follower(k)) for k in range(2)]
    cursors = await asyncio.gather(*(writer(w) for w in range(n_writers)))
    await asyncio.wait_for(asyncio.gather(*followers), 20)
    assert len(_segs(tmp_path)) > 5
    order = sorted((parse_cursor(c), f"w{w}-{i}") for w, cs in enumerate(cursors) for i, c in enumerate(cs))
    expected = [(f"{s}:{o}", tid) for (s, o), tid in order]
    assert got[0] == expected and got[1] == expected  # log order, nothing lost, nothing twice
    await log.close()


# ---- hardening: undecodable records, the record limit, large frames, a disk that cannot write --------------


def _bad(record: Trajectory | Step | SessionOpened, **fields: object) -> bytes:
    """``record`` re-encoded with fields of the wrong type: what a writer without edge validation wrote."""
    obj = msgspec.to_builtins(record)
    for path, value in fields.items():
        target = obj
        *head, last = path.split("__")
        for key in head:
            target = target[int(key)] if isinstance(target, list) else target[key]
        target[last] = value
    return msgspec.msgpack.encode(obj)


def _append_raw(logdir: Path, payload: bytes) -> None:
    """Append a framed payload to the last segment of a closed log (as a writer would have written it)."""
    from steptap.middleware.log.segments import frame

    with open(_segs(logdir)[-1], "ab") as f:
        f.write(frame(payload))


async def test_undecodable_records_are_skipped_counted_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``Step.model = 1`` (written by a proxy that did not validate types) stopped every reader: start-up
    raised ValidationError, and so did the stream."""
    log = await TrajectoryLog.open(str(tmp_path))
    await log.append(SessionOpened(trajectory_id="open"))
    await log.append(_traj(0))
    await log.close()
    _append_raw(tmp_path, _bad(Step(trajectory_id="open"), model=1))
    _append_raw(tmp_path, _bad(_traj(1), steps__0__model=1))
    _append_raw(tmp_path, _bad(PolicyVersion(version=3), version="three"))
    log = await TrajectoryLog.open(str(tmp_path))
    await log.append(_traj(2))
    caplog.set_level(logging.ERROR, "steptap.wal")
    kinds = [type(r).__name__ for r in log.records()]
    assert kinds == ["SessionOpened", "Trajectory", "Trajectory"]
    assert log.stats.undecodable_records == 3 and log.stats.torn_records == 0
    assert sum("undecodable record" in r.getMessage() for r in caplog.records) == 3
    got = [(cur, t.id) async for cur, t in log.follow(until_idle=0)]
    assert [tid for _, tid in got] == ["t0", "t2"]
    assert log.stats.undecodable_records == 3  # the stream's reader met the bad trajectory too: counted once
    await log.close()


async def test_record_limit_is_enforced_at_append(tmp_path: Path) -> None:
    from steptap.middleware.log.wal import RecordTooLarge

    log = await TrajectoryLog.open(str(tmp_path), max_record_bytes=4096)
    await log.append(_traj(0))
    end = log.end_cursor
    big = Trajectory(id="big", status="finished", steps=[Step(prompt_token_ids=list(range(5000)))])
    with pytest.raises(RecordTooLarge) as err:
        await log.append(big)
    assert status_of(err.value) == 413 and "4096" in str(err.value)
    assert log.end_cursor == end  # nothing was written
    await log.append(_traj(1))
    assert [r.id for r in log.records()] == ["t0", "t1"]
    await log.close()
    with pytest.raises(ValueError):
        await TrajectoryLog.open(str(tmp_path / "x"), max_record_bytes=0)


async def test_an_intact_frame_above_the_readers_limit_is_never_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frame whose length and checksum are valid is a record, whatever a reader's size limit: recovery used
    to treat one above ``MAX_RECORD`` as a torn tail and move it, and every acknowledged record after it,
    aside. Here the reader's limit is lowered below a 5 MiB record in the middle of the segment (the stream
    also reads in 4 MiB pieces, so it must read that one frame whole, without recursing)."""
    from steptap.middleware.log import segments

    log = await TrajectoryLog.open(str(tmp_path))
    big = Trajectory(id="big", status="finished", metadata={"blob": "x" * (5 << 20)})
    cursors = [await log.append(r) for r in (_traj(0), big, _traj(1))]
    await log.close()
    monkeypatch.setattr(segments, "MAX_RECORD", 1024)
    log = await TrajectoryLog.open(str(tmp_path))
    assert log.stats.torn_records == 0 and not list(tmp_path.glob("*.torn-*"))
    assert [r.id for r in log.records()] == ["t0", "big", "t1"]
    assert [(c, t.id) async for c, t in log.follow(until_idle=0)] == list(zip(cursors, ["t0", "big", "t1"],
                                                                              strict=False))
    log.check_cursor(cursors[0])  # the cursor before the large frame still names a record
    await log.close()


@pytest.mark.parametrize("alone", [False, True])  # through the writer thread, and synced on the loop
async def test_a_failed_write_degrades_the_log_until_a_probe_write_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, alone: bool
) -> None:
    from faults import DiskFullInjector

    from steptap.middleware import files
    from steptap.middleware.log.wal import LogUnavailable

    disk = DiskFullInjector(files.write_all)
    monkeypatch.setattr(files, "write_all", disk)
    log = await TrajectoryLog.open(str(tmp_path), probe_interval_s=0.05)
    await log.append(_traj(0))
    disk.full = True
    with pytest.raises(LogUnavailable) as err:
        await log.append_at(_traj(1), alone=alone)
    assert status_of(err.value) == 503 and log.degraded and "No space left" in (log.degraded_reason or "")
    refused = disk.refused
    with pytest.raises(LogUnavailable):  # refused at once: nothing reaches the disk while degraded
        log.ensure_writable()
    with pytest.raises(LogUnavailable):
        await log.append(_traj(2))
    assert log.stats.write_errors == 1 and [r.id for r in log.records()] == ["t0"]
    while disk.refused == refused:  # the probe keeps trying (and failing) while the disk is full
        await asyncio.sleep(0.01)
    assert log.degraded
    disk.full = False  # space again: the next probe clears the state by itself
    for _ in range(1000):
        if not log.degraded:
            break
        await asyncio.sleep(0.01)
    assert not log.degraded and log.degraded_reason is None
    await log.append_at(_traj(3), alone=alone)
    await log.close()
    log = await TrajectoryLog.open(str(tmp_path))
    assert log.stats.torn_records == 0 and [r.id for r in log.records()] == ["t0", "t3"]
    await log.close()


async def test_disk_bytes_follow_appends_and_compaction(tmp_path: Path) -> None:
    log = await TrajectoryLog.open(str(tmp_path), segment_bytes=4096)
    empty = log.disk_bytes
    cursors = [await log.append(_traj(i)) for i in range(40)]
    assert log.disk_bytes == sum(p.stat().st_size for p in _segs(tmp_path)) > empty
    await log.compact(cursors[-1])
    assert log.disk_bytes == sum(p.stat().st_size for p in _segs(tmp_path))
    await log.close()


async def test_new_files_and_directories_are_private(tmp_path: Path) -> None:
    log = await TrajectoryLog.open(str(tmp_path / "a" / "log"))
    await log.append(_traj(0))
    await log.close()
    assert {oct(p.stat().st_mode & 0o777) for p in (tmp_path / "a", tmp_path / "a" / "log")} == {"0o700"}
    assert {oct(p.stat().st_mode & 0o777) for p in (tmp_path / "a" / "log").iterdir()} == {"0o600"}


async def test_the_active_segment_of_a_remote_log_is_uploaded_on_a_timer(tmp_path: Path) -> None:
    url = f"memory://steptap-test-{uuid.uuid4().hex}/log"
    log = await TrajectoryLog.open(url, cache_dir=str(tmp_path / "wal"), upload_interval_s=0.05)
    await log.append(_traj(0))
    fs = fsspec.filesystem("memory")
    remote = url.removeprefix("memory://") + "/seg-00000001.log"
    local = tmp_path / "wal" / "seg-00000001.log"
    for _ in range(1000):
        if log.stats.active_uploads and fs.exists(remote):
            break
        await asyncio.sleep(0.01)
    assert fs.cat_file(remote) == local.read_bytes()  # the committed part, not yet sealed
    await log.close()


V1_FIXTURE = Path(__file__).parent.parent / "fixtures" / "log-v1"


async def test_the_committed_v1_log_still_decodes(tmp_path: Path) -> None:
    """A log written by schema version 1 (committed under tests/fixtures): every later reader must read it."""
    import math
    import shutil

    shutil.copytree(V1_FIXTURE, tmp_path / "log")
    log = await TrajectoryLog.open(str(tmp_path / "log"), readonly=True)
    recs = list(log.records())
    assert log.stats.undecodable_records == 0 and log.stats.torn_records == 0
    assert [type(r).__name__ for r in recs] == ["SessionOpened", "Step", "RewardAdded", "Trajectory",
                                                "PolicyVersion"]
    traj = recs[3]
    assert isinstance(traj, Trajectory) and traj.schema_version == 1 and traj.id == "v1-session"
    assert traj.rewards == {"reward": 1.0} and traj.steps[0].response_token_ids == [5, 6, 7]
    assert math.isnan(traj.steps[0].response_logprobs[0]) and traj.steps[0].response_logprobs[1:] == [-0.5,
                                                                                                      -0.25]
    await log.close()


async def test_durability_os_writes_before_append_returns_and_syncs_on_a_timer(tmp_path: Path) -> None:
    log = await TrajectoryLog.open(str(tmp_path), durability="os", os_sync_interval_s=0.05,
                                   segment_bytes=2048)
    cursors = [await log.append(_traj(i)) for i in range(3)]
    # In the OS (a reader of the file sees it) as soon as append returns, before any sync.
    reader = await TrajectoryLog.open(str(tmp_path), readonly=True)
    assert [r.id for r in reader.records()] == ["t0", "t1", "t2"]
    await reader.close()
    for _ in range(1000):  # the timer syncs what was written
        if not log.active.unsynced:
            break
        await asyncio.sleep(0.01)
    assert not log.active.unsynced and log.stats.commits >= 1
    more = [await log.append(_traj(i)) for i in range(3, 30)]  # rolls segments: each sealed one synced first
    assert parse_cursor(more[-1])[0] > parse_cursor(cursors[0])[0]
    await log.close()
    log = await TrajectoryLog.open(str(tmp_path))
    assert [r.id for r in log.records()] == [f"t{i}" for i in range(30)]
    await log.close()
    with pytest.raises(ValueError):
        await TrajectoryLog.open(str(tmp_path / "x"), durability="never")


async def test_a_group_reaches_the_loop_in_one_callback(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer thread hands each group back with one ``call_soon_threadsafe`` (not one per record, and no
    writer task in between): callbacks from the thread = groups committed (+1 when it stops)."""
    log = await TrajectoryLog.open(str(tmp_path))
    calls = writer_callbacks(monkeypatch)
    for rounds in range(3):
        await asyncio.gather(*(log.append(_traj(100 * rounds + i)) for i in range(50)))
    await log.close()
    from_writer = [name for name in calls if name == "steptap-wal-writer"]
    assert log.stats.records == 150
    assert len(from_writer) == log.stats.commits + 1  # one per group (each group one sync), one at stop
    assert log.stats.commits < 150  # records queued together shared groups


async def test_a_held_session_keeps_its_segments_off_the_stream_until_it_ends(tmp_path: Path) -> None:
    """A ``Held`` record (a finish whose reward is pending) is not streamed, and its session stays open for
    compaction, before and after a reopen, until a ``HeldDropped`` (or its ``Trajectory``) ends it."""
    log = await TrajectoryLog.open(str(tmp_path), segment_bytes=1024)
    await log.append(SessionOpened(trajectory_id="held"))
    at, _ = await log.append_at(Step(trajectory_id="held", index=0))
    held = Trajectory(id="held", status="finished", step_refs=[StepRef(at=at)])
    await log.append(Held(trajectory=held, deadline_at=1.0))
    c = ""
    for i in range(10):
        await log.append(SessionOpened(trajectory_id=f"t{i}"))
        c = await log.append(_traj(i))
    assert len(_segs(tmp_path)) >= 4
    assert await log.compact(c) == []  # the held session's segment stays
    assert "held" not in [t.id async for _, t in log.follow(None, until_idle=0)]
    await log.close()

    log = await TrajectoryLog.open(str(tmp_path), segment_bytes=1024)  # the scan at open keeps it too
    assert await log.compact(c) == []
    c = await log.append(HeldDropped(trajectory_id="held"))
    assert await log.compact(c) != []  # ended: its segments may go
    assert "held" not in [t.id async for _, t in log.follow(None, until_idle=0)]
    await log.close()


def writer_callbacks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads that hand work back to this loop (``call_soon_threadsafe``), as they call."""
    import threading

    loop = asyncio.get_running_loop()
    calls: list[str] = []
    real = loop.call_soon_threadsafe

    def counting(callback, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(threading.current_thread().name)
        return real(callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
    return calls


async def test_a_lone_record_is_synced_on_the_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``alone`` (the one model call in flight): written and synced on the loop, durable when the append
    returns, with no hand-off from the writer thread; not while the disk's last sync was slow, nor when the
    record would roll the segment over (a roll's syncs stay off the loop)."""
    log = await TrajectoryLog.open(str(tmp_path), segment_bytes=4096)
    calls = writer_callbacks(monkeypatch)
    for i in range(3):
        log.stats.last_sync_s = 0.0  # a quick disk, whatever this machine's is
        cursor = await log.append_at(_traj(i), alone=True)
        seg, off = parse_cursor(cursor[1])
        assert (tmp_path / f"seg-{seg:08d}.log").stat().st_size == off  # on disk when it returned
    assert log.stats.commits == 3 and [n for n in calls if n == "steptap-wal-writer"] == []
    assert log.stats.last_sync_s > 0  # each sync timed

    log.stats.last_sync_s = 1.0  # the disk's last sync took a second: the writer thread syncs it
    await log.append_at(_traj(3), alone=True)
    assert [n for n in calls if n == "steptap-wal-writer"] == ["steptap-wal-writer"]
    await log.append_at(_traj(4))  # not alone: the writer thread, as ever
    assert len([n for n in calls if n == "steptap-wal-writer"]) == 2

    segments = len(_segs(tmp_path))
    while len(_segs(tmp_path)) == segments:  # alone, up to the record that rolls the segment over
        log.stats.last_sync_s = 0.0
        await log.append_at(_traj(10 + log.stats.records), alone=True)
    assert len([n for n in calls if n == "steptap-wal-writer"]) == 3  # the roll's record went to the thread
    ids = [r.id for r in log.records()]
    await log.close()
    assert ids == [f"t{i}" for i in range(5)] + [f"t{10 + i}" for i in range(5, len(ids))]


async def test_lone_records_keep_the_log_in_append_order_among_groups(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lone record is synced on the loop only while the writer thread holds nothing (queued or in hand);
    otherwise it queues behind the thread's, so the log holds every record in the order it was appended."""
    log = await TrajectoryLog.open(str(tmp_path))
    calls = writer_callbacks(monkeypatch)
    for rounds in range(3):
        # the first append of a round finds the thread idle (synced on the loop), the rest queue behind it
        log.stats.last_sync_s = 0.0
        await asyncio.gather(*(log.append_at(_traj(100 * rounds + i), alone=i % 3 == 0) for i in range(30)))
    groups = len([n for n in calls if n == "steptap-wal-writer"])
    assert log.stats.records == 90 and log.stats.commits == groups + 3  # one sync on the loop a round
    assert [r.id for r in log.records()] == [f"t{100 * r + i}" for r in range(3) for i in range(30)]
    await log.close()
