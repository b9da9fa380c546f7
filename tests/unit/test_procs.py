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
from conftest import free_port

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


# --- children die with their launcher; a start finds a server left behind (issue 25, item 13) ---------------


def _gone(pids: set[int], within_s: float) -> bool:
    import psutil

    deadline = time.monotonic() + within_s  # a bound, not a measurement
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.2)
    return False


def test_serve_workers_die_with_a_sigkilled_launcher(tmp_path: Path) -> None:
    import os
    import signal
    import sys

    import psutil

    port = free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "steptap.middleware.cli", "serve", "--workers", "2", "--port", str(port),
         "--backend", "http://127.0.0.1:9", "--log", str(tmp_path / "log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "STEPTAP_CONTROL_TOKEN": "t" * 32})
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2:
            assert serve.poll() is None and time.monotonic() < deadline, (
                "serve --workers did not start 2 workers"
            )
            workers = {p.pid for p in psutil.Process(serve.pid).children()}
            time.sleep(0.1)
        serve.kill()  # SIGKILL: no handler of the launcher runs
        serve.wait()
        assert _gone(workers, 30), "serve --workers' workers outlived their SIGKILLed launcher"
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if serve.poll() is None:
            serve.kill()
            serve.wait()


def test_a_vllm_start_on_a_port_a_server_still_answers_says_so(tmp_path: Path) -> None:
    from steptap.learner.tiny_model import build_tiny_model
    from steptap.middleware.launch.vllm_server import VLLMServer, VLLMStartError

    model = build_tiny_model(tmp_path / "tiny")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)  # an orphan still answering /health
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        with pytest.raises(VLLMStartError, match=f"127.0.0.1:{port}.*already"):
            VLLMServer(model, port=port, gpu=False, log_path=tmp_path / "v.log").start()
    finally:
        server.shutdown()
        server.server_close()


def test_a_vllm_start_on_a_socket_a_server_still_answers_says_so(unix_server: Path, tmp_path: Path) -> None:
    from steptap.learner.tiny_model import build_tiny_model
    from steptap.middleware.launch.vllm_server import VLLMServer, VLLMStartError

    model = build_tiny_model(tmp_path / "tiny")
    with pytest.raises(VLLMStartError, match="already"):
        VLLMServer(model, uds=unix_server, gpu=False, log_path=tmp_path / "v.log").start()
    assert unix_server.exists() and healthy(f"unix:{unix_server}")  # not unlinked from under it


def test_a_child_started_from_a_thread_outlives_the_thread(tmp_path: Path) -> None:
    """Issue 25 (lows): PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process.
    ``die_with_parent`` sets it only from the main thread (every launcher starts its children there); from
    another thread it gives no preexec, so a child that thread started lives on after the thread ends."""
    import os
    import sys

    from steptap.middleware.launch.lifetime import die_with_parent

    assert die_with_parent() is not None  # pytest runs tests on the main thread
    script = ("import signal, sys\n"
              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))\n"
              "sys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.read()\n")
    started: dict[str, object] = {}

    def launch() -> None:
        started["preexec"] = die_with_parent()
        started["tid"] = threading.get_native_id()
        started["proc"] = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, preexec_fn=started["preexec"])  # type: ignore[arg-type]  # noqa: PLW1509

    t = threading.Thread(target=launch)
    t.start()
    t.join()
    proc = started["proc"]
    assert isinstance(proc, subprocess.Popen)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        task = Path(f"/proc/{os.getpid()}/task/{started['tid']}")
        deadline = time.monotonic() + 30
        while task.exists():  # the thread is gone in the kernel too: a death signal would be pending by now
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0  # ended by its stdin's end, never by SIGTERM (3)
        assert started["preexec"] is None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
