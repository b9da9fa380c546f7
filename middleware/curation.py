"""Curation marks folded into what they mean for training: one definition, shared by the proxy (the console,
the lookup route) and the learner (``learner/curation.py``), which trains only on what the marks leave in.

A trajectory's marks (``records.Curation``) apply in log order: the latest ``exclude``/``include`` of the
trajectory, or of a step, wins; a ``reward`` edit sets one named reward component (of the trajectory, or of a
step); tags accumulate and change nothing that trains."""

from __future__ import annotations

from typing import Annotated

import msgspec

from steptap.middleware.records import Curation, CurationAction, Trajectory

MAX_MARKS_PER_TRAJECTORY = 256  # a trajectory's marks beyond this are refused (409): bounded memory
MAX_LOOKUP_IDS = 4096  # ids per lookup (POST /curation/lookup)

_Tag = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class CurationBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /sessions/<id>/curation``: one mark."""

    action: CurationAction
    step: Annotated[int, msgspec.Meta(ge=0)] | None = None
    value: float | None = None
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] = "reward"
    tags: Annotated[list[_Tag], msgspec.Meta(max_length=16)] = []
    reason: Annotated[str, msgspec.Meta(max_length=500)] = ""

    def check(self) -> str | None:
        """Why this body is not a valid mark, or None."""
        if self.action == "reward":
            if self.value is None or self.value != self.value or abs(self.value) == float("inf"):
                return "a reward edit needs a finite 'value'"
        elif self.value is not None:
            return f"'value' belongs to a reward edit, not {self.action!r}"
        if self.action == "tag" and not self.tags:
            return "a tag mark needs 'tags'"
        return None


class LookupBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /curation/lookup``: the marks of these trajectories (the learner, before each update)."""

    ids: Annotated[list[Annotated[str, msgspec.Meta(max_length=256)]],
                   msgspec.Meta(max_length=MAX_LOOKUP_IDS)]


class CurationState(msgspec.Struct, kw_only=True):
    """What a trajectory's marks say, folded."""

    excluded: bool = False
    excluded_steps: list[int] = []
    rewards: dict[str, float] = {}  # trajectory reward components set by a reward edit
    step_rewards: dict[int, dict[str, float]] = {}  # step index -> components set by a reward edit
    tags: list[str] = []
    reasons: list[str] = []  # why each exclude in force was made ("" when none was given)
    marks: int = 0


def fold(marks: list[Curation]) -> CurationState:
    """The effect of ``marks`` (in log order)."""
    state = CurationState(marks=len(marks))
    excluded: dict[int | None, str | None] = {}  # None: the trajectory; a value: the exclude's reason
    for m in marks:
        if m.action in ("exclude", "include"):
            excluded[m.step] = m.reason if m.action == "exclude" else None
        elif m.action == "reward" and m.value is not None:
            if m.step is None:
                state.rewards[m.name] = m.value
            else:
                state.step_rewards.setdefault(m.step, {})[m.name] = m.value
        elif m.action == "tag":
            state.tags.extend(t for t in m.tags if t not in state.tags)
    state.excluded = excluded.get(None) is not None
    state.excluded_steps = sorted(s for s, why in excluded.items() if s is not None and why is not None)
    state.reasons = [why for why in excluded.values() if why is not None]
    return state



def edit_rewards(traj: Trajectory, state: CurationState) -> Trajectory:
    """``traj`` with the reward edits of ``state``: each edited component (of the trajectory, of a step)
    replaced; what it was recorded with otherwise (the same object when nothing was edited)."""
    if not state.rewards and not state.step_rewards:
        return traj
    steps = [msgspec.structs.replace(s, rewards={**s.rewards, **state.step_rewards[s.index]})
             if s.index in state.step_rewards else s for s in traj.steps]
    return msgspec.structs.replace(traj, rewards={**traj.rewards, **state.rewards}, steps=steps)
