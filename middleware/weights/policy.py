"""The latest policy version and the weights it names: one answer, held by the weight swapper (``Served``,
``WeightSwapper.policy``), read by everyone else (the gate, ``/health``, ``/metrics``, reconcile).

Each transition (a full-weights swap from disk, a collective transfer, a LoRA adapter) makes a new ``Policy``;
the swapper persists its ``record()`` in the trajectory log before it goes live. The record is the whole
state, so the latest record alone restores it (``restored``): the log carries exactly that one forward when
compaction deletes older segments, and a restart reads exactly that one
(``TrajectoryLog.last_policy_version``). The log keeps the record; it does not interpret it.
"""

from __future__ import annotations

import msgspec

from steptap.middleware.records import PolicyVersion

LORA_PREFIX = "steptap-lora"


def lora_name_of(version: int) -> str:
    """The adapter name vLLM serves a LoRA version under: named after the version, so a restart finds it."""
    return f"{LORA_PREFIX}-v{version}"


class Policy(msgspec.Struct, frozen=True, kw_only=True):
    """The policy version served and the weights behind it; immutable: a transition is a new one."""

    version: int = 0
    # The base weights on disk: the last full weights loaded from a directory (the served model's at first)
    path: str | None = None
    # Whether the base weights served now are those at ``path``: not after a collective transfer (there is no
    # copy on disk), so a replica that loses them cannot get them back (``transfer.py``).
    on_disk: bool = True
    lora_path: str | None = None  # the adapter calls are routed to, if any

    @property
    def lora_name(self) -> str | None:
        return lora_name_of(self.version) if self.lora_path is not None else None

    def from_disk(self, version: int, path: str | None) -> Policy:
        """Full weights loaded from ``path`` (a swap, a revert or a reconcile: the disk weights as a
        version)."""
        return Policy(version=version, path=path, on_disk=True)

    def transferred(self, version: int) -> Policy:
        """Full weights broadcast by the learner: on no disk; ``path`` stays the last weights that are."""
        return Policy(version=version, path=self.path, on_disk=False)

    def adapter(self, version: int, lora_path: str) -> Policy:
        """A LoRA adapter on the same base weights."""
        return msgspec.structs.replace(self, version=version, lora_path=lora_path)

    def with_path(self, path: str | None) -> Policy:
        """The served weights' directory, learned from the servers when it was not configured."""
        return msgspec.structs.replace(self, path=path)

    def record(self) -> PolicyVersion:
        """What the log keeps: the whole state, so the latest record alone restores it."""
        return PolicyVersion(version=self.version, path=self.path, lora_path=self.lora_path,
                             on_disk=self.on_disk)

    def restored(self, record: PolicyVersion | None) -> Policy:
        """The state ``record`` (the latest in the log) describes, over this one (the configured weights).

        Records written before they held the whole state: a LoRA version's had no ``path`` (the base weights
        stay this one's), a collective transfer's had neither path (nothing on disk)."""
        if record is None:
            return self
        path, on_disk = self.path, self.on_disk
        if record.path is not None:
            path, on_disk = record.path, record.on_disk
        elif record.lora_path is None:
            on_disk = False
        return Policy(version=record.version, path=path, on_disk=on_disk, lora_path=record.lora_path)


class Served:
    """What the replicas serve now: the ``policy`` (only a new ``Policy`` changes it) and whether they run on
    CPU (None: not asked yet). One is held by the swapper and handed to each of its parts."""

    def __init__(self, policy: Policy, cpu_backend: bool | None = None) -> None:
        self.policy = policy
        self.cpu_backend = cpu_backend

    @property
    def version(self) -> int:
        return self.policy.version

    @property
    def path(self) -> str | None:
        return self.policy.path

    @property
    def on_disk(self) -> bool:
        return self.policy.on_disk

    @property
    def lora_path(self) -> str | None:
        return self.policy.lora_path

    @property
    def lora_name(self) -> str | None:
        return self.policy.lora_name
