"""Curation honoured before each update: the learner asks each proxy for the marks of the trajectories it is
about to train (``POST /curation/lookup``), so a mark made any time before the update counts, however long
ago the trajectory was delivered. ``rows.build_batch`` drops what the marks exclude (``dropped_curated``,
``dropped_curated_step``) and trains on edited rewards (``curated_reward_edits``); ``note`` says which
trajectories were dropped and why."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import aiohttp

from steptap.middleware.client import SteptapClient, SteptapError
from steptap.middleware.curation import MAX_LOOKUP_IDS, CurationState, fold
from steptap.middleware.records import Trajectory

logger = logging.getLogger("steptap.learner")

RETRY_S = 1.0


async def lookup(client: SteptapClient, ids: list[str], stopped: Callable[[], bool],
                 note: Callable[[str], None], sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
                 ) -> dict[str, CurationState]:
    """The folded marks of ``ids`` at one proxy. A proxy that cannot answer now (restarting) is asked again
    until it does: training on a trajectory someone excluded is the one thing curation must never let
    happen. A proxy without the route (404: older than curation) has no marks."""
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
                raise RuntimeError(f"stopped while asking {client.base_url} for curation marks")
            if not warned:
                note(f"[yellow]curation lookup failed[/yellow] at {client.base_url} ({why}); asking again")
                warned = True
            await sleep(RETRY_S)
        out.update({tid: fold(m) for tid, m in marks.items()})
    return out


def note(trajs: list[Trajectory], states: dict[str, CurationState]) -> str | None:
    """What curation dropped from this batch, and why (None: nothing)."""
    parts = []
    for t in trajs:
        s = states.get(t.id)
        if s is None:
            continue
        if s.excluded:
            parts.append(f"{t.id} (excluded: {'; '.join(r for r in s.reasons if r) or 'no reason given'})")
        elif s.excluded_steps:
            parts.append(f"{t.id} steps {s.excluded_steps}")
    if not parts:
        return None
    shown = ", ".join(parts[:10]) + (f" and {len(parts) - 10} more" if len(parts) > 10 else "")
    return f"curation dropped {shown}"
