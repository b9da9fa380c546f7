"""Run inside a task sandbox (stdlib only, by the host's Python with ``-I``): start the episode's command and,
with ``--listen``, relay TCP connections on 127.0.0.1:PORT to the unix socket the runner serves.

The sandbox has its own network namespace (no interface but an isolated loopback), so the agent's base URL,
``http://127.0.0.1:PORT/s/<id>/v1``, reaches this relay, which passes the bytes to the socket bound into the
sandbox; the runner's end of that socket forwards only the session's own routes to the proxy
(``bridge.py``). ``--status-fd`` receives ``started`` once the command runs (or ``error <why>``), so the
runner tells a sandbox that never started from a command that failed. ``--stdin``: the command reads the
sandbox's stdin (a one-member ``steptap run`` at a terminal), else nothing. The exit code is the command's
(128 + N for a signal, as shells report it).

    python -I launcher.py --status-fd 3 [--listen 127.0.0.1:8400 --socket /run/steptap/net/s.sock] \
        [--stdin] -- CMD
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(1 << 16):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass


async def _relay(socket_path: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        up_reader, up_writer = await asyncio.open_unix_connection(socket_path)
    except OSError:
        writer.close()
        return
    try:
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
    except asyncio.CancelledError:
        # the episode ended with this connection open: its task ends here, since Python 3.11's
        # start_server callback asks a cancelled task for its exception and prints the traceback into the
        # agent's output
        pass
    finally:
        for w in (writer, up_writer):
            w.close()


def _status(fd: int, line: str) -> None:
    try:
        os.write(fd, (line.replace("\n", " ") + "\n").encode())
    except OSError:
        pass


async def main(args: argparse.Namespace) -> int:
    server = None
    if args.listen:
        host, _, port = args.listen.rpartition(":")
        try:
            server = await asyncio.start_server(lambda r, w: _relay(args.socket, r, w), host, int(port))
        except OSError as exc:
            _status(args.status_fd, f"error cannot listen on {args.listen}: {exc}")
            return 127
    try:
        proc = await asyncio.create_subprocess_exec(
            *args.command, stdin=None if args.stdin else asyncio.subprocess.DEVNULL)
    except OSError as exc:
        _status(args.status_fd, f"error cannot run {args.command[0]!r}: {exc}")
        return 127
    _status(args.status_fd, "started")
    code = await proc.wait()
    if server is not None:
        server.close()
    return 128 - code if code < 0 else code


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="launcher")
    p.add_argument("--status-fd", type=int, required=True)
    p.add_argument("--listen", default=None)
    p.add_argument("--socket", default=None)
    p.add_argument("--stdin", action="store_true", help="the command reads the sandbox's stdin (steptap run)")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command or bool(args.listen) != bool(args.socket):
        p.error("a command after --, and --listen with --socket")
    return args


if __name__ == "__main__":
    parsed = _parse(sys.argv[1:])
    sys.exit(asyncio.run(main(parsed)))
