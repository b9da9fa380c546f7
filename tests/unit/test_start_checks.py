"""What `steptap vllm` and `steptap up` decide from a model directory before starting anything, on models the
tiny-model builder makes: the tool-call parser comes from what the chat template and tokenizer contain (a
Llama config without ``<|python_tag|>`` made vLLM refuse to start with ``llama3_json``), and a tied-embedding
model with a full-weight learner is refused at start, with the advice to use LoRA."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from steptap.learner.tiny_model import build_tiny_model
from steptap.middleware.launch import up, up_preflight
from steptap.middleware.launch.model_info import choose_tool_parser, tokenizer_tokens
from steptap.middleware.launch.vllm_server import VLLMServer

STEPTAP = [sys.executable, "-m", "steptap.middleware.cli"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama")


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tied"), tied=True)


def _command(model_dir: Path) -> list[str]:
    return VLLMServer(model_dir, gpu=False, port=1).command(Path("python"))


def test_a_llama_model_without_the_python_tag_gets_the_parser_its_template_asks_for(llama_dir: Path) -> None:
    assert json.loads((llama_dir / "config.json").read_text())["model_type"] == "llama"
    tokens = tokenizer_tokens(llama_dir)
    assert tokens is not None and "<tool_call>" in tokens and "<|python_tag|>" not in tokens
    parser, why = choose_tool_parser(llama_dir)
    assert parser == "hermes" and "<|python_tag|>" in why  # says why not llama3_json
    cmd = _command(llama_dir)
    assert cmd[cmd.index("--tool-call-parser") + 1] == "hermes" and "llama3_json" not in cmd


def test_a_model_with_no_tool_format_starts_without_a_parser_and_says_so(llama_dir: Path,
                                                                         tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    shutil.copytree(llama_dir, plain)
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    (plain / "chat_template.jinja").write_text(template)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert choose_tool_parser(plain)[0] is None
    server = VLLMServer(plain, gpu=False, port=1)
    assert "--tool-call-parser" not in server.command(Path("python"))
    assert "--enable-auto-tool-choice" not in server.command(Path("python"))
    (notice,) = server.notices()
    assert "without a tool-call parser" in notice and "--tool-call-parser NAME" in notice
    # Given explicitly, the user's choice wins and nothing is said.
    given = VLLMServer(plain, gpu=False, port=1, tool_parser="pythonic")
    assert given.notices() == [] and "pythonic" in given.command(Path("python"))


def test_up_refuses_a_tied_model_with_a_full_weight_learner_before_starting_anything(
    tied_dir: Path, tmp_path: Path
) -> None:
    workdir = tmp_path / "up"
    out = subprocess.run(
        [*STEPTAP, "up", "--model", str(tied_dir), "--workdir", str(workdir), "--no-view", "--port", "0"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "ties its input and output embeddings" in out.stderr and "--lora-rank" in out.stderr
    pids = json.loads((workdir / "pids.json").read_text()) if (workdir / "pids.json").exists() else {}
    assert "vllm" not in pids and not (workdir / "logs" / "vllm.log").exists()  # nothing was started
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["stop_reason"].startswith("refused:")


def test_a_tied_model_with_a_lora_learner_is_accepted(tied_dir: Path, tmp_path: Path) -> None:
    args = up.build_parser().parse_args(
        ["--model", str(tied_dir), "--workdir", str(tmp_path / "up"), "--learn-args=--lora-rank 8"]
    )
    runner = up.Up(args)
    runner.model_dir = str(tied_dir)
    # read by the learner's own config parser
    assert up_preflight._learner_lora_rank(runner._learner_argv()) == 8
    # no exception: LoRA never reloads the tied base weights
    runner.preflight.refuse_tied_full_weights(runner.model_dir, runner._learner_argv())
    runner.args.learn_args = ""
    with pytest.raises(up.Refused, match="LoRA"):
        runner.preflight.refuse_tied_full_weights(runner.model_dir, runner._learner_argv())


def test_up_takes_several_running_replicas_but_not_with_replicas(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    args = up.build_parser().parse_args(["--backend", "http://a:1/", "--backend", "unix:/r/b.sock",
                                         "--no-learner",
                                         "--workdir", str(tmp_path / "up")])
    runner = up.Up(args)
    assert runner.given == ["http://a:1", "unix:/r/b.sock"] and runner.backend == "http://a:1"
    with pytest.raises(SystemExit) as exc:  # --replicas starts servers; running ones are named one by one
        up.main(["--backend", "http://a:1", "--replicas", "2", "--no-learner"])
    assert exc.value.code == 2 and "--replicas N starts N vLLM servers" in capsys.readouterr().err


def test_up_max_updates_reaches_the_learner_so_it_stops_at_exactly_n(tied_dir: Path, tmp_path: Path) -> None:
    """up's own --max-updates check polls once a second; the learner itself must stop at N (a fast learner
    made N + 1 updates between the poll and the stop). --learn-args still wins, being later on the line."""
    from steptap.learner.config import config_from_argv

    def learner_cfg(*argv: str):
        runner = up.Up(up.build_parser().parse_args(["--model", str(tied_dir), "--workdir", str(tmp_path),
                                                     *argv]))
        runner.model_dir, runner.proxy_url = str(tied_dir), "http://127.0.0.1:1"
        return config_from_argv(runner._learner_argv())

    assert learner_cfg("--max-updates", "2").max_updates == 2
    assert learner_cfg().max_updates == 0
    assert learner_cfg("--max-updates", "2", "--learn-args=--max-updates 5").max_updates == 5


def test_up_holds_the_proxy_port_from_the_start_until_serve_inherits_it(tmp_path: Path) -> None:
    """`--port 0`: up binds the proxy's port before vLLM's start-up and serve inherits the socket
    (``--listen-fd``), so the port is never free in between (a port picked, released and bound a minute
    later was taken meanwhile in CI); a port in use is refused before anything starts."""
    runner = up.Up(up.build_parser().parse_args(["--port", "0", "--no-learner", "--workdir", str(tmp_path)]))
    runner._reserve_port()
    assert runner.listener is not None
    try:
        port = runner.proxy_port
        assert port > 0 and runner.proxy_url == f"http://127.0.0.1:{port}"
        with socket.socket() as other, pytest.raises(OSError):  # held: no other process can take it
            other.bind(("127.0.0.1", port))
        taken = up.Up(up.build_parser().parse_args(["--port", str(port), "--workdir", str(tmp_path)]))
        with pytest.raises(up.Refused, match=f"cannot listen on 127.0.0.1:{port}"):
            taken._reserve_port()
    finally:
        runner.listener.close()


def test_serve_answers_on_the_socket_it_inherits(tmp_path: Path) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    out = tmp_path / "serve.out"
    with open(out, "wb") as f:
        proc = subprocess.Popen([*STEPTAP, "serve", "--backend", "http://127.0.0.1:9", "--port", "0",
                                 "--listen-fd", str(listener.fileno()), "--log", str(tmp_path / "log"),
                                 "--control-token", "t"],
                                pass_fds=(listener.fileno(),), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    listener.close()  # serve's copy is the only one now
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, out.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                    body = json.loads(resp.read())
                break
            except urllib.error.HTTPError as exc:  # answered (503: the backend at :9 is down)
                body = json.loads(exc.read())
                break
            except OSError:
                assert time.monotonic() < deadline, out.read_text()
                time.sleep(0.2)
        assert isinstance(body, dict)
        assert f"http://127.0.0.1:{port} " in out.read_text()  # its address, the socket's port (not --port 0)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    # and with --workers it is refused: they share a port by SO_REUSEPORT
    r = subprocess.run([*STEPTAP, "serve", "--backend", "http://127.0.0.1:9", "--listen-fd", "3",
                        "--workers", "2", "--control-token", "t", "--log", str(tmp_path / "log2")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "inherited socket" in r.stderr
    r = subprocess.run([*STEPTAP, "serve", "--backend", "http://127.0.0.1:9", "--port", "0",
                        "--workers", "2", "--control-token", "t", "--log", str(tmp_path / "log3")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not --port 0" in r.stderr


def test_serve_says_in_one_line_that_its_port_is_taken(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        r = subprocess.run([*STEPTAP, "serve", "--backend", "http://127.0.0.1:9", "--port", str(port),
                            "--control-token", "t", "--log", str(tmp_path / "log")],
                           capture_output=True, text=True, timeout=60)
        workers = subprocess.run([*STEPTAP, "serve", "--backend", "http://127.0.0.1:9", "--port", str(port),
                                  "--workers", "2", "--control-token", "t", "--log", str(tmp_path / "log2")],
                                 capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"steptap serve: cannot listen on 127.0.0.1:{port} (--host, --port): ")
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # --workers: each worker says so in a line, and the launcher stops the others
    said = workers.stdout + workers.stderr
    assert workers.returncode != 0 and f"worker cannot listen on 127.0.0.1:{port}: " in said, said
    assert "Traceback" not in said


@pytest.mark.parametrize(("flags", "said"), [
    (["--backend", "notaurl"], "--backend 'notaurl': expected http(s)://host:port or unix:PATH"),
    (["--backend", "http://127.0.0.1:9", "--backend", "unix:"], "--backend 'unix:': expected unix:/path"),
    (["--backend", "http://127.0.0.1:99999"], "--backend 'http://127.0.0.1:99999': Port out of range"),
    (["--backend", "http://127.0.0.1:9", "--port", "99999"], "cannot listen on 127.0.0.1:99999"),
    (["--backend", "http://127.0.0.1:9", "--log", "/proc/steptap-no-such-dir"],
     "--log /proc/steptap-no-such-dir: No such file or directory"),
])
def test_serve_refuses_what_it_cannot_serve_at_start_in_one_line(tmp_path: Path, flags: list[str],
                                                                   said: str) -> None:
    argv = [*STEPTAP, "serve", "--port", "0", "--control-token", "t", "--log", str(tmp_path / "log"), *flags]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)  # the later --port/--log win
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"steptap serve: {said}"), r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_up_seed_reaches_the_learner_and_vllm_and_a_missing_one_is_drawn_once(tied_dir: Path,
                                                                             tmp_path: Path) -> None:
    """The run's seed (issue 40: a recipe's run printed and repeatable): --seed is the learner's torch seed
    and vLLM's --seed (whose default, 0, every run would share), one more per replica; without it one is drawn
    and used for both; a --seed given to vLLM itself wins."""
    from steptap.learner.config import config_from_argv

    def runner(*argv: str) -> up.Up:
        r = up.Up(up.build_parser().parse_args(["--model", str(tied_dir), "--workdir", str(tmp_path), *argv]))
        r.model_dir, r.proxy_url = str(tied_dir), "http://127.0.0.1:1"
        return r

    given = runner("--seed", "17")
    assert config_from_argv(given._learner_argv()).seed == 17
    assert given._vllm_seed(["--threads", "2"], 0) == ["--", "--seed", "17"]
    assert given._vllm_seed(["--", "--max-model-len", "8192"], 1) == ["--seed", "18"]
    assert given._vllm_seed(["--", "--seed", "5"], 0) == [] and given._vllm_seed(["--", "--seed=5"], 0) == []
    drawn = runner()
    assert config_from_argv(drawn._learner_argv()).seed == drawn.seed and 0 <= drawn.seed < 1 << 31
    assert drawn._vllm_seed([], 0) == ["--", "--seed", str(drawn.seed)]
    assert config_from_argv(runner("--seed", "17", "--learn-args=--seed 3")._learner_argv()).seed == 3
