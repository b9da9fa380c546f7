"""Child processes supervised together (used by `steptap up`).

Each child runs in its own session (so its own process group): a Ctrl-C in the terminal reaches only the
supervisor, which then stops the children in reverse start order (SIGTERM to the group, a grace period,
SIGKILL), and finally kills any descendant that escaped its group (a child that made its own session, like a
server that supervises its own server). On Linux each child also gets SIGTERM if the supervisor dies without
cleaning up (PR_SET_PDEATHSIG), so even a SIGKILLed `steptap up` leaves nothing running for long.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import psutil

from steptap.middleware.files import private_dir
from steptap.middleware.launch.lifetime import die_with_parent
from steptap.middleware.launch.private_files import open_private_log
from steptap.middleware.launch.procs import signal_group, stop_group

_NOISE = re.compile(r'"(GET|HEAD) /(health|metrics|v1/models)[ ?]')


class Child:
    """One supervised process with its log file."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        may_exit: bool = False,
        pass_fds: tuple[int, ...] = (),
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = Path(log_path)
        self.env = env
        self.may_exit = may_exit  # exit code 0 is not a failure (an agent population that finished)
        self.pass_fds = pass_fds  # inherited (the proxy's listening socket)
        self.proc: subprocess.Popen[bytes] | None = None
        self.known: set[int] = set()  # descendants seen while it ran, killed at stop if still alive

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def start(self) -> Child:
        private_dir(self.log_path.parent)
        with open(open_private_log(self.log_path), "ab") as log:  # logs hold prompts and paths: 0600
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                pass_fds=self.pass_fds,
                start_new_session=True,
                preexec_fn=die_with_parent(),  # noqa: PLW1509 - up starts children before any thread exists
            )
        return self

    def wait(self, timeout: float | None = None) -> int | None:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def remember_descendants(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.known.update(p.pid for p in psutil.Process(self.proc.pid).children(recursive=True))
        except psutil.Error:
            pass

    def signal_group(self, sig: int) -> None:
        if self.proc is not None:
            signal_group(self.proc.pid, sig)  # its own session: the group id is its pid

    def tail(self, lines: int = 25) -> str:
        """The log's last lines, without access-log lines of health and metrics polls (they bury the
        cause)."""
        try:
            data = self.log_path.read_bytes()[-200_000:].decode("utf-8", "replace")
        except OSError:
            return "(no log)"
        keep = [line for line in data.splitlines() if not _NOISE.search(line)]
        return "\n".join(keep[-lines:])


class Supervisor:
    """Children started in order and stopped in reverse order."""

    def __init__(self, grace_s: float = 10.0) -> None:
        self.grace_s = grace_s
        self.children: list[Child] = []

    def start(self, child: Child) -> Child:
        self.children.append(child.start())
        return child

    def get(self, name: str) -> Child | None:
        return next((c for c in self.children if c.name == name), None)

    def first_failed(self) -> Child | None:
        """The first child that exited when it should not have (or exited non-zero)."""
        for child in self.children:
            rc = child.returncode
            if rc is not None and not (child.may_exit and rc == 0):
                return child
            child.remember_descendants()
        return None

    def stop_all(self) -> None:
        for child in reversed(self.children):
            child.remember_descendants()
        for child in reversed(self.children):
            self._stop(child)
        # Anything that left its group (or was started by a child that died first) is killed by pid.
        leftovers = [p for c in self.children for p in c.known if psutil.pid_exists(p)]
        for pid in leftovers:
            try:
                psutil.Process(pid).terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(_procs(leftovers), timeout=self.grace_s)
        for proc in alive:
            try:
                proc.kill()
            except psutil.Error:
                pass

    def _stop(self, child: Child) -> None:
        if child.proc is not None:
            stop_group(child.proc, self.grace_s, kill_wait_s=5.0)  # the group too, even if its leader is gone


def _procs(pids: list[int]) -> list[psutil.Process]:
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.Error:
            pass
    return out
