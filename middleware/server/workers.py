"""``steptap serve --workers N``: N proxy processes, so one machine's cores serve the agents.

Every worker listens on the shared port with ``SO_REUSEPORT`` (the kernel spreads new connections over them)
and on a port of its own (``PORT+1+i``), which the learner streams from and publishes to, and which the
session URLs a worker hands out name, so an agent's calls all reach the worker holding its session. Each
worker writes its own log (``LOG/worker-i``). Replicas are dealt to the workers round robin when there are at
least as many as workers: a worker then swaps only its own replicas, so no worker's calls can reach a vLLM
that another worker paused. With fewer replicas than workers they are shared, and hot swaps are refused (a
swap through one worker would let another record the old version for calls the new weights sampled).

Sessions opened with ``POST /sessions`` (or one-shot anonymous calls) work through the shared port; a session
id an agent picks in its path on the shared port is not pinned to one worker: use a worker's own port for
that. The Responses store is a worker's own too: its response ids name the worker's port, so another worker
answers a ``previous_response_id`` it does not hold with a 404 naming where it is (``proxy/responses.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from steptap.middleware.auth import generate_token
from steptap.middleware.client import TOKEN_ENV
from steptap.middleware.config import ProxyConfig
from steptap.middleware.launch.lifetime import die_with_parent

SHARED_BACKENDS = "shared"  # the reason a worker refuses swaps (see above)


def deal(backends: list[str], workers: int) -> list[list[str]]:
    """Replicas per worker: round robin when there are enough, else every worker gets them all."""
    if len(backends) >= workers:
        return [backends[i::workers] for i in range(workers)]
    return [list(backends) for _ in range(workers)]


PUBLIC_URL_REFUSED = (
    "--public-url with --workers: each session is served by one worker, so agents need a URL per worker. "
    "Give a template the front routes to worker i: {i} (0..N-1) or {port} (the worker's own port PORT+1+i), "
    "e.g. https://w{i}.example.com or https://front.example.com:{port}"
)


def worker_urls(config: ProxyConfig, workers: int) -> list[str]:
    """The URL each worker hands to agents: from the ``--public-url`` template (``{i}``, ``{port}``), else the
    worker's own address. ``ValueError`` for a public URL that names no worker (it would bypass the front or
    send every session to one worker)."""
    ports = [config.port + 1 + i for i in range(workers)]
    if not config.public_url:
        return [f"http://{config.host}:{p}" for p in ports]
    if "{i}" not in config.public_url and "{port}" not in config.public_url:
        raise ValueError(PUBLIC_URL_REFUSED)
    return [config.public_url.replace("{i}", str(i)).replace("{port}", str(p)).rstrip("/")
            for i, p in enumerate(ports)]


def run_workers(config: ProxyConfig, argv: list[str], workers: int) -> int:
    """Start the workers (``steptap serve`` each, with this process's flags), watch them, stop them all when
    one exits or on SIGINT/SIGTERM."""
    if config.backends_file:
        raise SystemExit("steptap serve: --workers deals --backend URLs to workers; --backends-file is per "
                         "proxy: run one proxy per file instead")
    try:
        urls = worker_urls(config, workers)
    except ValueError as exc:
        print(f"steptap serve: {exc}", file=sys.stderr, flush=True)
        return 2
    backends = [b for b in [config.backend, *config.backends] if b]
    shared = len(backends) < workers
    generated = not config.control_token
    procs = _start(config, argv, deal(backends, workers), urls, shared)
    print(f"steptap serve: {workers} workers on {config.base_url()} (SO_REUSEPORT); their own URLs, for the "
          f"learner: --proxy-urls {' '.join(urls)}", flush=True)
    if generated:
        print("control token: generated; pass your own with --control-token or $STEPTAP_CONTROL_TOKEN to use "
              "the control routes", flush=True)
    if shared:
        print(f"steptap serve: {len(backends)} replica(s) shared by {workers} workers: weight swaps are "
              "refused (give at least as many --backend replicas as workers to train)", flush=True)
    return _watch(procs)


def _start(config: ProxyConfig, argv: list[str], shares: list[list[str]], urls: list[str],
           shared: bool) -> list[subprocess.Popen[bytes]]:
    """One ``steptap serve --reuse-port`` a worker: its share of the backends, its own log, port and URL."""
    env = dict(os.environ)
    # One control token for all (the learner uses one): passed by environment, never on a command line.
    env[TOKEN_ENV] = config.control_token or generate_token()
    base = _strip(argv, {"--workers", "--backend", "--log", "--public-url", "--control-token"})
    procs: list[subprocess.Popen[bytes]] = []
    for i, (share, url) in enumerate(zip(shares, urls, strict=True)):
        cmd = [sys.executable, "-m", "steptap.middleware.cli", "serve", *base,
               "--log", f"{config.log.rstrip('/')}/worker-{i}", "--public-url", url,
               "--reuse-port", "--worker-port", str(config.port + 1 + i)]
        for b in share:
            cmd += ["--backend", b]
        if shared:
            cmd += ["--refuse-swaps", SHARED_BACKENDS]
        # A SIGKILLed launcher runs no cleanup: each worker gets SIGTERM from the kernel then (procs.py).
        procs.append(subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent()))  # noqa: PLW1509
    return procs


def _watch(procs: list[subprocess.Popen[bytes]]) -> int:
    """Until a worker exits (its status, 1 for 0) or SIGINT/SIGTERM (0); then every worker is stopped."""
    stop = {"signal": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        while not stop["signal"]:
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                code = dead[0].returncode or 1
                print(f"steptap serve: worker pid {dead[0].pid} exited with {dead[0].returncode}; stopping "
                      "the others", file=sys.stderr, flush=True)
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for s, h in previous.items():
            signal.signal(s, h)
    return code


def _strip(argv: list[str], flags: set[str]) -> list[str]:
    """``argv`` without ``flags`` and their values (``--flag V`` or ``--flag=V``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in flags:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out
