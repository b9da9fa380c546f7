"""`steptap vllm`: its command line, the servers it plans (one or ``--replicas N``), and running them until
one exits or a signal stops them all."""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from steptap.middleware.launch.model_info import TOOL_PARSERS
from steptap.middleware.launch.placement import has_gpu, replica_env, replica_threads
from steptap.middleware.launch.vision import ensure_torchvision
from steptap.middleware.launch.vllm_server import VLLMServer, VLLMStartError
from steptap.middleware.launch.vllm_venv import ensure_venv


def _main_replicas(servers: list[VLLMServer], health_timeout: float) -> int:
    """``--replicas N``: start N servers side by side, stop them all when one exits or on a signal."""
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for server in servers:
            server.start()
            _say(f"starting replica {server.url} (pid {server.pid}), log {server.log_path}")
        for server in servers:
            server.wait_healthy(health_timeout)
        flags = " ".join(f"--backend {s.url}" for s in servers)
        _say(f"{len(servers)} replicas ready; the proxy: steptap serve {flags}")
        while all(s.process is not None and s.process.poll() is None for s in servers):
            time.sleep(0.5)
        dead = next(s for s in servers if s.process is None or s.process.poll() is not None)
        _say(f"replica {dead.url} exited; stopping the others. End of its log:\n{dead.log_tail()}")
        return 1
    except VLLMStartError as exc:
        _say(str(exc))
        return 1
    except _Stop as stop:
        _say(f"{signal.Signals(stop.signum).name}, stopping {len(servers)} replicas")
        return 0
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for server in servers:
            server.stop()


class _Stop(Exception):
    def __init__(self, signum: int) -> None:
        self.signum = signum


def _raise_stop(signum: int, _frame: object) -> None:
    raise _Stop(signum)


def _say(message: str) -> None:
    print(f"steptap vllm: {message}", file=sys.stderr, flush=True)


