"""``steptap export``'s parquet format (the default): finished trajectories, one row per step.

Writes ``OUT/part-00000.parquet``, ``part-00001.parquet``, ... (a new file every ``--rows-per-file`` rows),
readable by ``pyarrow.parquet.read_table(OUT)`` and ``datasets.load_dataset("parquet", data_dir=OUT)``. Each
row holds the step's exact token ids and logprobs, its rewards, the policy version that sampled it (and where
a swap switched it: ``version_spans``), and its trajectory's id, group, mode, status, rewards, where each
reward came from (``reward_sources``: callback, http, human, default) and what made it, by name, when its
giver said (``reward_provenance``: a judge's model, prompt and rubric hashes), the ratings given after it was
streamed (``late_rewards``, from ``--log`` only: the stream carries no reward records) and metadata; nested
objects are JSON strings so every file has one fixed schema (``schema()``). Provenance: with ``--model-dir``
(the model the run started from), every row and ``OUT/_provenance.json`` name its weights, tokenizer and chat
template by hash (``model_files.provenance``; a leading ``_`` keeps it out of parquet readers). Curation
(middleware/curation.py) is applied as the learner applies it: the trajectories and steps the marks exclude
are left out (``--keep-excluded``: kept, ``curation_excluded`` set), ``curated_reward`` /
``curated_step_reward`` hold the edited rewards beside the recorded ones, ``curation_tags`` the tags. pyarrow
is imported lazily (``pip install 'steptap[env]'``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from steptap.adapters.export_files import TrajectoryFiles, late_rewards, private_temp
from steptap.middleware.curation import CurationState, edit_rewards
from steptap.middleware.delta import full_trajectory
from steptap.middleware.files import atomic_write, makedirs
from steptap.middleware.records import RewardAdded, Step, Trajectory


def _pa() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as exc:
        raise ImportError("steptap export needs pyarrow: pip install 'steptap[env]'") from exc
    return pyarrow


def schema() -> Any:
    pa = _pa()
    return pa.schema(
        [
            ("trajectory_id", pa.string()),
            ("group_id", pa.string()),
            ("group_size", pa.int64()),
            ("mode", pa.string()),
            ("trajectory_status", pa.string()),
            ("trajectory_reward", pa.float64()),
            ("trajectory_rewards", pa.string()),
            ("metadata", pa.string()),
            ("num_steps", pa.int64()),
            ("step_index", pa.int64()),
            ("choice", pa.int64()),
            ("policy_version", pa.int64()),
            ("model", pa.string()),
            ("served_model", pa.string()),
            ("endpoint", pa.string()),
            ("status", pa.string()),
            ("prefix", pa.string()),
            ("finish_reason", pa.string()),
            ("prompt_token_ids", pa.list_(pa.int32())),
            ("response_token_ids", pa.list_(pa.int32())),
            ("response_logprobs", pa.list_(pa.float64())),
            ("step_reward", pa.float64()),
            ("step_rewards", pa.string()),
            ("temperature", pa.float64()),
            ("top_p", pa.float64()),
            ("top_k", pa.int64()),
            ("max_tokens", pa.int64()),
            ("messages", pa.string()),
            ("response", pa.string()),
            ("started_at", pa.float64()),
            ("latency_s", pa.float64()),
            ("prompt_tokens", pa.int64()),
            ("completion_tokens", pa.int64()),
            ("version_spans", pa.string()),
            ("reward_sources", pa.string()),
            ("reward_provenance", pa.string()),
            ("late_rewards", pa.string()),
            ("model_hash", pa.string()),
            ("tokenizer_hash", pa.string()),
            ("chat_template_hash", pa.string()),
            ("curation_excluded", pa.bool_()),
            ("curation_tags", pa.list_(pa.string())),
            ("curation", pa.string()),
            ("curated_reward", pa.float64()),
            ("curated_step_reward", pa.float64()),
            ("images", pa.string()),
        ]
    )

PROVENANCE_KEYS = ("model_hash", "tokenizer_hash", "chat_template_hash")


def step_rows(traj: Trajectory, late: list[RewardAdded] | None = None,
              prov: dict[str, str | None] | None = None, curation: CurationState | None = None,
              keep_excluded: bool = False) -> Iterator[dict[str, Any]]:
    """One dict per step of ``traj`` (the columns of ``schema()``): ``late``, its late rewards; ``prov``,
    the model's hashes; ``curation``, its folded marks: the steps they exclude are left out (with
    ``keep_excluded``: kept, ``curation_excluded`` set), the ``curated_*`` rewards are the edited ones."""
    traj = full_trajectory(traj)  # a trajectory holding delta steps gets full rows
    state = curation or CurationState()
    edited = edit_rewards(traj, state)  # the same steps, in the same order
    common = {
        "trajectory_id": traj.id,
        "group_id": traj.group_id,
        "group_size": traj.group_size,
        "mode": traj.mode,
        "trajectory_status": traj.status,
        "trajectory_reward": traj.reward,
        "trajectory_rewards": json.dumps(traj.rewards),
        "metadata": json.dumps(traj.metadata, default=str),
        "num_steps": len(traj.steps),
        "reward_sources": json.dumps(traj.reward_sources),
        "reward_provenance": json.dumps(traj.reward_provenance),
        "late_rewards": json.dumps(late_rewards(late)),
        **{k: (prov or {}).get(k) for k in PROVENANCE_KEYS},
        "curation_tags": state.tags,
        "curation": json.dumps(msgspec.to_builtins(state)) if state.marks else None,
        "curated_reward": edited.reward,
    }
    for step, curated in zip(traj.steps, edited.steps, strict=True):
        excluded = state.excluded or step.index in state.excluded_steps
        if excluded and not keep_excluded:
            continue
        yield {**common, "curation_excluded": excluded,
               "curated_step_reward": float(sum(curated.rewards.values())), **_step_columns(step)}


def _step_columns(step: Step) -> dict[str, Any]:
    """A step's own columns (the trajectory's and curation's are the caller's)."""
    request = step.request or {}
    return {
        "step_index": step.index,
        "choice": step.choice,
        "policy_version": step.policy_version,
        "model": step.model,
        "served_model": step.served_model,
        "endpoint": step.endpoint,
        "status": step.status,
        "prefix": step.prefix,
        "finish_reason": step.finish_reason,
        "prompt_token_ids": step.prompt_token_ids,
        "response_token_ids": step.response_token_ids,
        "response_logprobs": step.response_logprobs,
        "step_reward": float(sum(step.rewards.values())),
        "step_rewards": json.dumps(step.rewards),
        "temperature": step.sampling.temperature,
        "top_p": step.sampling.top_p,
        "top_k": step.sampling.top_k,
        "max_tokens": step.sampling.max_tokens,
        "messages": json.dumps(request.get("messages", request.get("prompt")), default=str),
        "response": json.dumps(step.response, default=str),
        "started_at": step.started_at,
        "latency_s": step.latency_s,
        "prompt_tokens": step.usage.prompt_tokens,
        "completion_tokens": step.usage.completion_tokens,
        "version_spans": json.dumps(step.version_spans),
        # the images its prompt showed the model, in prompt order; the messages name each by its
        # reference (records.ref_of), the bytes are in --images-dir or the log's image store
        "images": json.dumps(msgspec.to_builtins(step.images)),
    }


class PartWriter(TrajectoryFiles):
    """Parquet parts under ``out``: row groups of ``batch_rows``, a new file every ``rows_per_file`` rows.
    Each part is written under a temporary name and renamed when complete."""

    def __init__(self, out: str | Path, *, rows_per_file: int = 100_000, batch_rows: int = 2_000,
                 **settings: Any) -> None:
        super().__init__(**settings)
        self.pa = _pa()
        # the provenance also in each file's key-value metadata (readers that drop columns keep it)
        self.schema = schema().with_metadata({"steptap.provenance": json.dumps(self.provenance)})
        self.out = makedirs(out)  # new directories 0700: the parts hold prompts and replies
        self.rows_per_file, self.batch_rows = max(1, rows_per_file), max(1, batch_rows)
        self.files: list[Path] = []
        self.rows = 0
        self.bad_rows = 0  # rows left out: a value no column holds
        self._buf: list[dict[str, Any]] = []
        self._writer: Any = None
        self._tmp: Path | None = None
        self._file: Any = None
        self._in_file = 0

    def add(self, traj: Trajectory) -> None:
        written, state = self.admit(traj)
        if not written:
            return
        for row in step_rows(traj, self.late.get(traj.id), self.provenance, state, self.keep_excluded):
            self._buf.append(row)
            if len(self._buf) >= self.batch_rows or self._in_file + len(self._buf) >= self.rows_per_file:
                self._flush()

    def _flush(self) -> None:
        if not self._buf:
            return
        if self._writer is None:
            final = self.out / f"part-{len(self.files):05d}.parquet"
            self._tmp, self._file = private_temp(final)
            self._writer = self.pa.parquet.ParquetWriter(self._file, self.schema)
            self.files.append(final)
        table = self._table(self._buf)
        self._writer.write_table(table)
        self._in_file += table.num_rows
        self.rows += table.num_rows
        self._buf = []
        if self._in_file >= self.rows_per_file:
            self._seal()

    def _table(self, rows: list[dict[str, Any]]) -> Any:
        """The rows as a table; a row no column can hold (an id past int32, a value past int64: what an agent
        sent, or a bad record) is left out and counted in ``bad_rows``, never fatal to the export."""
        bad = (self.pa.ArrowInvalid, self.pa.ArrowTypeError, OverflowError, TypeError, ValueError)
        try:
            return self.pa.Table.from_pylist(rows, schema=self.schema)
        except bad:
            kept = []
            for row in rows:  # only after a failure: find the bad rows one at a time
                try:
                    self.pa.Table.from_pylist([row], schema=self.schema)
                except bad:
                    self.bad_rows += 1
                    continue
                kept.append(row)
            return self.pa.Table.from_pylist(kept, schema=self.schema)

    def _seal(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._file.close()
            assert self._tmp is not None
            os.replace(self._tmp, self.files[-1])
            self._writer, self._tmp, self._in_file = None, None, 0

    def close(self) -> None:
        self._flush()
        self._seal()
        if self.provenance:
            atomic_write(self.out / "_provenance.json", json.dumps(self.provenance, indent=2).encode())
