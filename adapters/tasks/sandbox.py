"""Where an episode's agent and its verifier run: one small interface, and the local bubblewrap sandbox.

``LocalSandbox`` (docs/tasks.md, "What the sandbox promises") runs each command in namespaces of its own
(mount, PID, network, IPC, UTS; a user namespace too when steptap does not run as root), with a root built
from nothing: the host's /usr and /etc (and the /bin, /lib... links or directories beside them) read-only, the
toolchains the episode needs read-only (the Python that runs steptap, its environment, the agent CLIs' cache
with Node), and only the job's own folders writable. Anything else of the host (homes, /tmp, /var, /srv, the
proxy's log, token files, other episodes' folders) is absent. /proc is the sandbox's own, so no host process
(the runner's environment included) is visible. Run as root, the command runs as an unprivileged user (65534,
``nobody``, by default) with no capabilities and ``no_new_privs``, so even the files it can see are read with
that user's rights. The network namespace has only a loopback; with ``Job.socket`` the command reaches one
unix socket on the host as ``127.0.0.1:PORT`` (``launcher.py`` relays it; ``bridge.py`` decides what passes).

At its timeout the whole sandbox is killed: bwrap is killed and its PID namespace with it, so every process
the command started, daemons and ``setsid`` children included, dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from steptap.adapters import agents

OUTPUT_TAIL = 8192  # characters of a command's output kept for the trajectory
MAX_OUTPUT_FILE = 16 << 20  # bytes of a command's output kept in its log file
SANDBOX_UID = 65534  # nobody: who the command runs as when steptap runs as root
INSIDE = "/run/steptap"  # the launcher and the socket's folder, inside
SYSTEM = ("/usr", "/etc")  # bound read-only; /bin, /lib, ... follow them (links, or bound too)
LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
PORT = 8400  # the inside end of the session's socket: http://127.0.0.1:PORT
START_TIMEOUT_S = 120.0  # a sandbox not up by then (the launcher has not started the job) failed to start


@dataclass
class Mount:
    source: Path
    target: str
    writable: bool = False


@dataclass
class Job:
    """One command in a fresh sandbox."""

    argv: list[str]
    cwd: str
    timeout_s: float | None  # None: no limit (steptap run: the operator stops it)
    env: dict[str, str] = field(default_factory=dict)  # the whole environment: nothing is inherited
    mounts: list[Mount] = field(default_factory=list)
    hostname: str = "task"
    socket: Path | None = None  # a unix socket on the host, reachable inside as 127.0.0.1:PORT
    log: Path | None = None  # where its output goes (bounded), besides the tail kept
    echo: Callable[[bytes], None] | None = None  # each piece of its output as it arrives, besides the tail
    terminal: bool = False  # stdin, stdout and stderr the runner's own (steptap run): nothing captured


@dataclass
class Ended:
    started: bool  # False: the sandbox itself failed (``error`` says why); the command never ran
    exit_code: int | None = None  # None when killed at its timeout or never started
    timed_out: bool = False
    seconds: float = 0.0
    output: str = ""  # the tail of its stdout and stderr
    error: str | None = None


class Sandbox(ABC):
    """Runs jobs; what a job may see and reach is the sandbox's promise (docs/tasks.md)."""

    name = "sandbox"

    @abstractmethod
    def problem(self) -> str | None:
        """Why jobs cannot run on this machine, or None."""

    def owner(self) -> tuple[int, int] | None:
        """The (uid, gid) jobs run as when it is not the runner's own."""
        return None

    @abstractmethod
    def own(self, path: Path) -> None:
        """Make ``path`` (a folder the runner made) writable by the jobs that mount it writable."""

    @abstractmethod
    async def run(self, job: Job) -> Ended:
        """Run ``job`` to its end or its timeout; never raises for the job's own failures."""


async def _pump(stream: asyncio.StreamReader | None, log: Path | None,
                echo: Callable[[bytes], None] | None = None) -> str:
    """Read a child's output to its end: the first ``MAX_OUTPUT_FILE`` bytes to ``log``, each piece to
    ``echo``, the tail kept."""
    if stream is None:  # a terminal job: its output went where the runner's goes
        return ""
    tail = bytearray()
    written = 0
    # unbuffered: the log shows what the job printed as it runs
    f = open(log, "wb", buffering=0) if log is not None else None  # noqa: SIM115 - closed below
    try:
        while chunk := await stream.read(1 << 16):
            if echo is not None:
                echo(chunk)
            tail += chunk
            del tail[:-OUTPUT_TAIL * 4]
            if f is not None and written < MAX_OUTPUT_FILE:
                f.write(chunk[: MAX_OUTPUT_FILE - written])
                written += len(chunk)
                if written >= MAX_OUTPUT_FILE:
                    f.write(b"\n[steptap: output cut here]\n")
    finally:
        if f is not None:
            f.close()
    return tail.decode("utf-8", "replace")[-OUTPUT_TAIL:]


