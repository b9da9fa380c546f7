"""The image store beside the log (log/images.py): each image once by digest, 0600, atomic; compaction removes
the images no kept step refers to and never one a call in flight holds; a reopened log knows which are
referred to from its records."""

from __future__ import annotations

import io
import stat
from pathlib import Path

import pytest

from steptap.middleware.log.images import IMAGES_DIR
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.records import (
    ImageRef,
    SessionOpened,
    Step,
    Trajectory,
    digest_of_ref,
    image_digest,
    ref_of,
)


def png(color: tuple[int, int, int], size: tuple[int, int] = (4, 3)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def _files(log_dir: Path) -> set[str]:
    d = log_dir / IMAGES_DIR
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


def _step(tid: str, index: int, *shas: str) -> Step:
    return Step(trajectory_id=tid, index=index, prompt_token_ids=list(range(50)),
                images=[ImageRef(sha256=s, mime="image/png") for s in shas])


async def test_each_image_is_stored_once_private_and_whole(tmp_path: Path) -> None:
    log = await TrajectoryLog.open(str(tmp_path))
    a, b = png((255, 0, 0)), png((0, 0, 255))
    sa, sb = image_digest(a), image_digest(b)
    await log.images.put([(sa, a), (sb, b)])
    await log.images.put([(sa, a)])  # a screenshot replayed next turn: nothing new written
    assert _files(tmp_path) == {sa, sb}  # no temporary file left beside them
    path = tmp_path / IMAGES_DIR / sa
    assert path.read_bytes() == a and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / IMAGES_DIR).stat().st_mode) == 0o700
    assert log.images.get(sb) == b
    assert log.images.get("0" * 64) is None and log.images.get("../../etc/passwd") is None
    assert digest_of_ref(ref_of(sa)) == sa and digest_of_ref("steptap-image:sha256:xyz") is None
    await log.close()


async def _roll(log: TrajectoryLog, tag: str) -> str:
    end = ""
    for i in range(8):  # past a few 1 KiB segments
        await log.append(SessionOpened(trajectory_id=f"{tag}{i}"))
        end = await log.append(Trajectory(id=f"{tag}{i}", status="finished"))
    return end


async def test_compaction_removes_images_no_kept_step_refers_to(tmp_path: Path) -> None:
    log = await TrajectoryLog.open(str(tmp_path), segment_bytes=1024)
    old, kept, pending, orphan = (png((i * 40, 0, 0)) for i in range(1, 5))
    s_old, s_kept, s_pending, s_orphan = map(image_digest, (old, kept, pending, orphan))
    await log.images.put([(s_old, old), (s_orphan, orphan), (s_pending, pending), (s_kept, kept)])
    await log.append(SessionOpened(trajectory_id="a"))
    await log.append(_step("a", 0, s_old))
    await log.append(Trajectory(id="a", status="finished"))
    await _roll(log, "f")
    await log.append(SessionOpened(trajectory_id="o1"))  # open: compaction stops before it
    await log.append(_step("o1", 0, s_kept))
    await _roll(log, "g")
    await log.append(SessionOpened(trajectory_id="o2"))
    end = await log.append(_step("o2", 0, s_kept))  # the same screenshot in another session
    with log.images.hold([s_pending]):  # a call in flight that will refer to it
        assert await log.compact(end)
        # the old image's only step is gone, and the orphan (its call was refused upstream) with it
        assert _files(tmp_path) == {s_kept, s_pending}
    await log.close()

    # Reopened: which images the retained steps refer to is read from the records themselves
    log = await TrajectoryLog.open(str(tmp_path), segment_bytes=1024)
    await log.append(Trajectory(id="o1", status="finished"))
    end = await _roll(log, "h")
    assert await log.compact(end)  # o1's step goes; o2's stays and keeps the image it shares
    assert not any(isinstance(r, Step) and r.trajectory_id == "o1" for r in log.records())
    assert _files(tmp_path) == {s_kept}  # no longer held, never referred to: gone
    await log.close()


