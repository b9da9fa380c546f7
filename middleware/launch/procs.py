"""Process groups and health waits: the one way `steptap vllm` and `steptap up` stop what they started and
wait for it to answer.

Every child runs as the leader of its own session (``start_new_session=True``), so its process group id is its
pid, and signalling the group reaches the engine and worker processes it spawned too. Stopping is SIGTERM to
the group, a grace period until the group is empty, then SIGKILL. Health is ``GET /health`` answering 2xx,
over TCP or a unix socket (``unix:PATH``), through the middleware's client (stdlib only, no ``http_proxy``).

A launcher that dies hard (SIGKILL, OOM) runs no cleanup, and its children, leaders of their own sessions,
would go on serving: every child steptap starts gets ``lifetime.die_with_parent`` (SIGTERM when the launcher
dies, so a ``steptap vllm`` child still stops its own vLLM group in order).

The proxy's listening socket (``listener``) is bound by whoever starts first (``steptap up``, before vLLM's
start-up, or ``steptap serve``) and inherited by serve: its port is never free in between.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from steptap.middleware.client import SyncSteptapClient


def process_group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is left in the group (zombies wait for a reaper, they hold nothing)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to the group; False when nothing is left in it (or it is not ours)."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop_group(process: subprocess.Popen[bytes], grace_s: float = 20.0, kill_wait_s: float = 10.0) -> bool:
    """Stop a session leader and its whole group: SIGTERM, up to ``grace_s`` for the group to empty, then
    SIGKILL (up to ``kill_wait_s``). The leader is reaped. Returns whether SIGKILL was needed."""
    pgid = process.pid  # the leader of its own session and group
    forced = False
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        if not signal_group(pgid, sig):
            break
        forced = sig == signal.SIGKILL
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            process.poll()  # reap the leader so it does not linger as a zombie
            if not process_group_alive(pgid):
                break
            time.sleep(0.2)
        else:
            continue
        break
    try:
        process.wait(timeout=kill_wait_s)
    except subprocess.TimeoutExpired:  # unkillable (D state): report it, do not hang the caller
        forced = True
    return forced


def healthy(url: str, timeout_s: float = 3.0) -> bool:
    """Whether ``{url}/health`` answers 2xx now; ``url`` may be ``unix:PATH``."""
    try:
        return SyncSteptapClient(url).healthy(timeout_s)
    except ValueError:  # not a URL we can reach
        return False


def wait_until(
    cond: Callable[[], bool],
    timeout: float,
    should_abort: Callable[[], bool] | None = None,
    interval: float = 0.5,
) -> bool:
    """Poll ``cond`` until true (True) or ``timeout`` passes (False); ``should_abort`` may raise to stop, or
    return True to give up at once (False)."""
    end = time.monotonic() + timeout
    while True:
        if should_abort is not None and should_abort():
            return False
        if cond():
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(interval)


def wait_healthy(
    url: str,
    timeout: float,
    process: subprocess.Popen[bytes] | None = None,
    should_abort: Callable[[], bool] | None = None,
) -> float | None:
    """Wait for ``{url}/health``; the seconds waited, or None when ``timeout`` passed, ``process`` exited
    first (its ``returncode`` says so) or ``should_abort`` gave up."""
    t0 = time.monotonic()

    def abort() -> bool:
        if should_abort is not None and should_abort():
            return True
        return process is not None and process.poll() is not None

    ok = wait_until(lambda: healthy(url), timeout, abort)
    return time.monotonic() - t0 if ok else None


def listener(host: str, port: int, fd: int | None = None) -> socket.socket:
    """The proxy's listening socket: inherited (``fd``: ``steptap up`` bound it before vLLM's start-up), or
    bound here, before anything starts: a port in use is one clear line, and ``--port 0`` knows its port
    before it prints its address (the backlog is set when serving starts)."""
    if fd is not None:
        return socket.socket(fileno=fd)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)