def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # bwrap leads its group; its PID namespace dies with it


def _first_line(fd: int) -> tuple[str, float]:
    """(In a thread, which closes ``fd`` when done: nothing else may close it while a read may be under way.)
    The launcher's first status line (``started`` or ``error WHY``), or "" when the sandbox closed the pipe
    without one (it died before the launcher ran), and when it was read (``time.monotonic``): the event loop
    may see it later, a fast job's end included."""
    out = bytearray()
    try:
        while b"\n" not in out and len(out) < 4096 and (chunk := os.read(fd, 4096)):
            out += chunk
    finally:
        os.close(fd)
    return out.split(b"\n", 1)[0].decode("utf-8", "replace").strip(), time.monotonic()


def copy_tree(source: Path | None, dest: Path, exclude: frozenset[str] = frozenset()) -> None:
    """A fresh copy of ``source`` at ``dest`` for a sandbox to work on (links kept as links: one pointing
    outside points at nothing of the host inside the sandbox)."""
    if source is None:
        dest.mkdir(parents=True)
        return
    shutil.copytree(source, dest, symlinks=True,
                    ignore=lambda d, names: [n for n in names if Path(d) == source and n in exclude])


def search_path() -> str:
    """The PATH of every job: the bin folder of the Python environment running steptap (resolved, as the
    sandbox shows it), then the system's."""
    return f"{Path(sys.prefix).resolve()}/bin:/usr/local/bin:/usr/bin:/bin"


def toolchains() -> list[Path]:
    """The host folders an episode needs beyond /usr and /etc, read-only: the Python running steptap (its base
    installation and its environment), the agent CLIs' cache (Node 24 and the CLIs) and the Python
    installation each of the cache's CLI virtualenvs runs on (Mistral Vibe needs Python >= 3.12: maybe not
    steptap's)."""
    paths = [Path(sys.base_prefix), Path(sys.prefix), agents.agents_dir(), *_venv_pythons()]
    out: list[Path] = []
    for p in paths:
        p = p.resolve()
        if p.is_dir() and p not in out and not any(q in p.parents for q in out):
            out = [q for q in out if p not in q.parents] + [p]
    return out


def _venv_pythons() -> list[Path]:
    """The installation prefix of each Python the cache's CLI virtualenvs were made with (``home`` in their
    ``pyvenv.cfg`` is its bin folder)."""
    out = []
    for cfg in sorted((agents.agents_dir() / "venvs").glob("*/pyvenv.cfg")):
        with contextlib.suppress(OSError):
            for line in cfg.read_text().splitlines():
                key, _, value = line.partition("=")
                if key.strip() == "home" and value.strip():
                    out.append(Path(value.strip()).parent)
    return out


