"""``steptap run``'s sandbox (adapters/run_sandbox.py), through a real proxy in process (no vLLM: the members
are shell commands that make no model call) and real bubblewrap: a member cannot see the operator's home, the
control-token file, the proxy's log, the test's own environment or another member's folder; its network is
its own session URL; with -n > 1 each works on a copy of the working directory (what the reward command
grades, the operator's folder untouched), a lone member on the directory itself with ``.git`` read-only. A
plain command runs sandboxed with ``--sandbox``; ``--agent`` is sandboxed unless ``--no-sandbox``."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import missing

from steptap.adapters.run import _parse_args
from steptap.adapters.run_sandbox import RunSandbox
from steptap.adapters.tasks.sandbox import LocalSandbox
from steptap.middleware.client import SteptapClient

NO_BACKEND = "http://127.0.0.1:9"  # nothing listens: the proxy opens and finishes sessions without vLLM


@pytest.fixture(autouse=True)
def bwrap() -> None:
    why = LocalSandbox().problem()
    if why:
        missing(why)


async def _run(proxy: Any, cwd: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "steptap.middleware.cli", "run", "--proxy", proxy.url, *args, cwd=cwd,
        env={**os.environ, "STEPTAP_CONTROL_TOKEN": proxy.token, **(env or {})},
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def _probe(paths: list[str], token: str) -> tuple[str, str]:
    """Each path looked for (it must not be there), the token searched in every visible process's
    environment (built at run time: the line itself does not hold it), the run's folders listed, a control
    route and the session URL asked through the bridge (``probe.py``), then the answer written where the
    member works."""
    head, tail = token[: len(token) // 2], token[len(token) // 2:]
    reads = "; ".join(f'test -e "{p}" && echo "read {p}" || echo denied' for p in paths)
    ask = ("import os, urllib.request as r, urllib.error as e\n"
           "base = os.environ['OPENAI_BASE_URL']\n"
           "for url in (base + '/models', base.split('/s/')[0] + '/sessions'):\n"
           "    try: code = r.urlopen(url, timeout=30).status\n"
           "    except e.HTTPError as x: code = x.code\n"
           "    print('bridge', url.replace(base, 'SESSION'), code)\n")
    return (f'{reads}; t="{head}"; t="${{t}}{tail}"; echo "environ-hits $(cat /proc/[0-9]*/environ '
            '2>/dev/null | grep -ac -e "$t")"; echo "members $(ls -d /tmp/steptap-run-*/member-* | wc -l)"; '
            f"python3 probe.py; echo 42 > answer.txt; echo $STEPTAP_MEMBER_INDEX > mine.txt; "
            "echo hook > .git/hooks/post-checkout 2>/dev/null && echo 'git writable' || echo 'git read-only'",
            ask)


async def test_a_sandboxed_member_sees_its_folder_and_session_only(make_proxy: Any, tmp_path: Path) -> None:
    proxy = await make_proxy(NO_BACKEND)
    token_file = tmp_path / "control_token"
    token_file.write_text(proxy.token)
    os.chmod(token_file, 0o600)
    home_file = Path.home() / f".steptap-run-probe-{os.getpid()}"
    home_file.write_text("the operator's\n")
    work = tmp_path / "work"
    (work / ".git" / "hooks").mkdir(parents=True)
    line, ask = _probe([], proxy.token)
    (work / "probe.py").write_text(ask)
    paths = [str(home_file), str(token_file), str(proxy.log_dir), f"/proc/{os.getpid()}/environ"]
    line, _ = _probe(paths, proxy.token)
    try:
        code, out, err = await _run(proxy, work, "--sandbox", "-n", "2", "--reward-cmd", "cat answer.txt",
                                    "--", "sh", "-c", line,
                                    env={"STEPTAP_CONTROL_TOKEN_FILE": str(token_file)})
        copied = not (work / "answer.txt").exists()  # the members worked on copies, graded there
        # one member, alone: it works on the directory itself, .git read-only (run as root: on a copy)
        code1, out1, err1 = await _run(proxy, work, "--sandbox", "--reward-cmd", "cat mine.txt", "--",
                                       "sh", "-c", line)
    finally:
        home_file.unlink()
    assert code == 0, err
    for i in (0, 1):
        mine = [ln.removeprefix(f"[{i}] ") for ln in out.splitlines() if ln.startswith(f"[{i}] ")]
        assert mine.count("denied") == len(paths) and not any(ln.startswith("read ") for ln in mine), out
        assert "environ-hits 0" in mine and "members 1" in mine, mine  # no other member's folder in view
        # its session URL passed on (the proxy answers for itself: no backend here), nothing else
        (models,) = [ln for ln in mine if ln.startswith("bridge SESSION/models ")]
        assert not models.endswith(" 403") and "bridge http://127.0.0.1:8400/sessions 403" in mine, mine
        assert "git writable" in mine  # its own copy's .git: nothing the operator runs
    assert copied
    sessions = [ln.split()[4] for ln in err.splitlines() if " session " in ln and "reward 42" in ln]
    assert len(sessions) == 2, err
    async with SteptapClient(proxy.url, proxy.token) as client:
        assert [(await client.get_session(s)).reward for s in sessions] == [42.0, 42.0]
    assert code1 == 0, err1
    assert "reward 0 -> finished" in err1, out1 + err1  # the reward command read what the member wrote
    assert not (work / ".git" / "hooks" / "post-checkout").exists()
    assert (work / "mine.txt").read_text() == "0\n"  # its work is the operator's
    # run as root the sandbox's user (nobody) writes only what is handed to it: a copy, its files written
    # back (never its .git); else the directory itself, .git read-only
    assert ("git writable" if os.geteuid() == 0 else "git read-only") in out1, out1


def test_what_is_sandboxed_by_default_and_where_it_refuses(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["--proxy", "http://127.0.0.1:9", "--control-token", "t"]
    assert _parse_args([*base, "--agent", "pi"]).sandbox is True
    assert _parse_args([*base, "--agent", "pi", "--no-sandbox"]).sandbox is False
    assert _parse_args([*base, "--", "true"]).sandbox is False  # the operator's own program
    assert _parse_args([*base, "--sandbox", "--", "true"]).sandbox is True
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):  # a reward file the member could not write
        _parse_args([*base, "--agent", "pi", "--reward-file", "/var/tmp/reward"])
    assert _parse_args([*base, "--agent", "pi", "--reward-file", "out/r-{index}"]).reward_file

    def why(cwd: Path, token_file: str | None = None) -> str | None:
        return RunSandbox(cwd, 1, tmp_path / "run", [], "http://127.0.0.1:9").problem(token_file, None)

    assert "holds your home" in (why(Path.home()) or "") and "holds your home" in (why(Path("/")) or "")
    (tmp_path / "project").mkdir()
    assert why(tmp_path / "project") is None
    assert "control-token file" in (why(tmp_path / "project", str(tmp_path / "project" / "tok")) or "")
    (tmp_path / "project" / "steptap-log").mkdir()
    assert "a proxy's log" in (why(tmp_path / "project") or "")
    assert "the run's own folders" in (why(tmp_path) or "")
    (tmp_path / "app" / "runs" / "up-1").mkdir(parents=True)
    assert why(tmp_path / "app") is None
    (tmp_path / "app" / "runs" / "up-1" / "control_token").write_text("t")
    assert "steptap up's run folder" in (why(tmp_path / "app") or "")


def test_a_lone_member_s_work_comes_back_only_as_files(tmp_path: Path) -> None:
    """``write_back`` (a lone member run as root worked on a copy): new and changed regular files come back,
    with their permission bits less set-id; never .git, never through a link, never a link itself."""
    from steptap.adapters.run_sandbox import write_back

    dest, copy, outside = tmp_path / "dest", tmp_path / "copy", tmp_path / "outside"
    for d in (dest / ".git", dest / "src", outside, copy / ".git", copy / "src", copy / "new", copy / "out"):
        d.mkdir(parents=True)
    (dest / "src" / "same.py").write_text("same\n")
    (copy / "src" / "same.py").write_text("same\n")
    (dest / "src" / "old.py").write_text("old\n")
    (copy / "src" / "old.py").write_text("changed\n")
    (copy / "new" / "tool.sh").write_text("#!/bin/sh\n")
    os.chmod(copy / "new" / "tool.sh", 0o6755)  # set-id bits: a root-owned set-uid file is never made
    (copy / ".git" / "config").write_text("[core]\n\tfsmonitor = evil\n")
    (dest / "out").symlink_to(outside)  # the operator's link pointing outside the folder
    (copy / "out" / "x").write_text("through the link\n")
    (copy / "planted").symlink_to("/etc/passwd")
    assert write_back(copy, dest) == 2
    assert (dest / "src" / "old.py").read_text() == "changed\n"
    assert (dest / "new" / "tool.sh").stat().st_mode & 0o7777 == 0o755
    assert not (dest / ".git" / "config").exists() and list(outside.iterdir()) == []
    assert not (dest / "planted").exists() and not (dest / "planted").is_symlink()
