"""What ``steptap run`` takes as a reward (issue 25, lows): a finite number only (``nan``/``inf`` printed by a
grader or written by an agent would poison the advantages), and a reward file read within a bound, a regular
file only (a FIFO would hang the run, ``/dev/zero`` fill its memory). Real files and a real FIFO."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from steptap.adapters.runner import parse_reward, read_reward_file


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
