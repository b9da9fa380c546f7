"""``steptap export --format rollout-detail``: finished trajectories as Harbor reads its own (issue 38).

Harbor (the task harness of Terminal-Bench 2.0) keeps an agent's token-level data in
``harbor.models.agent.rollout_detail.RolloutDetail``: per turn, the full prompt ids (history included), the
completion ids, their logprobs, and ``extra`` (per-turn provider data, one list per field), several of them
for a history that is not one line; the first one is the main agent's. A trial result holds them under
``agent_result.rollout_details`` (``AgentContext``) and its rewards under ``verifier_result.rewards``.

Each line of ``OUT/rollout_details.jsonl`` is one trajectory in those shapes (field names and nesting as
Harbor 0.25 has them; Harbor is not imported: it needs Python >= 3.12)::

    {"trajectory_id", "group_id", "group_size", "mode", "status",
     "agent_result": {"n_input_tokens", "n_cache_tokens", "n_output_tokens", "cost_usd", "model_usage",
                      "rollout_details": [{"prompt_token_ids": [[...], ...], "completion_token_ids": [...],
                                           "logprobs": [...], "extra": {"step_index": [...], ...}}, ...],
                      "metadata": {"steptap": {...}}},
     "verifier_result": {"rewards": {...}}}

The segments (``rollout_details``): each branch of the main line in order (a compaction starts the next,
``Step.branch``), the first being the main agent's, then each side call (``call_class == "side"``: a title, a
small model's call) and each other choice of an n > 1 call as a segment of one turn, in step order. A failed
step (no completion) is not a turn: it is counted in ``metadata.steptap.failed_steps``. Curation is applied as
the parquet export applies it (excluded trajectories and steps left out unless kept; ``verifier_result``
holds the edited rewards, ``metadata.steptap`` the recorded ones). A logprob vLLM gave as NaN or an infinity
is written as JSON's ``NaN``/``Infinity`` (Python's and pydantic's readers take them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from steptap.adapters.export_files import TrajectoryFiles, late_rewards, private_temp
from steptap.middleware.curation import CurationState, edit_rewards
from steptap.middleware.delta import full_trajectory
from steptap.middleware.files import makedirs
from steptap.middleware.records import RewardAdded, Step, Trajectory

FILE_NAME = "rollout_details.jsonl"


def segments(steps: Iterable[Step]) -> list[list[Step]]:
    """The turns of each RolloutDetail, in order: the main line's branches, then a segment of one turn for
    each side call and each other choice of a call (step order). Failed steps are left out."""
    branches: dict[int, list[Step]] = {}
    singles: list[Step] = []
    for step in sorted(steps, key=lambda s: (s.index, s.choice)):
        if step.status != "ok":
            continue
        if step.call_class == "side" or step.choice:
            singles.append(step)
        else:
            branches.setdefault(step.branch, []).append(step)
    return [branches[b] for b in sorted(branches)] + [[s] for s in singles]


def rollout_detail(turns: list[Step]) -> dict[str, Any]:
    """One RolloutDetail: the turns' ids and logprobs, and ``extra``: steptap's per-turn data, one list per
    field aligned with the turns (``images``, each turn's image digests in prompt order, only when a turn
    showed any)."""
    extra: dict[str, list[Any]] = {
        "step_index": [s.index for s in turns],
        "choice": [s.choice for s in turns],
        "policy_version": [s.policy_version for s in turns],
        "version_spans": [s.version_spans for s in turns],
        "finish_reason": [s.finish_reason for s in turns],
        "call_class": [s.call_class for s in turns],
        "rewards": [s.rewards for s in turns],
    }
    if any(s.images for s in turns):
        extra["images"] = [[i.sha256 for i in s.images] for s in turns]
    return {
        "prompt_token_ids": [list(s.prompt_token_ids) for s in turns],
        "completion_token_ids": [list(s.response_token_ids) for s in turns],
        "logprobs": [list(s.response_logprobs) for s in turns],
        "extra": extra,
    }


def _model_usage(turns: list[Step]) -> dict[str, dict[str, Any]]:
    usage: dict[str, dict[str, Any]] = {}
    for s in turns:
        u = usage.setdefault(s.served_model or s.model, {"n_input_tokens": 0, "n_cache_tokens": 0,
                                                         "n_output_tokens": 0, "cost_usd": None})
        u["n_input_tokens"] += s.usage.prompt_tokens
        u["n_output_tokens"] += s.usage.completion_tokens
    return usage


def trial_record(traj: Trajectory, late: list[RewardAdded] | None = None,
                 prov: dict[str, str | None] | None = None, curation: CurationState | None = None,
                 keep_excluded: bool = False) -> dict[str, Any]:
    """``traj`` as one line of the export: its steps as RolloutDetails in an ``AgentContext``-shaped
    ``agent_result``, its (curated) rewards in a ``VerifierResult``-shaped ``verifier_result``."""
    traj = full_trajectory(traj)
    state = curation or CurationState()
    edited = edit_rewards(traj, state)  # the same steps, in the same order
    kept = [e for s, e in zip(traj.steps, edited.steps, strict=True)
            if keep_excluded or s.index not in state.excluded_steps]
    parts = segments(kept)
    turns = [s for part in parts for s in part]
    steptap = {
        "metadata": traj.metadata,
        "reward": traj.reward,  # as recorded; verifier_result holds the curated ones
        "rewards": traj.rewards,
        "reward_sources": traj.reward_sources,
        "reward_provenance": traj.reward_provenance,
        "late_rewards": late_rewards(late),
        "curation": msgspec.to_builtins(state) if state.marks else None,
        "failed_steps": sum(s.status != "ok" for s in kept),
        "provenance": prov or {},
    }
    return {
        "trajectory_id": traj.id,
        "group_id": traj.group_id,
        "group_size": traj.group_size,
        "mode": traj.mode,
        "status": traj.status,
        "agent_result": {
            "n_input_tokens": sum(s.usage.prompt_tokens for s in turns),
            "n_cache_tokens": None,  # vLLM's usage as recorded does not say
            "n_output_tokens": sum(s.usage.completion_tokens for s in turns),
            "cost_usd": None,
            "model_usage": _model_usage(turns),
            "rollout_details": [rollout_detail(part) for part in parts],
            "metadata": {"steptap": steptap},
        },
        "verifier_result": {"rewards": edited.rewards or None},
    }


class RolloutWriter(TrajectoryFiles):
    """``OUT/rollout_details.jsonl``, one trajectory a line (``trial_record``), written under a temporary name
    and renamed when complete; the same settings and counters as ``export_parquet.PartWriter``."""

    def __init__(self, out: str | Path, **settings: Any) -> None:
        super().__init__(**settings)
        self.out = makedirs(out)  # new directories 0700: the lines hold prompts' ids
        self.files = [self.out / FILE_NAME]
        self.rows = 0  # turns written
        self.bad_rows = 0  # every step fits JSON: kept for the summary's shape
        self.failed_steps = 0  # no completion: not a turn
        self._tmp, self._file = private_temp(self.files[0])

    def add(self, traj: Trajectory) -> None:
        written, state = self.admit(traj)
        if not written:
            return
        record = trial_record(traj, self.late.get(traj.id), self.provenance, state, self.keep_excluded)
        details = record["agent_result"]["rollout_details"]
        self.rows += sum(len(d["completion_token_ids"]) for d in details)
        self.failed_steps += record["agent_result"]["metadata"]["steptap"]["failed_steps"]
        self._file.write(json.dumps(record, default=str).encode() + b"\n")

    def close(self) -> None:
        self._file.close()
        os.replace(self._tmp, self.files[0])
