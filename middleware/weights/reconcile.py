"""Bringing replicas back to the persisted policy version: ``reconcile`` (a replica paused or mislabelled by a
proxy killed mid-swap), and undoing a failed swap (rollback of a load, revert of a transfer that reached no
disk, a transfer's failed receive)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from steptap.middleware.exceptions import DomainError, SwapError
from steptap.middleware.weights import transfer as collective
from steptap.middleware.weights.policy import Policy, Served
from steptap.middleware.weights.replicas import Replicas
from steptap.middleware.weights.transfer import Transfer, TransferFailed

logger = logging.getLogger("steptap.weights")


class Reconciler:
    """Brings the ``replicas`` back to what ``served`` says they serve; a new state (a revert, a reconcile
    that made the disk weights a version) is persisted with ``persist`` before it goes live. Holds what it
    could not bring back: ``degraded`` (a replica that needs a restart) and ``disk_wanted``."""

    def __init__(self, served: Served, replicas: Replicas,
                 persist: Callable[[Policy], Awaitable[None]]) -> None:
        self.served = served
        self.replicas = replicas
        self.persist = persist
        self.degraded: str | None = None  # a backend failed mid-reload and needs a restart
        # Why a version through disk is wanted (``/health``, read by the learner before it publishes): a
        # replica lost a version that came by transfer and cannot get it back. Cleared by a swap from disk.
        self.disk_wanted: str | None = None

    def lost(self, backend: str, reason: str) -> None:
        """``backend`` may hold no usable weights: say so (``degraded``) and take it out of the pool."""
        self.degraded = reason
        self.replicas.take_out(backend, reason)

    async def receive_one(self, b: str, transfer: Transfer, version: int,
                          plan: tuple[dict[str, int], int]) -> None:
        """One replica's part of a collective transfer (``plan``: the replicas' rank offsets and the group's
        size); one that failed midway reloads the disk weights."""
        offsets, world = plan
        served = self.served
        try:
            await collective.receive(self.replicas.client(b), transfer, offsets[b], world, version)
        except TransferFailed as exc:
            if not exc.touched:
                raise
            err = await collective.reload_from_disk(self.replicas.client(b), served.path)
            if err is not None:
                self.lost(b, err)
                raise TransferFailed(f"{exc.message}; {err}: restart it", True) from None
            await self.replicas.reset_caches(b)
            where = (f"version {served.version}'s weights" if served.on_disk
                     else "the last weights on disk, not the current version's")
            raise TransferFailed(f"{exc.message}; {b} reloaded {served.path} from disk ({where})",
                                 True) from None

    async def revert(self, targets: list[str], results: list[Any], new_version: int,
                      failed: dict[str, str]) -> None:
        """Every replica failed a transfer and the current version exists on no disk: some replicas reloaded
        the last weights on disk, so all do, and those weights become ``new_version`` (never two sets of
        weights under one version). Always raises."""
        path = self.served.path
        for b, r in zip(targets, results, strict=True):
            if not (isinstance(r, TransferFailed) and r.touched):
                err = await collective.reload_from_disk(self.replicas.client(b), path)
                if err is not None:
                    self.lost(b, err)
                    continue
                await self.replicas.reset_caches(b)
        new = self.served.policy.from_disk(new_version, path)
        await self.persist(new)
        self.served.policy = new
        for b in targets:
            await self.replicas.tell_version(b, new_version)
        raise collective.transfer_error(
            failed, f"The transferred version was on no disk: every replica now serves {path} (reloaded "
                    f"from disk) as version {new_version}; publish a newer version")

    async def rollback(self, loaded: list[str], lora_name: str | None) -> None:
        """Undo a load whose swap failed later: unload the new adapter (routing never moved to it), or
        reload the weights the old version was serving; the label goes back to the old version."""
        served = self.served
        for b in loaded:
            try:
                if lora_name is not None:
                    await self.replicas.client(b).unload_lora(lora_name)
                elif served.path is not None and served.on_disk:
                    await self.replicas.client(b).reload_weights(served.path)
                    await self.replicas.reset_caches(b)
                else:
                    self.degraded = f"{b} holds weights of a failed swap and the previous ones are unknown"
                await self.replicas.tell_version(b, served.version)
            except DomainError as exc:
                if lora_name is None:
                    self.lost(b, f"{b} could not be rolled back after a failed swap: {exc.message}")
                logger.error("rollback on %s failed: %s", b, exc.message)

    async def reconcile(self, backend: str) -> None:
        """Bring one backend to the persisted policy version (at start-up, and before a replica is
        readmitted; the caller keeps swaps out meanwhile): a proxy killed mid-swap can leave it paused, or
        serving new weights under the old version. Reads ``/weight_info`` (the label every swap sets) and
        ``/is_paused``; reloads the version's weights when the label differs, loads its LoRA adapter when
        missing, resumes. Raises ``SwapError``."""
        served = self.served
        label = await self.replicas.label(backend)
        paused = cut_short = await self.replicas.is_paused(backend)
        if label is not None and label != str(served.version) and not (served.version == 0
                                                                       and label == "default"):
            await self._reload_mislabelled(backend, label)
            paused = True  # the reload paused it
        if served.lora_name is not None and served.lora_path is not None:
            client = self.replicas.client(backend)
            if served.lora_name not in await client.model_ids():
                await client.load_lora(served.lora_name, served.lora_path)
        if paused:  # cut short: a swap left it paused; else the reload above paused it
            if cut_short:
                logger.warning("%s was paused (a swap cut short): resuming it", backend)
            await self.replicas.client(backend).resume()

    async def _reload_mislabelled(self, backend: str, label: str) -> None:
        """``backend`` serves weights labelled ``label``, not the current version: pause it and reload the
        version's weights (it stays paused for the caller to resume)."""
        served = self.served
        if served.path is None:
            await self.replicas.inspect(served)
        if served.path is None:
            raise SwapError(f"{backend} serves weights labelled {label!r}, not version {served.version}, and "
                            "the version's weights are unknown", "version_mismatch")
        if not served.on_disk and [t for t in self.replicas.targets() if t != backend]:
            self.disk_wanted = (f"{backend} lost version {served.version}, which came by transfer and is on "
                                "no disk: it stays out until a version comes through disk")
            raise SwapError(f"{backend} serves weights labelled {label!r}, not version {served.version}, "
                            "which came by collective transfer and is on no disk; it stays out until a "
                            "version is published through disk", "version_mismatch")
        logger.warning("%s serves weights labelled %r, not version %d: reloading %s", backend, label,
                       served.version, served.path)
        client = self.replicas.client(backend)
        await client.pause("wait")
        await client.reload_weights(served.path)
        await self.replicas.reset_caches(backend)
        if not served.on_disk:  # the only replica: the disk weights become a version of their own
            new = served.policy.from_disk(served.version + 1, served.path)
            await self.persist(new)
            served.policy = new
            self.disk_wanted = (f"version {served.version - 1} came by transfer and is on no disk: {backend} "
                                f"serves {served.path}, older weights, as version {served.version}")
            logger.warning("%s; publish a version through disk", self.disk_wanted)
        await self.replicas.tell_version(backend, served.version)
