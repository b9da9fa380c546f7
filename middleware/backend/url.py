"""A vLLM server's (or a proxy's) URL, parsed once: ``unix:PATH`` or ``http(s)://host:port``, ``/v1``
stripped.

Stdlib only: the kernel's sync client and the launchers share it with the async backend client."""

from __future__ import annotations

from typing import NamedTuple
from urllib.parse import urlsplit

UNIX_BASE = "http://localhost"  # the HTTP base of a server reached over a unix socket


class BackendUrl(NamedTuple):
    """``name``: the URL as configured (trailing ``/`` and ``/v1`` stripped), what messages and records say;
    ``base``: where HTTP requests go (``http://localhost`` over a socket); ``socket``: the unix socket, or
    None."""

    name: str
    base: str
    socket: str | None

    @classmethod
    def parse(cls, url: str) -> BackendUrl:
        name = url.strip().rstrip("/").removesuffix("/v1").rstrip("/")
        if name.startswith("unix:"):
            path = name[len("unix:"):]
            if not path:
                raise ValueError(f"{url!r}: expected unix:/path/to/socket")
            return cls(name, UNIX_BASE, path)
        return cls(name, name, None)

    def __str__(self) -> str:
        return self.name


def problem(url: str) -> str | None:
    """Why ``url`` names no server (None when it does): ``http(s)://host[:port]`` or ``unix:PATH``."""
    if url.strip().startswith("unix:"):
        try:
            BackendUrl.parse(url)
        except ValueError as exc:
            return str(exc)
        return None
    parts = urlsplit(url.strip())
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError as exc:
        return f"{url!r}: {exc}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r}: expected http(s)://host:port or unix:PATH"
    return None


def name_of(url: str) -> str:
    """The replica name of a configured URL (how two spellings of one server compare equal)."""
    return BackendUrl.parse(url).name
