"""``steptap serve`` as users run it: a real process (web.run_app, no test harness), flags and env, the token
written to a 0600 file (never printed) when generated, a hang-up mid-stream recorded as a failed step, and a
clean stop on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import free_port
from faults import MODEL, FaultInjector


async def start(args: list[str], env: dict[str, str], port: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "steptap.middleware.cli", "serve", "--port", str(port), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **env},
    )
    async with aiohttp.ClientSession() as http:
        for _ in range(200):
            try:
                async with http.get(f"http://127.0.0.1:{port}/health") as resp:
                    if resp.status == 200:
                        return proc
            except aiohttp.ClientError:
                pass
            if proc.poll() is not None:
                break
            await asyncio.sleep(0.05)
    proc.kill()
    pytest.fail(f"steptap serve did not come up: {proc.communicate()[0]}")


def stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"steptap serve ignored SIGTERM: {out}")
    assert proc.returncode == 0, out
    return out


async def test_serve_process(aiohttp_server: Any, tmp_path: Path) -> None:
    injector = FaultInjector(stall_s=0.5)
    upstream = str((await aiohttp_server(injector.app)).make_url("")).rstrip("/")
    port = free_port()
    proc = await start(
        ["--backend", upstream, "--log", str(tmp_path / "log"), "--upstream-timeout", "5"],
        {"STEPTAP_CONTROL_TOKEN": "from-env"},
        port,
    )
    base = f"http://127.0.0.1:{port}"
    control = {"Authorization": "Bearer from-env"}
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
            async with http.post(f"{base}/s/a/v1/chat/completions", json=body) as resp:
                assert (
                    resp.status == 200 and (await resp.json())["choices"][0]["message"]["content"] == "Hello!"
                )
            injector.mode = "stall"
            resp = await http.post(f"{base}/s/gone/v1/chat/completions", json={**body, "stream": True})
            assert (await resp.content.readline()).startswith(b"data: ")
            resp.close()  # hang up while the backend is still generating
            steps: list[Any] = []
            # A bound, not a timing: the failed step opens the auto session when recorded
            for _ in range(400):
                await asyncio.sleep(0.05)
                async with http.get(f"{base}/sessions/gone", headers=control) as r:
                    steps = (await r.json())["steps"] if r.status == 200 else []
                if steps:
                    break
            assert len(steps) == 1 and steps[0]["status"] == "failed"
            assert steps[0]["error"]["type"] == "client_gone"
            async with http.get(f"{base}/sessions/a", headers=control) as r:
                assert r.status == 200 and len((await r.json())["steps"]) == 1
            async with http.post(f"{base}/sessions", json={}, headers=control) as r:
                assert (await r.json())["base_url"].startswith(f"{base}/s/")
    finally:
        out = stop(proc)
    assert "from-env" not in out  # a given token is never echoed
    assert (tmp_path / "log").is_dir() and any((tmp_path / "log").iterdir())

    # no token given: one is generated into a 0600 file (its path printed, never the token), and it works
    env = {k: v for k, v in os.environ.items() if k != "STEPTAP_CONTROL_TOKEN"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "steptap.middleware.cli",
            "serve",
            "--port",
            str(port),
            "--backend",
            upstream,
            "--log",
            str(tmp_path / "log"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = ""
        for _ in range(50):
            line = await asyncio.to_thread(proc.stdout.readline)
            if "control token" in line:
                break
        token_file = Path(line.strip().rsplit(" ", 1)[-1])
        assert token_file.is_relative_to(tmp_path / "cache") and token_file.stat().st_mode & 0o777 == 0o600
        token = token_file.read_text().strip()
        assert token.startswith("stc-") and token not in line
        async with aiohttp.ClientSession() as http:
            for _ in range(200):
                try:
                    async with http.get(
                        f"{base}/sessions/a", headers={"Authorization": f"Bearer {token}"}
                    ) as r:
                        # the restarted proxy rebuilt session "a" from the log
                        assert r.status == 200 and len((await r.json())["steps"]) == 1
                        break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.05)
            else:
                pytest.fail("restarted proxy did not answer")
    finally:
        stop(proc)


def test_bad_flags_exit_with_usage() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "steptap.middleware.cli",
            "serve",
            "--backend",
            "http://x",
            "--force-sampling",
            "temperature",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and "--force-sampling" in out.stderr
