"""The replicas a swap goes to, and what a swap does to one replica besides loading: its client (the pool's,
or one of the swapper's own), the targets of a swap, taking out one that failed, its prefix and encoder caches
reset, its version label, whether it is paused, resuming them all, and reading what it serves.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Sequence
from typing import Any, Protocol

from steptap.middleware.backend.client import ADMIN_TIMEOUT_S, BackendClient
from steptap.middleware.backend.url import name_of
from steptap.middleware.config import ProxyConfig
from steptap.middleware.exceptions import DomainError, SwapError
from steptap.middleware.weights.policy import Served

logger = logging.getLogger("steptap.weights")


class Pool(Protocol):
    """The replicas (backend/pool.py): which to swap, and taking out one that failed."""

    def swap_targets(self) -> list[str]: ...

    def take_out(self, name: str, reason: str) -> None: ...

    def client(self, name: str) -> BackendClient | None: ...


class Replicas:
    """The configured ``backends`` (vLLM base URLs) and, once the app sets it, the ``pool`` that says which
    of them are healthy. ``api_key``: the backends' key (vLLM ``--api-key``), sent on every call."""

    def __init__(self, backends: Sequence[str] | str, *, api_key: str | None = None,
                 request_timeout_s: float = ADMIN_TIMEOUT_S) -> None:
        self.backends = [name_of(b) for b in ([backends] if isinstance(backends, str) else backends)]
        self.api_key = api_key
        self.request_timeout_s = request_timeout_s
        self.pool: Pool | None = None  # set by the app: swaps go to its healthy replicas
        self._own: dict[str, BackendClient] = {}  # clients of backends outside a pool (a swapper on its own)

    def client(self, backend: str) -> BackendClient:
        """The replica's client: the pool's, or (a swapper on its own, a replica already dropped) one of
        ours."""
        if self.pool is not None:
            client = self.pool.client(backend)
            if client is not None:
                return client
        if backend not in self._own:
            self._own[backend] = BackendClient(backend, ProxyConfig(backend_api_key=self.api_key),
                                               admin_timeout_s=self.request_timeout_s)
        return self._own[backend]

    def targets(self) -> list[str]:
        """The replicas a swap goes to: the pool's healthy ones, else every configured one."""
        return self.pool.swap_targets() if self.pool is not None else list(self.backends)

    def take_out(self, backend: str, reason: str) -> bool:
        """Take a failed replica out of the pool; False when there is no pool to take it out of."""
        if self.pool is None:
            return False
        self.pool.take_out(backend, reason)
        return True

    async def close(self) -> None:
        for client in self._own.values():
            await client.close()
        self._own.clear()

    # ---- one replica ---------------------------------------------------------------------------------------

    def lacking(self, capability: str) -> list[str]:
        """The swap's replicas whose vLLM lacks ``capability`` (backend/capabilities.py)."""
        return [b for b in self.targets() if not getattr(self.client(b).caps, capability)]

    async def tell_version(self, backend: str, version: int) -> None:
        # vLLM's own label for its weights (its /weight_info and metrics): ``reconcile`` reads it back after a
        # restart to tell whether a replica serves the persisted version. Errors ignored (older servers).
        if not self.client(backend).caps.labels:
            return  # an older vLLM (no /update_weight_version): said at start-up
        try:
            await self.client(backend).set_label(str(version))
        except DomainError:
            pass

    async def label(self, backend: str) -> str | None:
        if not self.client(backend).caps.labels:
            return None  # an older vLLM (no /weight_info): nothing to compare
        try:
            return await self.client(backend).label()
        except DomainError as exc:
            if exc.code == "backend_unreachable":
                raise
            return None  # a server without the route: nothing to compare

    async def is_paused(self, backend: str) -> bool:
        try:
            return await self.client(backend).is_paused()
        except DomainError as exc:
            if exc.code == "backend_unreachable":
                raise
            return False

    async def reset_caches(self, backend: str, *, encoder: bool = True) -> None:
        """After a load: the prefix cache, and (``encoder``: full weights) the vision encoder's cached
        outputs, stale when the vision tower changed (a reload clears only the worker's half:
        docs/platform.md)."""
        # Nothing runs while paused, so the reset succeeds; it answers success=false while blocks are held.
        client = self.client(backend)
        for _ in range(20):
            if await client.reset_prefix_cache():
                break
            await asyncio.sleep(0.05)
        else:
            raise SwapError(f"{backend} did not reset its prefix cache", "prefix_cache_reset_failed")
        if encoder:
            await client.reset_encoder_cache()

    async def unload(self, name: str, backends: list[str]) -> None:
        """Unload LoRA adapter ``name`` from ``backends`` (best effort)."""
        for b in backends:
            try:
                await self.client(b).unload_lora(name)
            except DomainError as exc:  # harmless: vLLM evicts unused adapters anyway
                logger.warning("could not unload LoRA adapter %s on %s: %s", name, b, exc.message)

    # ---- all of them ---------------------------------------------------------------------------------------

    async def resume_all(self, paused_at: dict[str, float], figures: dict[str, dict[str, Any]]) -> list[str]:
        """``/resume`` every replica paused at ``paused_at`` (its paused time goes into its ``figures``);
        returns the errors. One that stays paused is taken out."""
        backends = list(paused_at)

        async def one(b: str) -> str | None:
            try:
                await self.client(b).resume()
                return None
            except DomainError as exc:
                return exc.message
            finally:
                figures.setdefault(b, {})["paused_s"] = time.monotonic() - paused_at[b]

        errors = []
        for b, err in zip(backends, await asyncio.gather(*(one(b) for b in backends)), strict=True):
            if err is not None:
                errors.append(err)
                figures[b]["error"] = err
                logger.error("resume failed on %s: %s", b, err)
                self.take_out(b, f"/resume failed after a swap: {err}")
        return errors

    async def inspect(self, served: Served) -> None:
        """Fill in what ``served`` does not know yet, the device and the served weights' path, from vLLM's
        dev-mode ``/server_info`` (its config string holds ``model='DIR'`` and ``device_config=cpu``).
        Unknown device counts as CPU, the safe side."""
        cpu, path = False, None
        for b in self.targets() or self.backends:
            try:
                info = await self.client(b).server_info()
            except DomainError:
                cpu = True
                continue
            text = str(info.get("vllm_config", "")) if isinstance(info, dict) else ""
            dev = re.search(r"device_config=(\w+)", text)
            cpu = cpu or dev is None or dev.group(1) == "cpu"
            model = re.search(r"(?:^|, )model='([^']*)'", text)
            path = path or (model.group(1) if model else None)
        if served.cpu_backend is None:
            served.cpu_backend = cpu
        if served.path is None:
            served.policy = served.policy.with_path(path)
