"""LoRA adapters in keep mode: a new adapter loaded beside the old one (no pause), the old one unloaded when
the last call on it ends, and the routed adapter restored after a restart.

``Adapters`` is a mixin of ``WeightSwapper`` (swapper.py), which holds the state these methods read."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from steptap.middleware.exceptions import DomainError, SwapUnavailable
from steptap.middleware.weights.policy import HoldsPolicy, Policy

if TYPE_CHECKING:
    from steptap.middleware.backend.client import BackendClient
    from steptap.middleware.weights.swapper import _Pool

logger = logging.getLogger("steptap.weights")


def _message(exc: BaseException) -> str:
    return exc.message if isinstance(exc, DomainError) else f"{type(exc).__name__}: {exc}"


def _code(results: list[Any]) -> str:
    return next((r.code for r in results if isinstance(r, DomainError)), "backend_error")


class Adapters(HoldsPolicy):
    """``WeightSwapper``'s LoRA adapters side by side."""

    pool: _Pool | None
    replica_figures: dict[str, dict[str, Any]]
    last_paused_s: float | None
    last_swap_s: float | None
    _adapter_users: dict[str, int]
    _retiring: dict[str, list[str]]
    _background: set[asyncio.Task[Any]]
    _started: bool
    if TYPE_CHECKING:  # WeightSwapper's and Recovery's
        def _client(self, backend: str) -> BackendClient: ...
        def _targets(self) -> list[str]: ...
        def _swapped(self, t0: float, stall_s: float) -> None: ...
        async def _settle(self, new: Policy, lora_name: str | None, loaded: list[str], touched: list[str],
                          failed: dict[str, str], results: list[Any]) -> None: ...
        async def _tell_version(self, backend: str, version: int) -> None: ...

    async def ensure_adapter(self) -> None:
        """After a restart in LoRA mode: load the routed adapter into backends that lack it (best effort)."""
        if self.lora_name is None or self.lora_path is None:
            return
        for b in self._targets():
            client = self._client(b)
            try:
                if self.lora_name in await client.model_ids():
                    continue
                await client.load_lora(self.lora_name, self.lora_path)
            except DomainError as exc:
                logger.warning("could not restore LoRA adapter %s on %s: %s", self.lora_name, b, exc.message)

    async def _swap_lora_beside(self, lora_path: str, lora_name: str, new_version: int) -> int:
        """keep mode's LoRA swap: load the new adapter beside the old one (no pause, the gate stays open),
        then route new calls to it; calls in flight finish on the old one, unloaded when the last of them
        ends."""
        t0 = time.monotonic()
        targets = self._targets()
        if not targets:
            raise SwapUnavailable("no healthy backend replica to swap", "no_backend")
        results = await asyncio.gather(*(self._client(b).load_lora(lora_name, lora_path) for b in targets),
                                       return_exceptions=True)
        loaded = [b for b, r in zip(targets, results, strict=True) if not isinstance(r, BaseException)]
        failed = {b: _message(r) for b, r in zip(targets, results, strict=True)
                  if isinstance(r, BaseException)}
        figures: dict[str, dict[str, Any]] = {b: {"ok": b in loaded, "error": failed.get(b), "paused_s": 0.0}
                                              for b in targets}
        self.replica_figures = figures
        new = self.policy.adapter(new_version, lora_path)
        await self._settle(new, lora_name, loaded, loaded, failed, results)
        old = self.lora_name
        # New calls route here
        self.policy = new
        if old is not None and old != lora_name:
            await self._retire(old, loaded)
        for b in loaded:
            await self._tell_version(b, new_version)
        self.last_paused_s = 0.0
        self._swapped(t0, 0.0)
        for fig in figures.values():
            fig["swap_s"] = self.last_swap_s
        logger.info("policy version %d live (LoRA %s from %s, beside the old adapter) in %.3f s",
                    self.version,
                    lora_name, lora_path, self.last_swap_s)
        return self.version

    async def _retire(self, adapter: str, backends: list[str]) -> None:
        """Unload ``adapter`` now when no call in flight holds it, else when the last one ends."""
        if self._adapter_users.get(adapter):
            self._retiring[adapter] = backends
        else:
            await self._unload(adapter, backends)

    def _release_adapter(self, adapter: str) -> None:
        left = self._adapter_users.get(adapter, 0) - 1
        if left > 0:
            self._adapter_users[adapter] = left
            return
        self._adapter_users.pop(adapter, None)
        backends = self._retiring.pop(adapter, None)
        if backends is not None and self._started:  # not after close()
            task = asyncio.ensure_future(self._unload(adapter, backends))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _unload(self, name: str, backends: list[str]) -> None:
        for b in backends:
            try:
                await self._client(b).unload_lora(name)
            except DomainError as exc:  # harmless: vLLM evicts unused adapters anyway
                logger.warning("could not unload LoRA adapter %s on %s: %s", name, b, exc.message)
