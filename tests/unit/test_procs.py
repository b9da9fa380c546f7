"""``launch/procs``: the one process-group stop and health wait of `steptap vllm` and `steptap up`, on real
processes and a real unix-socket HTTP server."""

from __future__ import annotations

import http.server
import socketserver
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from steptap.middleware.client import SyncSteptapClient
from steptap.middleware.launch.procs import healthy, process_group_alive, stop_group, wait_healthy


def _group(script: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    deadline = time.monotonic() + 10
    while len(_members(proc.pid)) < 2:  # the shell and at least one child exist
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return proc


def _members(pgid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def test_stop_group_stops_the_leader_and_every_member() -> None:
    proc = _group("sleep 300 & sleep 301 & wait")
    assert stop_group(proc, grace_s=10.0) is False  # SIGTERM was enough
    assert proc.returncode is not None and not process_group_alive(proc.pid)


def test_stop_group_kills_what_ignores_sigterm() -> None:
    proc = _group("trap '' TERM; sleep 300 & wait")  # an ignored signal stays ignored in the children
    t0 = time.monotonic()
    assert stop_group(proc, grace_s=0.5) is True  # SIGKILL was needed
    assert not process_group_alive(proc.pid) and time.monotonic() - t0 < 10


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = b'{"policy_version": 3}'
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def get_request(self):  # type: ignore[no-untyped-def]
        conn, _ = super().get_request()
        return conn, ("local", 0)  # BaseHTTPRequestHandler expects a (host, port) address


@pytest.fixture
def unix_server(tmp_path: Path) -> Iterator[Path]:
    sock = tmp_path / "s.sock"
    server = _UnixHTTPServer(str(sock), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield sock
    server.shutdown()
    server.server_close()


def test_health_over_a_unix_socket(unix_server: Path) -> None:
    url = f"unix:{unix_server}"
    assert healthy(url) and wait_healthy(url, timeout=5) is not None
    assert SyncSteptapClient(url).health() == {"policy_version": 3}
    assert not healthy(f"unix:{unix_server.parent / 'none.sock'}")


def test_wait_healthy_gives_up_when_the_process_exits(tmp_path: Path) -> None:
    proc = subprocess.Popen(["sh", "-c", "exit 3"])
    t0 = time.monotonic()
    assert wait_healthy(f"unix:{tmp_path / 'never.sock'}", timeout=60, process=proc) is None
    assert proc.returncode == 3 and time.monotonic() - t0 < 30
