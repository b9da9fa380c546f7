"""The folded curation marks of trajectories, asked of a proxy (``POST /curation/lookup``): the one client of
that route, used by the learner before each update (learner/curation.py) and by ``steptap export --proxy``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp

from steptap.middleware.client.api import SteptapError
from steptap.middleware.client.stream import SteptapClient
from steptap.middleware.curation import MAX_LOOKUP_IDS, CurationState, fold

RETRY_S = 1.0


async def lookup(client: SteptapClient, ids: list[str], stopped: Callable[[], bool],
                 note: Callable[[str], None], sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
                 ) -> dict[str, CurationState]:
    """The folded marks of ``ids`` at one proxy. A proxy that cannot answer now (restarting) is asked again
    until it does or ``stopped()`` (then RuntimeError): training on (or exporting) a trajectory someone
    excluded is the one thing curation must never let happen. A proxy without the route (404: older than
    curation) has no marks."""
    out: dict[str, CurationState] = {}
    warned = False
    for start in range(0, len(ids), MAX_LOOKUP_IDS):
        chunk = ids[start:start + MAX_LOOKUP_IDS]
        while True:
            try:
                marks = await client.curation(chunk)
                break
            except SteptapError as exc:
                if exc.status == 404:
                    return out
                if not 500 <= exc.status < 600:
                    raise
                why: object = exc
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                why = exc
            if stopped():
                raise RuntimeError(f"stopped while asking {client.url} for curation marks ({why})")
            if not warned:
                note(f"[yellow]curation lookup failed[/yellow] at {client.url} ({why}); asking again")
                warned = True
            await sleep(RETRY_S)
        out.update({tid: fold(m) for tid, m in marks.items()})
    return out
