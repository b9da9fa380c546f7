"""Bringing replicas back to the persisted policy version: the state restored from the log at start-up,
``reconcile`` (a replica paused or mislabelled by a proxy killed mid-swap), and undoing a failed swap
(rollback of a load, revert of a transfer that reached no disk, a transfer's failed receive).

A mixin of ``WeightSwapper`` (swapper.py), which holds the state these methods read."""

from __future__ import annotations

import asyncio
import logging
import re
from typing import TYPE_CHECKING, Any

from steptap.middleware.exceptions import DomainError, SwapError
from steptap.middleware.weights import transfer as collective
from steptap.middleware.weights.policy import LORA_PREFIX, HoldsPolicy, Policy
from steptap.middleware.weights.transfer import Transfer, TransferFailed

logger = logging.getLogger("steptap.weights")

if TYPE_CHECKING:
    from steptap.middleware.backend.client import BackendClient
    from steptap.middleware.records import PolicyVersion
    from steptap.middleware.weights.swapper import _Pool

__all__ = ["LORA_PREFIX", "Recovery"]  # LORA_PREFIX re-exported (its old path)


class Recovery(HoldsPolicy):
    """``WeightSwapper``'s way back to the persisted version."""

    backends: list[str]
    disk_wanted: str | None
    cpu_backend: bool | None
    degraded: str | None
    pool: _Pool | None
    _plan: tuple[dict[str, int], int]
    _lock: asyncio.Lock
    if TYPE_CHECKING:  # WeightSwapper's
        async def start(self) -> None: ...
        def _client(self, backend: str) -> BackendClient: ...
        def _targets(self) -> list[str]: ...
        async def _persist(self, new: Policy) -> None: ...

    def restore(self, record: PolicyVersion | None) -> int:
        """Take the state the log's latest ``PolicyVersion`` record holds
        (``TrajectoryLog.last_policy_version``, at start-up); return the version. A LoRA version's adapter is
        named after its version, so the name is the same after a restart."""
        self.policy = self.policy.restored(record)
        return self.version

    async def _receive_one(self, b: str, transfer: Transfer, version: int) -> None:
        """One replica's part of a collective transfer; one that failed midway reloads the disk weights."""
        offsets, world = self._plan
        try:
            await collective.receive(self._client(b), transfer, offsets[b], world, version)
        except TransferFailed as exc:
            if not exc.touched:
                raise
            err = await collective.reload_from_disk(self._client(b), self.path)
            if err is not None:
                self.degraded = err
                if self.pool is not None:
                    self.pool.take_out(b, err)
                raise TransferFailed(f"{exc.message}; {err}: restart it", True) from None
            await self._reset_caches(b)
            where = (f"version {self.version}'s weights" if self.on_disk
                     else "the last weights on disk, not the current version's")
            raise TransferFailed(f"{exc.message}; {b} reloaded {self.path} from disk ({where})",
                                 True) from None

    async def _revert(self, targets: list[str], results: list[Any], new_version: int,
                      failed: dict[str, str]) -> None:
        """Every replica failed a transfer and the current version exists on no disk: some replicas reloaded
        the last weights on disk, so all do, and those weights become ``new_version`` (never two sets of
        weights under one version). Always raises."""
        for b, r in zip(targets, results, strict=True):
            if not (isinstance(r, TransferFailed) and r.touched):
                err = await collective.reload_from_disk(self._client(b), self.path)
                if err is not None:
                    self.degraded = err
                    if self.pool is not None:
                        self.pool.take_out(b, err)
                    continue
                await self._reset_caches(b)
        new = self.policy.from_disk(new_version, self.path)
        await self._persist(new)
        self.policy = new
        for b in targets:
            await self._tell_version(b, new_version)
        raise collective.transfer_error(
            failed, f"The transferred version was on no disk: every replica now serves {self.path} (reloaded "
                    f"from disk) as version {new_version}; publish a newer version")

    async def _rollback(self, loaded: list[str], lora_name: str | None) -> None:
        """Undo a load whose swap failed later: unload the new adapter (routing never moved to it), or
        reload the weights the old version was serving; the label goes back to the old version."""
        for b in loaded:
            try:
                if lora_name is not None:
                    await self._client(b).unload_lora(lora_name)
                elif self.path is not None and self.on_disk:
                    await self._client(b).reload_weights(self.path)
                    await self._reset_caches(b)
                else:
                    self.degraded = f"{b} holds weights of a failed swap and the previous ones are unknown"
                await self._tell_version(b, self.version)
            except DomainError as exc:
                if lora_name is None:
                    self.degraded = f"{b} could not be rolled back after a failed swap: {exc.message}"
                    if self.pool is not None:
                        self.pool.take_out(b, self.degraded)
                logger.error("rollback on %s failed: %s", b, exc.message)

    async def _tell_version(self, backend: str, version: int) -> None:
        # vLLM's own label for its weights (its /weight_info and metrics): ``reconcile`` reads it back after a
        # restart to tell whether a replica serves the persisted version. Errors ignored (older servers).
        if not self._client(backend).caps.labels:
            return  # an older vLLM (no /update_weight_version): said at start-up
        try:
            await self._client(backend).set_label(str(version))
        except DomainError:
            pass

    async def reconcile(self, backend: str) -> None:
        """Bring one backend to the persisted policy version (at start-up, and before a replica is
        readmitted): a proxy killed mid-swap can leave it paused, or serving new weights under the old
        version. Reads ``/weight_info`` (the label every swap sets) and ``/is_paused``; reloads the version's
        weights when the label differs, loads its LoRA adapter when missing, resumes. Raises ``SwapError``."""
        await self.start()
        async with self._lock:  # never beside a swap
            label = await self._label(backend)
            paused = cut_short = await self._is_paused(backend)
            wrong = label is not None and label != str(self.version) and not (
                self.version == 0 and label == "default")
            if wrong:
                if self.path is None:
                    await self._inspect_backends()
                if self.path is None:
                    raise SwapError(f"{backend} serves weights labelled {label!r}, not version "
                                         f"{self.version}, and the version's weights are unknown",
                                    "version_mismatch")
                if not self.on_disk and [t for t in self._targets() if t != backend]:
                    self.disk_wanted = (f"{backend} lost version {self.version}, which came by transfer and "
                                        "is on no disk: it stays out until a version comes through disk")
                    raise SwapError(f"{backend} serves weights labelled {label!r}, not version "
                                         f"{self.version}, which came by collective transfer and is on no "
                                         "disk; it stays out until a version is published through disk",
                                    "version_mismatch")
                logger.warning("%s serves weights labelled %r, not version %d: reloading %s", backend, label,
                            self.version, self.path)
                client = self._client(backend)
                await client.pause("wait")
                paused = True
                await client.reload_weights(self.path)
                await self._reset_caches(backend)
                if not self.on_disk:  # the only replica: the disk weights become a version of their own
                    new = self.policy.from_disk(self.version + 1, self.path)
                    await self._persist(new)
                    self.policy = new
                    self.disk_wanted = (f"version {self.version - 1} came by transfer and is on no disk: "
                                        f"{backend} "
                                        f"serves {self.path}, older weights, as version {self.version}")
                    logger.warning("%s; publish a version through disk", self.disk_wanted)
                await self._tell_version(backend, self.version)
            if self.lora_name is not None and self.lora_path is not None:
                client = self._client(backend)
                if self.lora_name not in await client.model_ids():
                    await client.load_lora(self.lora_name, self.lora_path)
            if paused:  # cut short: a swap left it paused; else the reload above paused it
                if cut_short:
                    logger.warning("%s was paused (a swap cut short): resuming it", backend)
                await self._client(backend).resume()

    def _lacking(self, capability: str) -> list[str]:
        """The swap's replicas whose vLLM lacks ``capability`` (backend/capabilities.py)."""
        return [b for b in self._targets() if not getattr(self._client(b).caps, capability)]

    async def _label(self, backend: str) -> str | None:
        if not self._client(backend).caps.labels:
            return None  # an older vLLM (no /weight_info): nothing to compare
        try:
            return await self._client(backend).label()
        except DomainError as exc:
            if exc.code == "backend_unreachable":
                raise
            return None  # a server without the route: nothing to compare

    async def _is_paused(self, backend: str) -> bool:
        try:
            return await self._client(backend).is_paused()
        except DomainError as exc:
            if exc.code == "backend_unreachable":
                raise
            return False

    async def _reset_caches(self, backend: str, *, encoder: bool = True) -> None:
        """After a load: the prefix cache, and (``encoder``: full weights) the vision encoder's cached
        outputs, stale when the vision tower changed (a reload clears only the worker's half:
        docs/platform.md)."""
        # Nothing runs while paused, so the reset succeeds; it answers success=false while blocks are held.
        client = self._client(backend)
        for _ in range(20):
            if await client.reset_prefix_cache():
                break
            await asyncio.sleep(0.05)
        else:
            raise SwapError(f"{backend} did not reset its prefix cache", "prefix_cache_reset_failed")
        if encoder:
            await client.reset_encoder_cache()

    async def _inspect_backends(self) -> None:
        """Read the device and the served weights' path from vLLM's dev-mode ``/server_info`` (its config
        string holds ``model='DIR'`` and ``device_config=cpu``).
        Unknown device counts as CPU, the safe side."""
        cpu, path = False, None
        for b in self._targets() or self.backends:
            try:
                info = await self._client(b).server_info()
            except DomainError:
                cpu = True
                continue
            text = str(info.get("vllm_config", "")) if isinstance(info, dict) else ""
            dev = re.search(r"device_config=(\w+)", text)
            cpu = cpu or dev is None or dev.group(1) == "cpu"
            model = re.search(r"(?:^|, )model='([^']*)'", text)
            path = path or (model.group(1) if model else None)
        if self.cpu_backend is None:
            self.cpu_backend = cpu
        if self.path is None:
            self.policy = self.policy.with_path(path)
