"""What a dataset run's episodes came to: each ``Episode`` as it finished, and the ``Tally`` of counts by
policy version that a run reports (kept as episodes finish, so a long run holds counts, not every episode)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Episode:
    epoch: int
    row: int
    member: int
    group_id: str
    session_id: str = ""
    status: str = ""  # finished | aborted | "" (no session)
    reward: float | None = None  # the trajectory reward (sum of its parts)
    correct: bool | None = None
    steps: int = 0
    step_rewards: list[Any] = field(default_factory=list)
    policy_version: int | None = None  # the version of its last step (eval runs)
    info: dict[str, Any] = field(default_factory=dict)  # the flow's last info (answer, correct, turns, ...)
    error: str | None = None


class Tally:
    """Counts over a run's episodes, kept as they finish (so a long run holds counts, not every episode)."""

    MAX_ERRORS = 5

    def __init__(self) -> None:
        self.episodes = self.finished = self.aborted = self.failed_to_start = self.steps = 0
        self.reward_sum, self.rewarded = 0.0, 0
        self.errors: list[str] = []
        # policy version -> [episodes, correct, reward sum, rewarded, turns sum,
        #                    episodes whose info counts calls, ... with a call, ... with a well-formed one]
        self.versions: dict[int, list[float]] = defaultdict(lambda: [0, 0, 0.0, 0, 0, 0, 0, 0])
        self.lockstep_waits, self.lockstep_timeouts, self.lockstep_wait_s = 0, 0, 0.0

    def waited(self, seconds: float, timed_out: bool) -> None:
        """A lockstep batch's wait for its update (``RunConfig.lockstep``)."""
        self.lockstep_waits += 1
        self.lockstep_timeouts += timed_out
        self.lockstep_wait_s += seconds

    def add(self, ep: Episode) -> None:
        self.episodes += 1
        self.finished += ep.status == "finished"
        self.aborted += ep.status == "aborted"
        self.failed_to_start += not ep.status
        self.steps += ep.steps
        if ep.reward is not None:
            self.reward_sum, self.rewarded = self.reward_sum + ep.reward, self.rewarded + 1
        if ep.error and ep.error not in self.errors and len(self.errors) < self.MAX_ERRORS:
            self.errors.append(ep.error)
        if ep.status == "finished" and ep.policy_version is not None:
            v = self.versions[ep.policy_version]
            v[0] += 1
            v[1] += bool(ep.correct)
            if ep.reward is not None:
                v[2] += ep.reward
                v[3] += 1
            v[4] += int(ep.info.get("turns", ep.steps))
            if "calls" in ep.info:  # a ToolEnv's counts (AgentEnvLoop passes its last info on)
                v[5] += 1
                v[6] += int(ep.info["calls"]) > 0
                v[7] += int(ep.info.get("well_formed_calls", 0)) > 0

    def by_version(self) -> dict[int, dict[str, Any]]:
        """``{policy_version: {"episodes", "correct", "accuracy", "reward_mean", "turns_mean",
        "tool_call_rate", "well_formed_rate"}}`` over finished episodes. The two rates (the fraction of
        episodes with at least one tool call, and with at least one well-formed one) are ``None`` when the
        episodes' info did not count calls (not a ``ToolEnv``)."""
        return {
            version: {
                "episodes": int(n),
                "correct": int(correct),
                "accuracy": correct / n,
                "reward_mean": rsum / rn if rn else None,
                "turns_mean": turns / n,
                "tool_call_rate": called / counted if counted else None,
                "well_formed_rate": well / counted if counted else None,
            }
            for version, (n, correct, rsum, rn, turns, counted, called, well) in sorted(self.versions.items())
        }

    def summary(self) -> dict[str, Any]:
        return {
            "episodes": self.episodes,
            "finished": self.finished,
            "aborted": self.aborted,
            "failed_to_start": self.failed_to_start,
            "steps": self.steps,
            "reward_mean": self.reward_sum / self.rewarded if self.rewarded else None,
            "errors": self.errors,
            **({"lockstep_waits": self.lockstep_waits, "lockstep_timeouts": self.lockstep_timeouts,
                "lockstep_wait_s": round(self.lockstep_wait_s, 1)} if self.lockstep_waits else {}),
        }


def accuracy_by_version(episodes: list[Episode]) -> dict[int, dict[str, Any]]:
    tally = Tally()
    for ep in episodes:
        tally.add(ep)
    return tally.by_version()


__all__ = ["Episode", "Tally", "accuracy_by_version"]
