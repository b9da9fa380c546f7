"""Curation honoured before each update: the learner asks each proxy for the marks of the trajectories it
is about to train (``POST /curation/lookup``: ``lookup``, the one client of it, in
middleware/client/curation.py), so a mark made any time before the update counts, however long ago the
trajectory was delivered. ``rows.build_batch`` drops what the marks exclude (``dropped_curated``,
``dropped_curated_step``) and trains on edited rewards (``curated_reward_edits``); ``note`` says which
trajectories were dropped and why."""

from __future__ import annotations

from steptap.middleware.client.curation import lookup
from steptap.middleware.curation import CurationState
from steptap.middleware.records import Trajectory

__all__ = ["CurationState", "lookup", "note"]


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