class LocalSandbox(Sandbox):
    """bubblewrap namespaces on this machine (module docstring)."""

    name = "local"

    def __init__(self, expose: list[Path] | None = None, uid: int = SANDBOX_UID) -> None:
        self.bwrap = shutil.which("bwrap") or "/usr/bin/bwrap"
        self.setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
        self.root = os.geteuid() == 0
        self.uid = uid if self.root else os.geteuid()
        self.gid = uid if self.root else os.getegid()
        self.expose = [p.resolve() for p in (expose or [])]
        self.python = os.path.realpath(sys.executable)
        self.launcher = Path(__file__).with_name("launcher.py").resolve()

    def problem(self) -> str | None:
        if not os.access(self.bwrap, os.X_OK):
            return ("bubblewrap is not installed (apt-get install bubblewrap, or your distribution's "
                    "package): the local task sandbox needs it")
        if self.root and not os.access(self.setpriv, os.X_OK):
            return "setpriv (util-linux) is not installed: the sandbox drops root with it"
        return None

    def owner(self) -> tuple[int, int] | None:
        return (self.uid, self.gid) if self.root else None

    def own(self, path: Path) -> None:
        if not self.root:
            return
        for dirpath, dirnames, filenames in os.walk(path):
            for name in [*dirnames, *filenames, ""]:
                with contextlib.suppress(FileNotFoundError):
                    os.lchown(os.path.join(dirpath, name) if name else dirpath, self.uid, self.gid)

    # -- the command line --------------------------------------------------------------------------------
    def _dirs(self, target: str, made: set[str]) -> list[str]:
        """Each missing ancestor of ``target`` made 0755 (bwrap's own are 0700: the dropped user could not
        pass them)."""
        out: list[str] = []
        parts = Path(target).parts[1:-1]
        for i in range(len(parts)):
            d = "/" + "/".join(parts[: i + 1])
            if d not in made:
                made.add(d)
                out += ["--perms", "0755", "--dir", d]
        return out

    def argv(self, job: Job, status_fd: int) -> list[str]:
        a = [self.bwrap, "--die-with-parent", "--new-session", "--unshare-ipc", "--unshare-pid",
             "--unshare-net", "--unshare-uts", "--unshare-cgroup-try", "--hostname", job.hostname]
        if self.root:  # what setpriv needs to drop to the sandbox user, and nothing else
            a += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                  "--cap-add", "CAP_SETPCAP"]
        else:
            a += ["--unshare-user", "--cap-drop", "ALL"]
        made: set[str] = set()
        for d in SYSTEM:
            a += ["--ro-bind", d, d]
            made.add(d)
        for link in LINKS:
            if os.path.islink(link):
                a += ["--symlink", os.readlink(link), link]
            elif os.path.isdir(link):
                a += ["--ro-bind", link, link]
        a += ["--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--tmpfs", "/tmp",
              "--perms", "1777", "--tmpfs", "/dev/shm"]
        made |= {"/dev", "/proc", "/tmp"}
        for path in [*toolchains(), *self.expose]:
            if not any(str(path).startswith(d + "/") for d in SYSTEM):
                a += self._dirs(str(path), made) + ["--ro-bind", str(path), str(path)]
        mounts = [*job.mounts, Mount(self.launcher, f"{INSIDE}/launcher.py")]
        if job.socket is not None:
            mounts.append(Mount(job.socket.parent, f"{INSIDE}/net"))
        for m in mounts:
            kind = "--bind" if m.writable else "--ro-bind"
            a += self._dirs(m.target, made) + [kind, str(m.source), m.target]
        a += ["--chdir", job.cwd]
        if self.root:
            a += [self.setpriv, f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups",
                  "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
        a += [self.python, "-I", f"{INSIDE}/launcher.py", "--status-fd", str(status_fd)]
        if job.terminal:
            a += ["--stdin"]
        if job.socket is not None:
            a += ["--listen", f"127.0.0.1:{PORT}", "--socket", f"{INSIDE}/net/{job.socket.name}"]
        return [*a, "--", *job.argv]

    # -- running -----------------------------------------------------------------------------------------
    async def run(self, job: Job) -> Ended:
        status_r, status_w = os.pipe()
        started_at = time.monotonic()
        try:
            sub, held = asyncio.subprocess, job.terminal  # a terminal job's stdio is the runner's own
            proc = await asyncio.create_subprocess_exec(
                *self.argv(job, status_w), env=job.env, stdin=None if held else sub.DEVNULL,
                stdout=None if held else sub.PIPE, stderr=None if held else sub.STDOUT, pass_fds=(status_w,),
                start_new_session=True)
        except OSError as exc:
            os.close(status_r)
            return Ended(started=False, error=f"cannot start bubblewrap: {exc}")
        finally:
            os.close(status_w)  # the sandbox holds the only write end: EOF once it is gone
        output = asyncio.ensure_future(_pump(proc.stdout, job.log, job.echo))
        timed_out, said = False, ""
        first = asyncio.get_running_loop().run_in_executor(None, _first_line, status_r)  # it closes the fd
        try:
            # the job's time counts from its start: a sandbox slow to come up (a loaded machine) is not
            # charged to the agent, one that never comes up is the sandbox's failure
            said, said_at = await asyncio.wait_for(asyncio.shield(first), START_TIMEOUT_S)
            if said.startswith("started"):
                started_at = said_at
                await asyncio.wait_for(proc.wait(), job.timeout_s)
            else:
                await asyncio.wait_for(proc.wait(), START_TIMEOUT_S)
        except TimeoutError:
            timed_out = True
            _kill(proc)
            await proc.wait()
        except BaseException:  # cancelled (Ctrl-C): nothing of the sandbox outlives the runner
            _kill(proc)
            await proc.wait()
            raise
        tail = await output
        seconds = round(time.monotonic() - started_at, 3)
        if not said.startswith("started"):
            last = (tail.strip().splitlines() or ["the sandbox did not start"])[-1]
            why = said.removeprefix("error ") or (
                f"the sandbox did not start in {START_TIMEOUT_S:g} s" if timed_out else last)
            return Ended(started=False, seconds=seconds, output=tail, timed_out=timed_out, error=why[:500])
        code = None if timed_out else proc.returncode
        return Ended(started=True, exit_code=code, timed_out=timed_out, seconds=seconds, output=tail)
