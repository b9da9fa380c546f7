"""``steptap run``'s members in the task runner's local sandbox (``tasks/sandbox.py``: bubblewrap namespaces,
a root built from nothing, no network but the session bridge), the default for ``--agent`` (docs/agents.md,
"steptap run's sandbox").

What a member sees, besides the system's /usr and /etc and the toolchains (read-only): its working directory
at the path of ``steptap run``'s own, writable (the directory itself for one member, with ``.git``
read-only; a copy of it of its own for each member of ``-n`` > 1; and run as root, where the sandbox's user
(nobody) can write only what is handed to it, a lone member works on a copy whose new and changed files are
written back when it ended, ``write_back``), its home
(the agent's settings folder, or an empty one) and its reward file's folder, both writable at their host
paths. Not the operator's home, not the control-token file, not the proxy's log, not another member's
folders, not any host process. Its network is its session URL only (``tasks/bridge.py``), as
``http://127.0.0.1:PORT/s/<id>/v1``. Its environment is built afresh (the operator's is not inherited: it
may hold the token, or other secrets).
"""

from __future__ import annotations

import filecmp
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from steptap.adapters import agents
from steptap.adapters.tasks.bridge import Bridge
from steptap.adapters.tasks.sandbox import (
    PORT,
    SYSTEM,
    Ended,
    Job,
    LocalSandbox,
    Mount,
    copy_tree,
    search_path,
    toolchains,
)

LOG_FOLDER = "steptap-log"  # the proxy's default log folder (config.DEFAULT_LOG_DIR), where serve ran
UP_RUNS = "runs"  # steptap up's default work folders (runs/up-STAMP: control_token, the log), where it ran


def inside_url(session_id: str) -> str:
    """The session's base URL as a sandboxed member reaches it (the launcher's relay to the bridge)."""
    return f"http://127.0.0.1:{PORT}/s/{session_id}/v1"


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


@dataclass
class Place:
    """One member's folders on the host: ``folder`` (private, 0700) holds ``work`` (its copy of the working
    directory, with -n > 1 or as root), ``home`` (a plain command's HOME) and ``out`` (where its reward file
    goes unless ``--reward-file`` names one in the working directory)."""

    folder: Path
    work: Path
    home: Path
    mounts: list[Mount] = field(default_factory=list)


