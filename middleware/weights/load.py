"""Loading new weights on the replicas for a swap (``swapper.py`` decides when): every replica paused in
parallel, loaded (from disk, a LoRA adapter, or a collective transfer), labelled and its caches reset; the
outcome settled over the replicas (persisted, or rolled back); the new policy made live; every paused replica
resumed whatever happened.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from steptap.middleware.backend.client import PauseMode
from steptap.middleware.exceptions import DomainError, SwapError
from steptap.middleware.weights import transfer as collective
from steptap.middleware.weights.gate import Gate
from steptap.middleware.weights.lora import Adapters, Loaded, code_of, message_of
from steptap.middleware.weights.policy import Policy, Served
from steptap.middleware.weights.reconcile import Reconciler
from steptap.middleware.weights.replicas import Replicas
from steptap.middleware.weights.transfer import Transfer, TransferFailed

logger = logging.getLogger("steptap.weights")


class Loader:
    """Loads a new version onto the ``replicas`` and makes it what ``served`` serves; ``persist`` makes the
    new state durable first."""

    def __init__(self, served: Served, replicas: Replicas, gate: Gate, adapters: Adapters,
                 reconciler: Reconciler, persist: Callable[[Policy], Awaitable[None]]) -> None:
        self.served = served
        self.replicas = replicas
        self.gate = gate
        self.adapters = adapters
        self.reconciler = reconciler
        self.persist = persist
        self.paused_s = 0.0  # how long the last load kept the replicas paused

    async def paused(self, targets: list[str], path: str | None, lora_path: str | None,
                     lora_name: str | None, new_version: int, transfer: Transfer | None,
                     figures: dict[str, dict[str, Any]], *, keep: bool) -> list[str]:
        """Every replica in parallel: pause, load, label, reset its prefix cache; then the new version is
        persisted and goes live, or the load is undone. Every paused replica is resumed whatever happened;
        returns the errors of those that did not resume. Each replica's outcome goes into ``figures``, how
        long they were paused into ``paused_s``. ``keep``: vLLM freezes the calls in flight
        (``pause?mode=keep``) and the gate marks where their tokens switch; else they were drained before."""
        figures.update({b: {"ok": False, "error": None} for b in targets})
        plan = await collective.plan([self.replicas.client(b) for b in targets]) if transfer else ({}, 0)
        paused_at: dict[str, float] = {}
        touched: list[str] = []  # replicas whose load went through (a later step may still have failed)
        pause: PauseMode = "keep" if keep else "wait"
        t_pause = time.monotonic()
        try:
            results = await asyncio.gather(
                *(self._swap_one(b, path, lora_path, lora_name, new_version, paused_at, touched, pause,
                                 transfer, plan) for b in targets), return_exceptions=True)
            loaded = [b for b, r in zip(targets, results, strict=True) if r is None]
            failed = {b: message_of(r) for b, r in zip(targets, results, strict=True) if r is not None}
            for b, msg in failed.items():
                figures[b]["error"] = msg
            if failed and transfer is not None and not loaded and not self.served.on_disk and any(
                    isinstance(r, TransferFailed) and r.touched for r in results):
                await self.reconciler.revert(targets, results, new_version, failed)  # raises
            policy = self.served.policy
            if path is not None:
                new = policy.from_disk(new_version, path)
            elif transfer is not None:
                new = policy.transferred(new_version)
            else:
                new = policy.adapter(new_version, lora_path)  # type: ignore[arg-type]  # exactly one
            await self.settle(new, lora_name, Loaded(loaded, touched, failed, results))
            for b in loaded:
                figures[b]["ok"] = True
            await self._go_live(new, loaded, from_disk=path is not None, keep=keep)
        finally:
            resume_errors = await self.replicas.resume_all(paused_at, figures)
            self.paused_s = time.monotonic() - t_pause
        return resume_errors

    async def _go_live(self, new: Policy, loaded: list[str], *, from_disk: bool, keep: bool) -> None:
        """The new weights are loaded and persisted: new calls get ``new``, the old adapter goes."""
        old_lora = self.served.lora_name
        if keep:  # before /resume: the tokens relayed so far are every one the old weights sampled
            self.gate.mark(new.version)
        self.served.policy = new
        if from_disk:
            self.reconciler.disk_wanted = None
        if old_lora is not None and old_lora != self.served.lora_name:
            if keep:  # frozen calls still run on it after /resume
                await self.adapters.retire(old_lora, loaded)
            else:
                await self.replicas.unload(old_lora, loaded)

    async def _swap_one(self, b: str, path: str | None, lora_path: str | None, lora_name: str | None,
                        version: int, paused_at: dict[str, float], touched: list[str], pause_mode: PauseMode,
                        transfer: Transfer | None, plan: tuple[dict[str, int], int]) -> None:
        # vLLM's default mode (abort) fails calls. keep: vLLM's default clear_cache makes the frozen calls
        # recompute their cache on the new weights after /resume (docs/platform.md)
        await self.replicas.client(b).pause(pause_mode)
        paused_at[b] = time.monotonic()
        if transfer is not None:
            await self.reconciler.receive_one(b, transfer, version, plan)
        else:
            await self._load_one(b, path, lora_path, lora_name)
        touched.append(b)
        await self.replicas.tell_version(b, version)
        # a LoRA leaves the vision tower as it is
        await self.replicas.reset_caches(b, encoder=lora_path is None)

    async def _load_one(self, b: str, path: str | None, lora_path: str | None, lora_name: str | None) -> None:
        client = self.replicas.client(b)
        if lora_path is not None:
            await client.load_lora(lora_name, lora_path)  # type: ignore[arg-type]  # set together in _swap
            return
        try:
            await client.reload_weights(path)  # type: ignore[arg-type]  # no lora_path or transfer: path
        except DomainError as exc:
            # vllm 0.32 moves the parameters aside before it reads the files: a reload that fails midway
            # leaves the engine without usable weights (its next forward pass kills it), and a second
            # reload crashes it too. Nothing to restore here: say so (check_weights_dir makes it rare).
            # A swap that fails everywhere keeps the replica in (as with one server: the old version stays);
            # one that fails here but loads elsewhere takes it out (``_settle``).
            self.reconciler.degraded = (f"{b} failed a weight reload and may hold no usable weights; restart "
                                        f"it ({exc.message})")
            raise SwapError(f"{exc.message}. {b} may now be unusable: restart it", exc.code) from None

    async def settle(self, new: Policy, lora_name: str | None, outcome: Loaded) -> None:
        """A load's outcome over the replicas (both swaps): nowhere (or, with no pool to take a replica out,
        not everywhere) to serve the new weights rolls back every replica it touched and the old version
        keeps its number; else ``new`` is persisted and each failed replica taken out (the caller then makes
        ``new`` the policy)."""
        if outcome.failed and (not outcome.loaded or self.replicas.pool is None):
            await self.reconciler.rollback(outcome.touched, lora_name)
            raise SwapError("; ".join(outcome.failed.values()), code_of(outcome.results))
        try:
            await self.persist(new)
        except SwapError:
            await self.reconciler.rollback(outcome.loaded, lora_name)
            raise
        for b, msg in outcome.failed.items():  # it never serves the old weights under the new version
            self.replicas.take_out(b, f"failed the swap to version {new.version} (reloaded before it "
                                      f"returns): {msg}")