TCP_REFUSED = (
    "vLLM runs in dev mode: on TCP its admin routes (init a weight transfer, reload weights, pause, load "
    "LoRA) answer every process that reaches the port, and vLLM's --api-key guards only /v1 (not those "
    "routes). Serve on unix sockets (the default: leave out --port), or say --insecure-tcp on a machine and "
    "network you trust (a firewall or private interface letting only the proxy in)"
)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The command line: steptap's flags and the arguments after ``--`` (vLLM's). Exits 2 on a bad line."""
    extra: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, extra = argv[:split], argv[split + 1 :]
    p = argparse.ArgumentParser(
        prog="steptap vllm",
        description="Start a vLLM OpenAI server (own virtualenv, dev mode, runtime LoRA, tool calls).",
        epilog="Arguments after `--` go to vLLM unchanged.",
    )
    p.add_argument("--model", help="model directory (required unless --install-only)")
    p.add_argument(
        "--uds",
        help="serve on this unix socket (its directory is made private when new; with --replicas N, "
             "replica i "
        "on PATH.i). The default when no --port is given: sockets in a fresh private directory, printed at "
        "start",
    )
    p.add_argument("--host", default="127.0.0.1", help="with --port: the TCP address")
    p.add_argument(
        "--port",
        type=int,
        help="serve on TCP instead of a unix socket (replica i on PORT+i). Refused unless --insecure-tcp is "
        "given: vLLM's dev-mode admin routes answer whoever reaches the port (its --api-key guards only /v1)",
    )
    p.add_argument("--insecure-tcp", action="store_true",
                   help="with --port: serve TCP with vLLM's admin routes open to whoever reaches the port")
    p.add_argument("--served-model-name", help="default: the model's hub name or its directory's name")
    p.add_argument("--max-model-len", type=int, help="default: 2048 on CPU, the model's own on GPU")
    p.add_argument("--max-lora-rank", type=int, default=16,
                   help="the largest LoRA adapter it takes (0: no LoRA, as float32 on a GPU needs)")
    parsers = ", ".join(sorted(set(TOOL_PARSERS.values())))
    p.add_argument(
        "--tool-call-parser",
        help=f"default: the one the model's chat template and tokenizer fit ({parsers}), else none",
    )
    p.add_argument("--threads", type=int, help="CPU: OpenMP threads for the model (default: half the cores)")
    p.add_argument("--cpu-bind", default="nobind", help="CPU: VLLM_CPU_OMP_THREADS_BIND (nobind, auto, 0-3)")
    p.add_argument("--kv-cache-gb", type=int, default=1, help="CPU: VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--log", help="server log file (default: ~/.cache/steptap/logs/vllm-PORT.log), 0600")
    p.add_argument("--venv", help="the vLLM virtualenv (default: in ~/.cache/steptap, or STEPTAP_VLLM_VENV)")
    p.add_argument("--health-timeout", type=float, default=600.0)
    p.add_argument("--install-only", action="store_true",
                   help="build the virtualenv (on CPU with vision models' torchvision) and exit")
    p.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="N servers, each on its own unix socket (or TCP port PORT+i); one per GPU when GPUs "
                        "are present, on CPU they share the cores; give each to `steptap serve --backend`")
    args = p.parse_args(argv)
    if args.install_only:
        return args, extra
    if not args.model:
        p.error("--model is required")
    if args.replicas < 1:
        p.error("--replicas must be at least 1")
    if args.uds and args.port is not None:
        p.error("--uds and --port exclude each other")
    if args.port is not None and not args.insecure_tcp:
        p.error(f"--port: {TCP_REFUSED}")
    return args, extra


def plan_servers(args: argparse.Namespace, extra: list[str]) -> tuple[list[VLLMServer], str | None]:
    """The servers ``args`` asks for, not started, and the private directory made for their sockets (the
    caller removes it) or None. Raises ``VLLMStartError`` for a directory that is no model."""
    n = args.replicas
    gpu = has_gpu() if n > 1 else None
    threads = replica_threads(n, bool(gpu), args.threads)
    own_dir = None
    if args.port is None and not args.uds:
        own_dir = tempfile.mkdtemp(prefix="steptap-vllm-")  # mode 0700, removed at exit
    servers: list[VLLMServer] = []
    try:
        servers = [_planned(args, extra, i, gpu, threads, own_dir) for i in range(n)]
    except BaseException:
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
        raise
    return servers, own_dir


def _planned(args: argparse.Namespace, extra: list[str], i: int, gpu: bool | None, threads: int | None,
             own_dir: str | None) -> VLLMServer:
    n = args.replicas
    if args.port is not None:
        where: dict[str, object] = {"port": args.port + i}
    elif own_dir is not None:
        where = {"uds": Path(own_dir) / ("vllm.sock" if n == 1 else f"vllm-{i}.sock")}
    else:
        where = {"uds": args.uds if n == 1 else f"{args.uds}.{i}"}
    log = args.log if n == 1 or not args.log else f"{args.log}.{i}"
    return VLLMServer(
        args.model, host=args.host, served_model_name=args.served_model_name,
        max_model_len=args.max_model_len, max_lora_rank=args.max_lora_rank, tool_parser=args.tool_call_parser,
        threads=threads, cpu_bind=args.cpu_bind, kv_cache_gb=args.kv_cache_gb, log_path=log, venv=args.venv,
        extra_args=extra, gpu=gpu, env=replica_env(i, n, bool(gpu)),
        **where)  # type: ignore[arg-type]  # where: {port: int} or {uds: str | Path}, VLLMServer's types


def main(argv: list[str] | None = None) -> int:
    args, extra = parse(list(sys.argv[1:] if argv is None else argv))
    if args.install_only:
        gpu = has_gpu()
        venv = ensure_venv(args.venv, gpu)
        if not gpu:  # vision models' torchvision (launch/vision.py): built here, not on a first server start
            ensure_torchvision(venv)
        print(venv)
        return 0
    try:
        servers, own_dir = plan_servers(args, extra)
    except VLLMStartError as exc:
        _say(str(exc))
        return 2
    try:
        if len(servers) > 1:
            return _main_replicas(servers, args.health_timeout)
        return _main_one(servers[0], args.health_timeout)
    finally:
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)


def _main_one(server: VLLMServer, health_timeout: float) -> int:
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        _say(f"starting {server.served_model} (pid {server.pid}), log {server.log_path}")
        waited = server.wait_healthy(health_timeout)
        _say(f"ready at {server.url} (OpenAI routes under /v1) as {server.served_model!r} after "
             f"{waited:.0f} s")
        code = server.process.wait() if server.process else 1
        _say(f"server exited with code {code}; end of log:\n{server.log_tail()}")
        return code if code >= 0 else 128 - code
    except VLLMStartError as exc:
        _say(str(exc))
        return 1
    except _Stop as stop:
        _say(f"{signal.Signals(stop.signum).name}, stopping the server")
        for s in previous:  # a second Ctrl-C while it shuts down: kill it outright
            signal.signal(s, lambda *_: server.kill())
        server.stop()
        # A requested stop: its own exit code means little (vLLM mid-startup exits 1 on SIGTERM); whether it
        # went within the grace period does.
        return 128 + signal.SIGKILL if server.forced else 0
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        server.stop()
