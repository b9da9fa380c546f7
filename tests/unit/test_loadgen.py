"""bench/loadgen.py against a real aiohttp server: the order in which it calls its targets."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import loadgen  # noqa: E402 - from bench/, put on sys.path above


@pytest.mark.parametrize(("block", "timed"), [(1, "abcabc"), (2, "aabbccaabbcc")])
async def test_targets_called_in_turn_one_call_or_a_block_at_a_time(
        aiohttp_server: Any, block: int, timed: str) -> None:
    """Warm-up: one call a target in turn, whatever the block. Timed: ``block`` calls to a target, then
    the next."""
    seen: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append(request.match_info["name"])
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/{name}", answer)
    server = await aiohttp_server(app)
    targets = [{"name": n, "url": str(server.make_url(f"/{n}"))} for n in "abc"]
    out = await loadgen.run({"targets": targets, "body": "{}", "concurrency": 1, "warmup": 1, "block": block,
                             "requests": len(timed), "seconds": 60})
    assert "".join(seen) == "abc" + timed
    assert {n: t["calls"] for n, t in out["targets"].items()} == {n: timed.count(n) for n in "abc"}