class RunSandbox:
    """The sandbox of one ``steptap run``: ``problem()`` once, then ``place`` and ``run`` per member."""

    def __init__(self, cwd: Path, n: int, tmpdir: Path, expose: list[Path], proxy: str) -> None:
        self.cwd, self.tmpdir, self.proxy = cwd.resolve(), tmpdir.resolve(), proxy
        self.expose = [p.resolve() for p in expose]
        self.sb = LocalSandbox(expose=self.expose)
        # a copy each: members of a group never edit the same files; and run as root, the sandbox's user
        # (nobody) can write only what is handed to it, never the operator's own folder
        self.copies = n > 1 or self.sb.owner() is not None
        self.write_back = self.copies and n == 1  # a lone member's work is the operator's: back once it ended

    def problem(self, token_file: str | None, homes: Path | None) -> str | None:
        """Why members cannot run sandboxed from here (one line), or None: no bubblewrap, or a working
        directory that would put in the member's view (writable) what the sandbox keeps out."""
        why = self.sb.problem()
        if why:
            return why
        home = Path.home().resolve()
        where = f"the working directory {self.cwd}"
        if _within(home, self.cwd):
            return f"{where} holds your home; run from a project folder"
        if token_file and _within(Path(token_file).resolve(), self.cwd):
            return f"{where} holds the control-token file {token_file}"
        if (self.cwd / LOG_FOLDER).exists():
            return f"{where} holds a proxy's log ({LOG_FOLDER}/); run from a folder without it"
        runs = sorted((self.cwd / UP_RUNS).glob("*/control_token"))
        if runs:
            return (f"{where} holds steptap up's run folder {runs[0].parent} (its control token and log); "
                    "run from a folder without it")
        for inner in (self.tmpdir, homes):
            if inner is not None and _within(inner.resolve(), self.cwd):
                return f"{where} holds the run's own folders ({inner})"
        return None

    def visible(self, path: Path) -> bool:
        """Whether the sandbox shows ``path`` (read-only at least)."""
        path = path.resolve()
        shown = [*(Path(d) for d in SYSTEM), *toolchains(), *self.expose, self.cwd]
        return any(_within(path, d) for d in shown)

    def place(self, index: int) -> Place:
        folder = self.tmpdir / f"member-{index}"
        folder.mkdir(mode=0o700)
        for name in ("out", "home"):
            (folder / name).mkdir(mode=0o700)
        work = folder / "work" if self.copies else self.cwd
        if self.copies:
            copy_tree(self.cwd, work)  # links kept as links: one pointing outside shows nothing of the host
        mounts = [Mount(work, str(self.cwd), True)]
        git = self.cwd / ".git"
        if not self.copies and (git.is_dir() or git.is_file()):
            # its hooks and config are run by the operator's git, outside the sandbox: never the agent's
            mounts.append(Mount(git, str(git), False))
        mounts.append(Mount(folder / "out", str(folder / "out"), True))
        for d in (folder / "out", folder / "home", *([work] if self.copies else [])):
            self.sb.own(d)
        return Place(folder, work, folder / "home", mounts)

    def environment(self, home: Path, cli_env: dict[str, str]) -> dict[str, str]:
        """A member's environment: built afresh; the CLI's settings (its PATH puts the cache's Node first)."""
        env = {"PATH": search_path(), "HOME": str(home), "LANG": os.environ.get("LANG") or "C.UTF-8",
               "TMPDIR": "/tmp", "TERM": os.environ.get("TERM") or "dumb", "PWD": str(self.cwd)}
        env.update({k: v for k, v in cli_env.items() if k != "PATH"})
        if "PATH" in cli_env:
            env["PATH"] = f"{agents.node_bin_dir()}:{env['PATH']}"
        return env

    async def run(self, index: int, place: Place, argv: list[str], env: dict[str, str], session_id: str,
                  home: Path, out: BinaryIO | None) -> Ended:
        """The member's command in its sandbox, its calls bridged to its own session URL; ``out``: its
        output, line by line prefixed ``[index]`` (else it has the terminal: stdin, stdout, stderr)."""
        mounts = [*place.mounts, Mount(home, str(home), True)]  # the agent's settings folder, or an empty one
        net = Path(tempfile.mkdtemp(prefix="steptap-net-"))  # a socket's path is short (107 bytes at most)
        for d in (home, net):
            self.sb.own(d)
        bridge = Bridge(net / "proxy.sock", self.proxy, session_id, self.sb.owner())
        prefix = Prefixed(f"[{index}] ".encode(), out) if out is not None else None
        try:
            await bridge.start()
            return await self.sb.run(Job(
                argv=argv, cwd=str(self.cwd), timeout_s=None, env=env, mounts=mounts, hostname=f"run-{index}",
                socket=bridge.socket, terminal=prefix is None, echo=prefix.write if prefix else None))
        finally:
            if prefix is not None:
                prefix.close()
            await bridge.close()
            shutil.rmtree(net, ignore_errors=True)


def write_back(copy: Path, dest: Path) -> int:
    """A lone member's new and changed files written from its copy back into the working directory (run as
    root, it worked on a copy: module docstring); the number written. Only regular files and folders, their
    permission bits without set-id; never ``.git``, never through a link of either tree (a link the member
    planted, or one of the operator's pointing outside); deletions are not carried back."""
    written = 0
    for dirpath, dirnames, filenames in os.walk(copy):
        here = Path(dirpath)
        target = dest / here.relative_to(copy)
        if target.is_symlink() or (target.exists() and not target.is_dir()):
            dirnames[:] = []
            continue
        target.mkdir(exist_ok=True)
        dirnames[:] = [d for d in dirnames
                       if not (here / d).is_symlink() and not (here == copy and d == ".git")]
        for name in filenames:
            src, dst = here / name, target / name
            mode = src.lstat().st_mode
            if not stat.S_ISREG(mode) or dst.is_symlink() or (dst.exists() and not dst.is_file()):
                continue
            if dst.exists() and filecmp.cmp(src, dst, shallow=False):
                continue
            shutil.copyfile(src, dst)
            os.chmod(dst, mode & 0o777)
            written += 1
    return written


class Prefixed:
    """Output written line by line, each prefixed (a partial last line too, at ``close``)."""

    def __init__(self, tag: bytes, out: BinaryIO) -> None:
        self.tag, self.out, self.pending = tag, out, b""

    def write(self, chunk: bytes) -> None:
        *lines, self.pending = (self.pending + chunk).split(b"\n")
        if lines:
            self.out.write(b"".join(self.tag + ln + b"\n" for ln in lines))
            self.out.flush()

    def close(self) -> None:
        if self.pending:
            self.out.write(self.tag + self.pending + b"\n")
            self.out.flush()
            self.pending = b""

