"""The backend boundary (issue 41 item 1), read from the source with ``ast``: outside
``middleware/backend/``, the proxy uses aiohttp only as its server (``aiohttp.web``, ``aiohttp.typedefs``). No
module there names an aiohttp reply (``ClientResponse``, ``StreamReader``), session, timeout, payload or
error: vLLM's replies arrive as ``BackendReply`` / ``BackendStream`` and its failures as ``Backend*`` errors,
mapped once in ``backend/boundary.py``. A write to the agent that finds it gone raises aiohttp's
``ClientConnectionResetError``, a ``ConnectionResetError``: caught as that, it names nothing of aiohttp's.

The allow-list names the modules that are aiohttp clients of something else than vLLM, each with why. The
learner and the adapters are clients of the proxy (and of their own services), never its backend: out of
scope. The rule is also run on a deliberate violation (``tmp_path``) and must fail on it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVER_SIDE = ("aiohttp.web", "aiohttp.typedefs")  # the proxy's own server: anywhere
# module (relative to middleware/) -> why it may use aiohttp's client
ALLOWED = {
    "proxy/image_urls.py": "fetches the image URLs an agent names (--image-urls) from their hosts: not vLLM",
    "client/stream.py": "the kernel's async client of the proxy's own API (the learner's), never vLLM",
    "client/curation.py": "the kernel's client of the proxy's curation routes, never vLLM",
}


def _server_side(name: str) -> bool:
    return any(name == s or name.startswith(s + ".") for s in SERVER_SIDE)


def aiohttp_client_names(root: Path) -> list[str]:
    """``path:line: name`` for each aiohttp name outside the server side used under ``root`` (a middleware
    tree), but in ``backend/``, launch/vllm_plugin (inside vLLM) and the allow-list."""
    wrong: list[tuple[str, int, str]] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "backend" or "vllm_plugin" in rel.parts or rel.as_posix() in ALLOWED:
            continue
        tree = ast.parse(path.read_text())
        aliases = {a.asname or a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                   for a in n.names if a.name.split(".")[0] == "aiohttp"}
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "aiohttp":
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names
                         if a.name.split(".")[0] == "aiohttp" and a.name != "aiohttp"]
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id in aliases):
                names = [f"aiohttp.{node.attr}"]
            wrong += [(rel.as_posix(), node.lineno, n) for n in names if not _server_side(n)]
    return [f"{rel}:{line}: {name}" for rel, line, name in sorted(wrong)]


def test_nothing_outside_backend_holds_an_aiohttp_reply_or_catches_its_errors() -> None:
    wrong = aiohttp_client_names(ROOT / "middleware")
    assert not wrong, ("an aiohttp client name outside backend/ (use backend.boundary's BackendReply, "
                       "BackendStream and the Backend* errors):\n" + "\n".join(wrong))
    stale = [m for m in ALLOWED if not (ROOT / "middleware" / m).is_file()]
    assert not stale, f"gone: remove from ALLOWED: {stale}"


def test_the_boundary_rule_fails_on_a_reply_an_error_and_an_import(tmp_path: Path) -> None:
    (tmp_path / "proxy").mkdir()
    (tmp_path / "proxy" / "relay.py").write_text(
        "import aiohttp as h\nfrom aiohttp import web, ClientTimeout\nimport aiohttp.client_exceptions\n"
        "async def relay(resp: h.ClientResponse) -> web.Response:\n"
        "    try:\n        return web.Response(body=await resp.read())\n"
        "    except (TimeoutError, h.ClientPayloadError):\n        return web.Response(status=502)\n")
    assert aiohttp_client_names(tmp_path) == [
        "proxy/relay.py:2: aiohttp.ClientTimeout",
        "proxy/relay.py:3: aiohttp.client_exceptions",
        "proxy/relay.py:4: aiohttp.ClientResponse",
        "proxy/relay.py:7: aiohttp.ClientPayloadError",
    ]
    # the same code is backend/'s own, and an allow-listed client of something else may have its own
    (tmp_path / "backend").mkdir()
    (tmp_path / "proxy" / "relay.py").rename(tmp_path / "backend" / "client.py")
    (tmp_path / "proxy" / "image_urls.py").write_text("import aiohttp\nERRORS = (aiohttp.ClientError,)\n")
    (tmp_path / "proxy" / "sse.py").write_text("from aiohttp import web\nimport aiohttp.web\n"
                                               "OUT = web.StreamResponse\nGONE = ConnectionResetError\n")
    assert aiohttp_client_names(tmp_path) == []
