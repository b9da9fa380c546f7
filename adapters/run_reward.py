"""A member's reward as it arrives from something untrusted: the reward file an agent (or a verifier) wrote,
read without following links or blocking and bounded, and the reward command's last line of output; either a
finite number or a JSON object of named finite numbers (``steptap run``, ``steptap tasks``)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import stat

# A reward is a line; a bigger reward file is an agent filling the disk or the memory. Of a reward command's
# output only this tail is kept.
MAX_REWARD_FILE = 64 * 1024


def read_reward_file(path: str) -> dict[str | None, float] | None:
    """The reward an agent wrote to ``path``: None when there is no file; ``RuntimeError`` for a file that is
    not a regular one (a FIFO would block, ``/dev/zero`` never ends), one over ``MAX_REWARD_FILE`` or a bad
    reward. Opened without following a symlink and without blocking."""
    data = read_small_file(path)
    if data is None:
        return None
    try:
        return parse_reward(data.decode("utf-8", "replace"))
    except ValueError as exc:
        raise RuntimeError(f"reward file {path}: {exc}") from None


def read_small_file(path: str) -> bytes | None:
    """A file someone untrusted wrote (an agent, a verifier): None when there is none; ``RuntimeError`` for
    one that is not a regular file or is larger than ``MAX_REWARD_FILE``. Never follows a symlink, never
    blocks."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RuntimeError(f"reward file {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RuntimeError(f"reward file {path} is not a regular file")
        data = f.read(MAX_REWARD_FILE + 1)
    if len(data) > MAX_REWARD_FILE:
        raise RuntimeError(f"reward file {path} is larger than {MAX_REWARD_FILE} bytes")
    return data


async def tail_of(proc: asyncio.subprocess.Process, data: bytes) -> bytes:
    """Feed ``data`` to the process's stdin and read its stdout to the end, keeping only the last
    ``MAX_REWARD_FILE`` bytes (the reward is its last line; a grader may print logs before it)."""

    async def feed() -> None:
        assert proc.stdin is not None
        try:
            proc.stdin.write(data)
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # a command that does not read the trajectory
        finally:
            proc.stdin.close()

    feeder = asyncio.ensure_future(feed())
    assert proc.stdout is not None
    tail = bytearray()
    try:
        while chunk := await proc.stdout.read(1 << 16):
            tail += chunk
            del tail[:-MAX_REWARD_FILE]
        await feeder
        await proc.wait()
    finally:
        feeder.cancel()
    return bytes(tail)


def parse_reward(text: str) -> dict[str | None, float] | None:
    """A reward as printed or written: its last non-empty line, a finite number or a JSON object of named
    finite numbers (``nan`` or ``inf`` would poison every advantage of its group)."""
    out = _parse_reward(text)
    if out is not None and not all(math.isfinite(v) for v in out.values()):
        raise ValueError(f"a reward must be a finite number: {text.strip()[-200:]!r}")
    return out


def _parse_reward(text: str) -> dict[str | None, float] | None:
    """A reward as printed or written: its last non-empty line, a number or a JSON object of named numbers."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return None
    last = lines[-1]
    try:
        return {None: float(last)}
    except ValueError:
        pass
    try:
        value = json.loads(last)
    except ValueError as exc:
        raise ValueError(f"not a number or a JSON object: {last[:200]!r}") from exc
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {None: float(value)}
    if isinstance(value, dict) and all(isinstance(v, (int, float)) for v in value.values()):
        return {str(k): float(v) for k, v in value.items()}
    raise ValueError(f"not a number or a JSON object of numbers: {last[:200]!r}")
