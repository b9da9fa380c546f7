"""What ``steptap run`` takes as a reward (issue 25, lows): a finite number only (``nan``/``inf`` printed by a
grader or written by an agent would poison the advantages), and a reward file read within a bound, a regular
file only (a FIFO would hang the run, ``/dev/zero`` fill its memory). Real files and a real FIFO."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from steptap.adapters.run_reward import parse_reward, read_reward_file


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "NaN", '{"a": NaN}', '{"a": Infinity}', "1e999"])
def test_a_reward_that_is_not_finite_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="finite"):
        parse_reward(text)


def test_a_reward_file_must_be_a_small_regular_file(tmp_path: Path) -> None:
    ok = tmp_path / "r"
    ok.write_text("0.5\n")
    assert read_reward_file(str(ok)) == {None: 0.5}
    assert read_reward_file(str(tmp_path / "missing")) is None
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(RuntimeError, match="not a regular file"):
        asyncio.run(asyncio.wait_for(asyncio.to_thread(read_reward_file, str(fifo)), 10))
    with pytest.raises(RuntimeError, match="not a regular file"):
        read_reward_file("/dev/zero")
    big = tmp_path / "big"
    big.write_text("1\n" * 100_000)
    with pytest.raises(RuntimeError, match="larger than"):
        read_reward_file(str(big))


def _reward_files(tmp_path: Path, n: int, reward_file: str | None) -> list[str]:
    import argparse

    from steptap.adapters.runner import Member, Runner

    runner = Runner(argparse.Namespace(group=None, n=n, concurrency=1, reward_file=reward_file), client=None)
    try:
        return [runner._reward_file(Member(i, session_id=f"s{i}")) for i in range(n)]
    finally:
        os.rmdir(runner.tmpdir)


def test_members_of_a_group_never_share_a_reward_file(tmp_path: Path) -> None:
    """Issue 25 (lows): ``-n`` members could overwrite each other's reward file. Each gets its own: in the
    run's private directory, PATH.INDEX for one ``--reward-file PATH``, or the template's ``{index}`` /
    ``{session}``; other braces in a path are kept as they are (a format string crashed on them)."""
    p = str(tmp_path / "r")
    default = _reward_files(tmp_path, 3, None)
    assert len(set(default)) == 3
    assert _reward_files(tmp_path, 3, p) == [f"{p}.0", f"{p}.1", f"{p}.2"]
    assert _reward_files(tmp_path, 1, p) == [p]
    assert _reward_files(tmp_path, 2, p + "-{session}") == [f"{p}-s0", f"{p}-s1"]
    assert _reward_files(tmp_path, 2, p + "-{index}-{x}{0}") == [p + "-0-{x}{0}", p + "-1-{x}{0}"]
