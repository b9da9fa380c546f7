"""``previous_response_id`` under ``steptap serve --workers`` (issue 25, lows). The Responses store lives in
the worker that served the response. A session's calls reach one worker when they use its session URL; a
session id in the path on two workers' ports (or on the shared port, where the kernel picks the worker) is two
sessions, and a ``previous_response_id`` the other worker stored was a bare "not found". The answer now names
the cause: the worker that holds it, its own port, and what to do. Real processes: the CLI with two workers in
front of the session's vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import CONTROL_TOKEN, Backend
from test_replica_commands import STEPTAP, _answers, _interrupt, _wait, free_ports

pytestmark = pytest.mark.vllm


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_response_stored_by_another_worker_is_a_clear_error(vllm_server: Backend, tmp_path: Path) -> None:
    shared = free_ports(3)
    workers = [f"http://127.0.0.1:{shared + 1}", f"http://127.0.0.1:{shared + 2}"]
    out_path = tmp_path / "serve.out"
    with open(out_path, "wb") as out:
        serve = subprocess.Popen(
            [*STEPTAP, "serve", "--workers", "2", "--port", str(shared), "--backend", vllm_server.url,
             "--log", str(tmp_path / "log")], stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "STEPTAP_CONTROL_TOKEN": CONTROL_TOKEN, "STEPTAP_LOG_LEVEL": "WARNING"})
    try:
        _wait(lambda: all(_answers(u) for u in workers), serve, out_path, 120, "serve --workers")
        body = {"model": vllm_server.served_model, "input": "Say a word.", "max_output_tokens": 3}
        status, first = post(f"{workers[0]}/s/chat-1/v1/responses", body)
        assert status == 200, first
        # the same worker continues it
        status, again = post(f"{workers[0]}/s/chat-1/v1/responses",
                             {**body, "input": "And another.", "previous_response_id": first["id"]})
        assert status == 200, again
        # the other worker: a 404 that says where the response is and why it is not here
        status, err = post(f"{workers[1]}/s/chat-1/v1/responses",
                           {**body, "input": "And another.", "previous_response_id": first["id"]})
        assert status == 404, err
        assert err["error"]["code"] == "previous_response_on_other_worker", err
        message = err["error"]["message"]
        assert f"worker 0 (its own port {shared + 1})" in message and "worker 1" in message, message
        assert "session URL" in message, message
    finally:
        code = _interrupt(serve)
    assert code == 0, out_path.read_text()[-3000:]
