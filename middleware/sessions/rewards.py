"""``--reward module:function``: a callback called with each finished ``Trajectory``.

Its ``steps`` are full steps, built as they are read (``delta.LazySteps``, a read-only sequence), not all at
once: a long session's steps share their context, and building every step's full prompt would cost the
session's turns x its context. Read ``traj.steps[-1]`` or iterate: each step read costs its own context.
``list(traj.steps)`` builds them all (``msgspec.structs.replace(traj, steps=list(traj.steps))`` gives a
trajectory msgspec can encode).

It may be sync (run in a thread, off the event loop) or async, and returns a float (the trajectory's reward,
kept under the name ``callback``), per-step rewards (a list aligned with the steps, or a dict step index ->
float), or None. It may also write rewards of its own names into the view (``traj.rewards``,
``traj.steps[i].rewards``: shared with the trajectory) and what made them into ``traj.reward_provenance``
(a judge does: adapters/judge.py). An exception, a timeout or a bad return value is recorded in
``trajectory.error``; the trajectory is delivered either way, as finished, except after
``exceptions.RewardUnavailable`` (no reward could be made at all): then it ends ``records.INFRA_FAILURE``.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import msgspec

from steptap.middleware.delta import LazySteps
from steptap.middleware.exceptions import RewardUnavailable
from steptap.middleware.records import Step, Trajectory

CALLBACK_NAME = "callback"

RewardFn = Callable[[Trajectory], Any]


class RewardError(NamedTuple):
    """Why a callback gave no (usable) reward."""

    message: str
    unavailable: bool = False  # it raised RewardUnavailable: an infrastructure failure, not a reward


def load_reward(spec: str) -> RewardFn:
    """``"package.module:function"`` -> the function (ValueError with a clear message when it is not one)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--reward expects module:function, got {spec!r}")
    obj: object = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"--reward {spec!r} is not callable")
    return obj


def finite(value: Any) -> float:
    """A reward value as float; ValueError unless a finite real number (bools are not rewards)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"reward must be a finite number, got {type(value).__name__}")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"reward must be a finite number, got {out}")
    return out


def reward_view(trajectory: Trajectory, full: dict[int, Step] | None = None) -> Trajectory:
    """What the callback is handed: ``trajectory`` (steps as held, delta form) with its steps built on read
    (``full``: the full steps at hand, index -> step). It shares its rewards dicts with ``trajectory``."""
    steps = cast(list[Step], LazySteps(trajectory.steps, full))  # a Sequence in the list's place
    return msgspec.structs.replace(trajectory, steps=steps)


async def run_reward(fn: RewardFn, trajectory: Trajectory, timeout_s: float,
                     full: dict[int, Step] | None = None) -> RewardError | None:
    """Call ``fn`` with ``reward_view(trajectory, full)`` and apply what it returns to ``trajectory`` in
    place. Returns why it failed, or None."""
    view = reward_view(trajectory, full)
    try:
        if inspect.iscoroutinefunction(fn):
            result = await asyncio.wait_for(fn(view), timeout_s)
        else:
            result = await asyncio.wait_for(asyncio.to_thread(fn, view), timeout_s)
            if inspect.isawaitable(result):
                result = await asyncio.wait_for(result, timeout_s)
    except TimeoutError:
        return RewardError(f"reward callback timed out after {timeout_s:g}s")
    except RewardUnavailable as exc:
        return RewardError(f"no reward: {exc}", unavailable=True)
    except Exception as exc:  # noqa: BLE001 - any failure of user code is recorded, never fatal
        return RewardError(f"reward callback raised {type(exc).__name__}: {exc}")
    try:
        apply_result(trajectory, result)
    except (ValueError, TypeError, IndexError) as exc:
        return RewardError(f"reward callback returned an unusable value: {exc}")
    return None


def apply_result(trajectory: Trajectory, result: Any) -> None:
    if result is None:
        return
    if isinstance(result, dict):
        per_step = {int(k): finite(v) for k, v in result.items()}
        for index in per_step:
            if not 0 <= index < len(trajectory.steps):
                raise IndexError(f"no step {index} (trajectory has {len(trajectory.steps)})")
        for index, value in per_step.items():
            trajectory.steps[index].rewards[CALLBACK_NAME] = value
    elif isinstance(result, (list, tuple)):
        values = [finite(v) for v in result]
        if len(values) != len(trajectory.steps):
            raise ValueError(f"{len(values)} per-step rewards for {len(trajectory.steps)} steps")
        for step, value in zip(trajectory.steps, values, strict=True):
            step.rewards[CALLBACK_NAME] = value
    else:
        trajectory.rewards[CALLBACK_NAME] = finite(result)
