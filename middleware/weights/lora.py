"""LoRA adapters in keep mode: a new adapter loaded beside the old one (no pause), the old one unloaded when
the last call on it ends, and the routed adapter restored after a restart."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, NamedTuple

from steptap.middleware.exceptions import DomainError
from steptap.middleware.weights.policy import Served
from steptap.middleware.weights.replicas import Replicas

logger = logging.getLogger("steptap.weights")


def message_of(exc: BaseException) -> str:
    return exc.message if isinstance(exc, DomainError) else f"{type(exc).__name__}: {exc}"


def code_of(results: list[Any]) -> str:
    return next((r.code for r in results if isinstance(r, DomainError)), "backend_error")


class Adapters:
    """The LoRA adapters on the ``replicas``: the one ``served`` routes to, new ones loaded beside it, old
    ones retired until no call holds them any more (the gate says which call holds which)."""

    def __init__(self, served: Served, replicas: Replicas) -> None:
        self.served = served
        self.replicas = replicas
        self._users: dict[str, int] = {}  # calls in flight per adapter
        self._retiring: dict[str, list[str]] = {}  # old adapters to unload (on these replicas) once unused
        self._background: set[asyncio.Task[Any]] = set()
        self.running = False  # unloads start only while the swapper runs (not after close())

    async def ensure_adapter(self) -> None:
        """After a restart in LoRA mode: load the routed adapter into backends that lack it (best effort)."""
        name, path = self.served.lora_name, self.served.lora_path
        if name is None or path is None:
            return
        for b in self.replicas.targets():
            client = self.replicas.client(b)
            try:
                if name in await client.model_ids():
                    continue
                await client.load_lora(name, path)
            except DomainError as exc:
                logger.warning("could not restore LoRA adapter %s on %s: %s", name, b, exc.message)

    async def load_beside(self, targets: list[str], lora_name: str, lora_path: str) -> Loaded:
        """keep mode's LoRA swap: load the new adapter beside the old one on every target (no pause, the gate
        stays open); the caller settles the outcome, then routes new calls to it and ``retire``s the old
        one."""
        results = await asyncio.gather(*(self.replicas.client(b).load_lora(lora_name, lora_path)
                                         for b in targets), return_exceptions=True)
        loaded = [b for b, r in zip(targets, results, strict=True) if not isinstance(r, BaseException)]
        failed = {b: message_of(r) for b, r in zip(targets, results, strict=True)
                  if isinstance(r, BaseException)}
        return Loaded(loaded, loaded, failed, list(results))

    async def retire(self, adapter: str, backends: list[str]) -> None:
        """Unload ``adapter`` now when no call in flight holds it, else when the last one ends."""
        if self._users.get(adapter):
            self._retiring[adapter] = backends
        else:
            await self.replicas.unload(adapter, backends)

    def hold(self, adapter: str) -> None:
        """A call through the gate routes to ``adapter``."""
        self._users[adapter] = self._users.get(adapter, 0) + 1

    def release(self, adapter: str) -> None:
        """A call on ``adapter`` ended; after the last one, a retired adapter is unloaded."""
        left = self._users.get(adapter, 0) - 1
        if left > 0:
            self._users[adapter] = left
            return
        self._users.pop(adapter, None)
        backends = self._retiring.pop(adapter, None)
        if backends is not None and self.running:
            task = asyncio.ensure_future(self.replicas.unload(adapter, backends))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def unloaded(self) -> None:
        """Until the unloads started so far have ended."""
        await asyncio.gather(*list(self._background))


class Loaded(NamedTuple):
    """A load's outcome over the replicas: where it went through, which of them it changed (``touched``: a
    later step may still have failed there), why it failed elsewhere, and each replica's result."""

    loaded: list[str]
    touched: list[str]
    failed: dict[str, str]
    results: list[Any]