async def test_compaction_keeps_the_images_of_retained_steps(tmp_path: Path) -> None:
    log = await TrajectoryLog.open(str(tmp_path), segment_bytes=1024)
    gone, shown, anon = png((1, 2, 3)), png((3, 2, 1)), png((4, 5, 6))
    s_gone, s_shown, s_anon = image_digest(gone), image_digest(shown), image_digest(anon)
    await log.images.put([(s_gone, gone), (s_shown, shown), (s_anon, anon)])
    await log.append(SessionOpened(trajectory_id="a"))
    await log.append(_step("a", 0, s_gone))
    await log.append(Trajectory(id="a", status="finished"))
    end = await _roll(log, "f")
    await log.append(SessionOpened(trajectory_id="open"))  # still open: its step must stay
    await log.append(_step("open", 0, s_shown))
    await _roll(log, "g")
    await log.append(SessionOpened(trajectory_id="o2"))
    # an anonymous call: its step lives in its trajectory record
    await log.append(Trajectory(id="anon", status="finished", anonymous=True,
                                steps=[_step("anon", 0, s_anon)]))
    assert await log.compact(end)
    assert _files(tmp_path) == {s_shown, s_anon}
    assert any(isinstance(r, Step) and r.trajectory_id == "open" for r in log.records())
    await log.close()

    log = await TrajectoryLog.open(str(tmp_path), segment_bytes=1024)  # which images are named: from records
    await log.append(Trajectory(id="open", status="finished"))
    end = await _roll(log, "r")
    assert await log.compact(end)  # up to o2's segment: the open session's step goes, the anonymous one stays
    assert _files(tmp_path) == {s_anon}
    await log.close()


async def test_readers_resolve_images_from_the_log_and_export_writes_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    import pyarrow.parquet as pq

    from steptap.adapters import export
    from steptap.middleware.log.offline import LogReader

    shot, gone = png((9, 9, 9)), png((8, 8, 8))
    s_shot, s_gone = image_digest(shot), image_digest(gone)
    log = await TrajectoryLog.open(str(tmp_path / "log"))
    await log.images.put([(s_shot, shot)])
    request = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": ref_of(s_shot)}}]}]}
    steps = [Step(trajectory_id="t", index=i, request=request, prompt_token_ids=[1, 2],
                  images=[ImageRef(sha256=s_shot, mime="image/png", width=4, height=3, size=len(shot))]
                  + ([ImageRef(sha256=s_gone)] if i else []))
             for i in range(2)]  # the second turn shows the screenshot again, and one the log lost
    await log.append(Trajectory(id="t", status="finished", steps=steps))
    await log.close()

    reader = LogReader(str(tmp_path / "log"))
    assert reader.image(s_shot) == shot and reader.image(s_gone) is None and reader.image("x") is None
    assert export.main(["--log", str(tmp_path / "log"), "--out", str(tmp_path / "out"),
                        "--images-dir", str(tmp_path / "img")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["images"] == 1 and summary["images_missing"] == 1
    assert {p.name: p.read_bytes() for p in (tmp_path / "img").iterdir()} == {s_shot: shot}
    rows = pq.read_table(tmp_path / "out").to_pylist()
    assert [[i["sha256"] for i in json.loads(r["images"])] for r in rows] == [[s_shot], [s_shot, s_gone]]
    assert digest_of_ref(json.loads(rows[0]["messages"])[0]["content"][0]["image_url"]["url"]) == s_shot


async def test_a_remote_logs_images_go_beside_its_segments(tmp_path: Path) -> None:
    import uuid

    from steptap.middleware.log.offline import LogReader

    url = f"memory://steptap-test-{uuid.uuid4().hex}/log"
    shot = png((5, 6, 7))
    sha = image_digest(shot)
    log = await TrajectoryLog.open(url, cache_dir=str(tmp_path / "wal"))
    await log.images.put([(sha, shot)])
    await log.append(_step("t", 0, sha))
    await log.close()
    # another machine (an empty cache) and an offline reader of the URL resolve it from the remote copy
    log = await TrajectoryLog.open(url, cache_dir=str(tmp_path / "other"))
    assert log.images.get(sha) == shot and not (tmp_path / "other" / IMAGES_DIR).exists()
    await log.close()
    assert LogReader(url).image(sha) == shot and LogReader(url).image("f" * 64) is None
