"""Delta steps: the log's form of a step whose prompt extends an earlier step of its trajectory (schema 4).

A step whose ``prefix`` is ``extends`` starts its prompt with the base step's prompt + response, token for
token, and its request usually repeats the base's (the same tools, the same messages and then some). Logged
whole, a session of n turns over a growing context costs O(n^2) bytes; logged as a delta it costs what is new:

- ``prompt_token_ids``: only the ids after the base's prompt + response;
- ``request``: only the keys whose value differs from the base's; a list that starts with items of the base's
  list of the same key (``messages``, ``input``) keeps only the items after them (``Delta.tails``: how many of
  the base's it starts with; since schema 8 not always all of them: Claude Code moves its ``cache_control``
  mark to its newest message each call, so the base's last message comes again without it); ``Delta.keys``
  keeps the order.

The choices of one call (``n > 1``, schema 5) share its request and prompt: each choice after the first is a
delta of the first (``Delta.kind == "choice"``: its prompt is the first's first ``shared`` ids + its own), so
a call records its request once, not n times.

A main-line step that does not extend the call before it but starts with most of its prompt ids (schema 8:
OpenClaw moves an internal-context message to the end of every request; a compaction keeps the system prompt
and tools) is a delta of that call's step too (``Delta.kind == "prefix"``: its prompt is the base's first
``shared`` ids + its own).

The delta form is the log's (and the live session's) business: every reader hands out full steps, equal
(msgpack byte for byte) to the step as it was made. Values are compared by their msgpack bytes, so ``1`` and
``1.0`` or ``true`` are never taken for each other; a token prompt that is the step's own ids (strict ints,
``proxy/replies.known_prompt``) is not encoded at all: the step extends its base, so the ids were compared.
A finished ``Trajectory`` refers to its logged steps (``step_refs``); ``resolve`` joins it with them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import msgspec

from steptap.middleware.records import Delta, LogRecord, Step, StepRef, Trajectory, msgpack_encoder

_enc = msgpack_encoder.encode
_replace = msgspec.structs.replace


class DeltaError(ValueError):
    """A delta step whose base is not there (a damaged or partial log): its full form cannot be rebuilt."""


Kept = tuple[list[Any], list[Any], int]
"""A list known to start with another's first items, msgpack byte for byte: (the list, the other, how many).
The TITO plan compared a turn's messages with the previous turn's so (``proxy/tito_plan.py``): the request's
delta does not encode both again."""


def compress(step: Step, base: Step, kept: Kept | None = None) -> Step:
    """The logged form of ``step`` (full), which extends ``base`` (full): a copy holding only what is new."""
    skip = len(base.prompt_token_ids) + len(base.response_token_ids)
    request, tails = _request_delta(step.request, base.request, step.prompt_token_ids, base.prompt_token_ids,
                                    kept=kept)
    return _replace(
        step,
        prompt_token_ids=step.prompt_token_ids[skip:],
        request=request,
        delta=Delta(base=base.index, keys=list(step.request), tails=tails),
    )


def compress_choice(step: Step, first: Step) -> Step:
    """The logged form of ``step`` (full), another choice of the call whose first choice is ``first`` (full):
    the request and prompt ids they share are stored once, in ``first``."""
    ids, shared = step.prompt_token_ids, first.prompt_token_ids
    keep = len(shared) if ids is shared or (len(ids) >= len(shared) and ids[: len(shared)] == shared) else 0
    request, tails = _request_delta(step.request, first.request)
    return _replace(
        step,
        prompt_token_ids=ids[keep:],
        request=request,
        delta=Delta(base=first.index, keys=list(step.request), tails=tails, kind="choice", shared=keep),
    )


PREFIX_MIN = 1024  # fewer shared prompt ids than this (or than half the step's own): the step is logged whole
_BLOCK = 4096
_BISECT_MAX = 4096  # the longest list whose shared start with the base's is bisected


def shared_prefix(a: list[Any], b: list[Any]) -> int:
    """How many first items two lists share (two prompts' ids, two conversations' messages): compared a
    block at a time (at C speed), then item by item."""
    n, i = min(len(a), len(b)), 0
    while i < n and a[i:i + _BLOCK] == b[i:i + _BLOCK]:
        i += _BLOCK
    end = min(i + _BLOCK, n)
    while i < end and a[i] == b[i]:
        i += 1
    return min(i, n)


def compress_prefix(step: Step, base: Step) -> Step | None:
    """The logged form of ``step`` (full), which does not extend ``base`` (full, the call before it) but
    starts with most of its prompt ids; None when it shares too few for a delta to be worth its reading."""
    ids = step.prompt_token_ids
    keep = shared_prefix(ids, base.prompt_token_ids)
    if keep < PREFIX_MIN or 2 * keep < len(ids):
        return None
    request, tails = _request_delta(step.request, base.request, ids, base.prompt_token_ids, keep)
    return _replace(step, prompt_token_ids=ids[keep:], request=request,
                    delta=Delta(base=base.index, keys=list(step.request), tails=tails, kind="prefix",
                                shared=keep))


def _request_delta(request: dict[str, Any], base: dict[str, Any], ids: Any = None, base_ids: Any = None,
                   shared: int | None = None, kept: Kept | None = None,
                   ) -> tuple[dict[str, Any], dict[str, int]]:
    """What of ``request`` differs from ``base``: its own values, and the lists that start with the base's
    items (``ids``, ``base_ids``: the steps' prompt ids, which a token-id prompt is; ``shared``: how many
    first ids they share, None when ``ids`` extends all of ``base_ids``; ``kept``: a list known to start with
    the base's)."""
    if request is base:  # the choices of one call share one request object
        return {}, {}
    out: dict[str, Any] = {}
    tails: dict[str, int] = {}
    for key, value in request.items():
        if key in base:
            old = base[key]
            if ids is not None and value is ids and old is base_ids and len(value) >= (shared or len(old)):
                # A token-id prompt, which the step's ids are (proxy/replies.known_prompt): the step extends
                # its base, so the list starts with the base's (``prefix.extends`` compared them), or shares
                # ``shared`` first ids with it (counted): no encode
                first = len(old) if shared is None else shared
                tails[key] = first
                out[key] = value[first:]
                continue
            if old is value or (
                type(old) is type(value) and _same_size(old, value) and _enc(old) == _enc(value)
            ):
                continue  # the base's value: not stored
            if isinstance(value, list) and isinstance(old, list) and (
                    n := kept[2] if kept is not None and kept[0] is value and kept[1] is old else
                    _kept(value, old)):
                tails[key] = n
                out[key] = value[n:]
                continue
        out[key] = value
    return out, tails


def _kept(value: list[Any], old: list[Any]) -> int:
    """How many of ``old``'s first items ``value`` starts with (msgpack bytes equal). A list that continues
    the base's costs one encode of each; one whose last item was edited (a moved cache mark) two; else, for
    a list of up to 4,096 items, the longest shared start is bisected (a few encodes of the lists' starts)."""
    n = min(len(value), len(old))

    def same(k: int) -> bool:
        return _enc(value[:k]) == _enc(old[:k])

    if n == 0 or same(n):
        return n
    if n == 1 or same(n - 1):
        return n - 1
    if n > _BISECT_MAX:  # not a conversation (a long id list): logged whole rather than bisected
        return 0
    lo, hi = 0, n - 1  # same(lo) holds, same(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if same(mid) else (lo, mid)
    return lo


def _same_size(a: Any, b: Any) -> bool:
    """False when two values of one type cannot encode alike (lists or dicts of other lengths): a long prompt
    that grew is not encoded twice to find it changed."""
    return len(a) == len(b) if isinstance(a, (list, dict, str)) else True


def expand(step: Step, base: Step) -> Step:
    """The full form of ``step`` (logged) given its base (full). Shares the ``rewards`` dict with ``step``
    (and a choice's prompt ids with its first choice's)."""
    d = step.delta
    if d is None:
        return step
    if base.index != d.base:
        raise DeltaError(f"step {step.index} extends step {d.base}, not step {base.index}")
    request: dict[str, Any] = {}
    for key in d.keys:
        if key in d.tails:
            old, kept = base.request.get(key), d.tails[key]
            if not isinstance(old, list) or len(old) < kept:
                raise DeltaError(f"step {step.index}: the base's {key!r} has fewer than the {kept} items it "
                                 "starts with")
            request[key] = old[:kept] + step.request[key]
        elif key in step.request:
            request[key] = step.request[key]
        elif key in base.request:
            request[key] = base.request[key]
        else:
            raise DeltaError(f"step {step.index}: request key {key!r} is in neither it nor its base")
    if d.kind in ("choice", "prefix"):
        if d.shared > len(base.prompt_token_ids):
            raise DeltaError(f"step {step.index} shares {d.shared} prompt ids of step {base.index}, which "
                             f"has {len(base.prompt_token_ids)}")
        if d.kind == "choice" and d.shared == len(base.prompt_token_ids) and not step.prompt_token_ids:
            ids = base.prompt_token_ids  # one list for the call's choices, as capture made them
        else:
            ids = base.prompt_token_ids[: d.shared] + step.prompt_token_ids
    else:
        ids = base.prompt_token_ids + base.response_token_ids + step.prompt_token_ids
    return _replace(step, prompt_token_ids=ids, request=request, delta=None)


def full_steps(steps: Iterable[Step]) -> list[Step]:
    """The full forms of one trajectory's steps (in index order, each base before the steps extending it)."""
    seen: dict[int, Step] = {}
    out: list[Step] = []
    for step in steps:
        if step.delta is not None:
            base = seen.get(step.delta.base)
            if base is None:
                raise DeltaError(f"step {step.index} extends step {step.delta.base}, which is not before it")
            step = expand(step, base)
        seen[step.index] = step
        out.append(step)
    return out


def full_trajectory(traj: Trajectory) -> Trajectory:
    """``traj`` with full steps (itself when none is a delta). ``DeltaError`` for a logged trajectory whose
    steps are only referred to (``resolve`` it with them)."""
    if traj.step_refs and not traj.steps:
        raise DeltaError(f"trajectory {traj.id!r} refers to {len(traj.step_refs)} logged steps: resolve it")
    if not any(s.delta is not None for s in traj.steps):
        return traj
    return _replace(traj, steps=full_steps(traj.steps))


def resolve(traj: Trajectory, logged: list[Step]) -> Trajectory:
    """A finished trajectory as readers hand it out: its referenced ``logged`` steps (in ``step_refs`` order)
    with the rewards the references carry, in full form, embedded."""
    if not traj.step_refs:
        return full_trajectory(traj)
    traj = embed(traj, logged)
    return _replace(traj, steps=full_steps(traj.steps))


def _finished_class(ref: StepRef) -> dict[str, str]:
    """The class a step finished with, when a later call reclassified it (``StepRef.call``); else nothing."""
    if ref.call is None:
        return {}
    if len(ref.call) != 2 or ref.call[0] not in ("main", "side", "branch"):
        raise DeltaError(f"a step reference's call class {ref.call!r} is not [class, rule]")
    return {"call_class": ref.call[0], "call_rule": ref.call[1]}


def embed(traj: Trajectory, logged: list[Step]) -> Trajectory:
    """Like ``resolve``, but the steps stay as logged (a delta step keeps its ``delta``): what a reader that
    expands steps one at a time takes (the learner's rows: ``Expander``), in memory linear in the session.
    Each delta's base is checked to come before it (``DeltaError``), so a damaged trajectory fails here."""
    if not traj.step_refs:
        return traj
    if len(logged) != len(traj.step_refs):
        raise DeltaError(f"trajectory {traj.id!r} refers to {len(traj.step_refs)} steps, {len(logged)} given")
    seen: set[int] = set()
    steps: list[Step] = []
    for s, ref in zip(logged, traj.step_refs, strict=True):
        if s.delta is not None and s.delta.base not in seen:
            raise DeltaError(f"step {s.index} extends step {s.delta.base}, which is not before it")
        seen.add(s.index)
        steps.append(_replace(s, rewards=dict(ref.rewards), **_finished_class(ref)))
    return _replace(traj, steps=steps, step_refs=[])


class LazySteps(Sequence[Step]):
    """A trajectory's steps as a read-only sequence of full steps, each built when it is read, from the steps
    as held (delta form) and the full ones at hand (``full``: index -> step, the latest call's). Reading one
    step costs its own context, not the whole session's; reading them in order costs each step's once (the
    last one built is kept for the next, which extends it). A built step shares its ``rewards`` dict with
    the held one. ``materialized`` counts the ids built so far."""

    def __init__(self, steps: list[Step], full: dict[int, Step] | None = None) -> None:
        self._steps = list(steps)  # a snapshot: a call finishing meanwhile does not shift it
        self._known = dict(full or {})
        self._pos = {s.index: i for i, s in enumerate(steps)}
        self._last: Step | None = None
        self.materialized = 0

    def __len__(self) -> int:
        return len(self._steps)

    @overload
    def __getitem__(self, i: int) -> Step: ...

    @overload
    def __getitem__(self, i: slice) -> list[Step]: ...

    def __getitem__(self, i: int | slice) -> Step | list[Step]:
        if isinstance(i, slice):
            return [self._full(k) for k in range(*i.indices(len(self._steps)))]
        if i < 0:
            i += len(self._steps)
        if not 0 <= i < len(self._steps):
            raise IndexError("step position out of range")
        return self._full(i)

    def __repr__(self) -> str:
        return f"LazySteps({len(self._steps)} steps)"

    def _have(self, index: int) -> Step | None:
        """The full form of step ``index`` when it is at hand (no building)."""
        held = self._steps[self._pos[index]]
        if held.delta is None:
            return held
        if self._last is not None and self._last.index == index:
            return self._last
        known = self._known.get(index)
        return None if known is None else _replace(known, rewards=held.rewards)

    def _full(self, pos: int) -> Step:
        held = self._steps[pos]
        got = self._have(held.index)
        if got is not None:
            return got
        chain = [held]  # back to a step at hand, then forward, one expansion each
        while True:
            d = chain[-1].delta
            assert d is not None
            if d.base not in self._pos:
                raise DeltaError(f"step {chain[-1].index} extends step {d.base}, not in the trajectory")
            base = self._have(d.base)
            if base is not None:
                break
            chain.append(self._steps[self._pos[d.base]])
        for step in reversed(chain):
            base = expand(step, base)
            self.materialized += len(base.prompt_token_ids)
        self._last = base
        return base


class Expander:
    """Full forms of the steps of a whole log read in order (``steps_of``), holding per open trajectory only
    the full steps of its main line's latest call (an ``extends`` delta's base is always one of them; side
    calls are never bases, sessions/classify.py) and its latest first choice (a ``choice`` delta's base: the
    choices of one call are appended together): memory stays linear."""

    def __init__(self) -> None:
        self._last: dict[str, dict[int, Step]] = {}  # trajectory id -> its latest call's ok steps, full
        self._first: dict[str, Step] = {}  # trajectory id -> its latest step of choice 0, full

    def full(self, step: Step) -> Step:
        last = self._last.get(step.trajectory_id, {})
        if step.delta is not None and step.delta.kind == "choice":
            first = self._first.get(step.trajectory_id)
            if first is None or first.index != step.delta.base:
                raise DeltaError(f"step {step.index} of {step.trajectory_id!r} is another choice of step "
                                 f"{step.delta.base}, which is not the call before it")
            step = expand(step, first)
        elif step.delta is not None:
            base = last.get(step.delta.base)
            if base is None:
                raise DeltaError(f"step {step.index} of {step.trajectory_id!r} extends step "
                                 f"{step.delta.base}, "
                                 "which is not in the previous call")
            step = expand(step, base)
        if step.choice == 0:
            self._first[step.trajectory_id] = step
        if step.status == "ok" and step.call_class != "side":  # a delta's base is on the main line
            if any(s.started_at != step.started_at for s in last.values()):
                last = {}
            last[step.index] = step
            self._last[step.trajectory_id] = last
        return step

    def last_call(self, trajectory_id: str) -> dict[int, Step]:
        """The full forms of the trajectory's latest call's ok steps (index -> step)."""
        return dict(self._last.get(trajectory_id, {}))

    def forget(self, trajectory_id: str) -> None:
        """The trajectory finished: its steps are never extended again."""
        self._last.pop(trajectory_id, None)
        self._first.pop(trajectory_id, None)


def steps_of(records: Iterable[LogRecord]) -> Iterator[Step]:
    """Every step a log holds, once, in full: its Step records and the steps of Trajectory records that are
    their only record (``steps_logged=False``)."""
    expander = Expander()
    for record in records:
        if isinstance(record, Step):
            yield expander.full(record)
        elif isinstance(record, Trajectory):
            if not record.steps_logged:
                yield from full_steps(record.steps)
            elif record.status != "running":
                expander.forget(record.id)
