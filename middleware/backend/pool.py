"""Many vLLM replicas behind one proxy: routing, health, and admission.

A session sticks to one replica (vLLM's prefix cache holds its history there); a new session goes to the
healthy replica with the fewest calls in flight. A replica that refuses connections or fails its health check
is taken
*out*: new calls avoid it, its sessions move on their next call (counted as a prefix-cache miss, not an
error). An out replica comes back only through ``admit``: healthy again *and* reconciled with the proxy's
policy version by the weight swapper (resumed, and reloaded if it serves other weights), so it never serves
old weights under the new version.

Routes without a session use the pool's ``route``, ``models`` and ``health``; model calls take a replica per
session with ``pick`` and count it in flight with ``acquire`` / ``release``. A replica is named by its
configured URL (``BackendUrl.name``: ``unix:PATH`` stays ``unix:PATH``) in messages, records and metrics.
Replicas come from ``--backend`` (repeated) and ``--backends-file`` (one URL a line, ``#`` comments), re-read
when the file changes or on SIGHUP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Iterator
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from steptap.middleware import metrics as names
from steptap.middleware.backend.client import BackendClient
from steptap.middleware.backend.url import name_of
from steptap.middleware.config import ProxyConfig
from steptap.middleware.exceptions import BackendError, BackendUnavailable, BackendUnreachable, DomainError

logger = logging.getLogger("steptap.replicas")

MAX_STICKY = 200_000  # session -> replica entries kept (least recently used dropped: that session just moves)
_FAILED_CHECKS = 2  # consecutive failed health checks that take a replica out
Admit = Callable[[str], Awaitable[None]]  # brings a replica to the current policy version, or raises


class Replica:
    """One vLLM server: its client, whether it takes calls, and its load."""

    def __init__(self, client: BackendClient) -> None:
        self.client = client
        self.name = client.name  # the replica's identity: its URL as configured (http:// or unix:)
        self.up = False  # takes new calls (admitted and healthy)
        self.reason: str | None = "not admitted yet"  # why it is out
        self.out_since: float | None = time.time()
        self.in_flight = 0
        self.calls = 0
        self.failures = 0  # times taken out
        self.removed = False  # dropped from the backends file: finishes its calls, takes no new ones
        self.unreachable = False  # out because nothing answers there (not for a failed swap or a 503)
        self.failed_checks = 0  # consecutive failed health checks (a loaded server can miss one)
        self.failed_calls = 0  # consecutive model calls answered 5xx
        self.cooldown_until = 0.0  # taken out for failed calls: not readmitted before this (time.time())

    def state(self) -> dict[str, Any]:
        return {"url": self.name, "healthy": self.up, "state": "up" if self.up else "out",
                "reason": self.reason, "error": self.reason, "out_since": self.out_since,
                "in_flight": self.in_flight,
                "calls": self.calls, "taken_out": self.failures, "models": self.client.served}


def read_backends_file(path: str) -> list[str]:
    """The URLs in a backends file: one a line, blank lines and ``#`` comments ignored."""
    urls = []
    for line in Path(path).read_text().splitlines():
        url = line.split("#", 1)[0].strip()
        if url:
            urls.append(url)
    return urls


class ReplicaPool:
    """Every replica, the session -> replica map, and the health loop."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.replicas: dict[str, Replica] = {}
        self._sticky: OrderedDict[str, str] = OrderedDict()  # session id -> replica name
        self.moves = 0  # sessions moved to another replica (their prefix cache is lost: a miss)
        self._admit: Admit | None = None
        self._file_mtime: float | None = None
        self._wake = asyncio.Event()
        self._checking: set[str] = set()

    # --- membership ---------------------------------------------------------------------------------------

    def configured(self) -> list[str]:
        urls = ([self.config.backend] if self.config.backend else []) + list(self.config.backends)
        if self.config.backends_file:
            try:
                self._file_mtime = os.stat(self.config.backends_file).st_mtime
                urls += read_backends_file(self.config.backends_file)
            except OSError as exc:
                logger.error("cannot read --backends-file %s: %s", self.config.backends_file, exc)
                urls += [r.name for r in self.replicas.values() if not r.removed]  # keep what we have
        return list(dict.fromkeys(name_of(u) for u in urls))

    async def sync(self) -> None:
        """Add replicas newly configured (out until admitted) and retire those no longer listed."""
        wanted = self.configured()
        for name in wanted:
            rep = self.replicas.get(name)
            if rep is not None and rep.removed:  # listed again before it was dropped: admitted again
                rep.removed, rep.reason = False, "not admitted yet"
            if name not in self.replicas:
                client = BackendClient(name, self.config)
                await client.start()
                self.replicas[name] = Replica(client)
                logger.info("replica %s added (admitted once healthy and on the current weights)", name)
        for name, rep in list(self.replicas.items()):
            if name not in wanted and not rep.removed:
                rep.removed, rep.up, rep.reason = True, False, "removed from the backends"
                logger.info("replica %s removed", name)
            if rep.removed and rep.in_flight == 0:
                await rep.client.close()
                del self.replicas[name]

    async def start(self) -> None:
        await self.sync()
        if not self.replicas:
            raise ValueError("no backend: give --backend URL (repeatable) or --backends-file FILE")

    async def close(self) -> None:
        for rep in self.replicas.values():
            await rep.client.close()

    def reload(self) -> None:
        """SIGHUP: re-read the backends file now."""
        self._file_mtime = None
        self._wake.set()

    # --- routing --------------------------------------------------------------------------------------------

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.up]

    def pick(self, session_id: str | None = None, avoid: str | None = None) -> Replica:
        """The session's replica while it is up; else (a new session, or its replica is out) the healthy one
        with the fewest calls in flight."""
        if session_id is not None:
            name = self._sticky.get(session_id)
            rep = self.replicas.get(name) if name else None
            if rep is not None and rep.up and name != avoid:
                self._sticky.move_to_end(session_id)
                return rep
        rep = None  # the least loaded healthy one (the first of equals), in one pass: every call picks twice
        for r in self.replicas.values():
            if r.up and r.name != avoid and (
                    rep is None or (r.in_flight, r.calls) < (rep.in_flight, rep.calls)):
                rep = r
        if rep is None:
            reps = list(self.replicas.values())
            states = "; ".join(f"{r.name}: {r.reason}" for r in reps) or "none configured"
            if reps and all(r.unreachable for r in reps):
                raise BackendUnreachable(f"no backend replica can be reached ({states})")
            raise BackendUnavailable(f"no healthy backend replica ({states})")
        if session_id is not None:
            if session_id in self._sticky:
                self.moves += 1  # it had a replica: its prefix cache stays behind
            self._sticky[session_id] = rep.name
            self._sticky.move_to_end(session_id)
            while len(self._sticky) > MAX_STICKY:
                self._sticky.popitem(last=False)
        return rep

    def tito_problem(self) -> str | None:
        """Why a token-in-token-out session cannot run here (a replica taking calls lacks vLLM's scale-out
        routes in the wire format the proxy speaks), or None."""
        for rep in self.healthy():
            caps = rep.client.caps
            if not caps.tito:
                version = f"vLLM {caps.version}" if caps.version else "its vLLM"
                return (f"token-in-token-out needs vLLM's render, generate and derender routes, with token "
                        f"ids in generate's logprobs (vLLM 0.32 has them); backend {rep.name} ({version}) "
                        f"cannot: {caps.why.get('tito', 'missing')}")
        return None

    def client(self, name: str) -> BackendClient | None:
        """The replica's client (the weight swapper's admin calls go through it too)."""
        rep = self.replicas.get(name)
        return rep.client if rep is not None else None

    def swap_targets(self) -> list[str]:
        """The replicas a weight swap must reach: those taking calls (an out one is reconciled on return)."""
        return [r.name for r in self.healthy()]

    @staticmethod
    def acquire(rep: Replica) -> Replica:
        """Count a call in flight on ``rep`` (the load new sessions are placed by); ``release`` when done."""
        rep.in_flight += 1
        rep.calls += 1
        return rep

    @staticmethod
    def release(rep: Replica) -> None:
        rep.in_flight -= 1

    def call_done(self, rep: Replica, status: int) -> None:
        """Count a model call's HTTP status: ``replica_max_failures`` 5xx in a row take the replica out for
        ``replica_failure_cooldown_s`` (a replica failing every call is the least loaded one)."""
        if status < 500:
            rep.failed_calls = 0
            return
        rep.failed_calls += 1
        if rep.failed_calls >= self.config.replica_max_failures and rep.up:
            rep.cooldown_until = time.time() + self.config.replica_failure_cooldown_s
            self.take_out(rep.name, f"{rep.failed_calls} calls in a row answered {status} (5xx); readmitted "
                          f"after {self.config.replica_failure_cooldown_s:g}s if healthy")
            rep.failed_calls = 0

    def take_out(self, name: str, reason: str, *, unreachable: bool = False) -> None:
        """Stop routing to a replica; the health loop readmits it once healthy and reconciled."""
        rep = self.replicas.get(name)
        if rep is None or not rep.up:
            return
        rep.up, rep.reason, rep.out_since, rep.unreachable = False, reason, time.time(), unreachable
        rep.failures += 1
        logger.error("replica %s taken out: %s", name, reason)
        self._wake.set()

    # --- health and admission -------------------------------------------------------------------------------

    async def admit(self, rep: Replica) -> bool:
        """Check an out replica and, if healthy, reconcile it and put it back."""
        if rep.name in self._checking or rep.removed or time.time() < rep.cooldown_until:
            return False
        self._checking.add(rep.name)
        try:
            state = await rep.client.health()
            if not state["healthy"]:
                rep.reason = f"health check failed: {state.get('error', 'not healthy')}"
                rep.unreachable = not str(state.get("error", "")).startswith("HTTP ")
                return False
            caps = await rep.client.read_capabilities()  # once: its start-up line says what it lacks
            if not caps.token_ids:
                raise BackendError(caps.summary(rep.name))
            if self._admit is not None:
                await self._admit(rep.name)  # raises if it cannot serve the current version
            with contextlib.suppress(DomainError):
                await rep.client.refresh_models()
            rep.up, rep.reason, rep.out_since, rep.unreachable = True, None, None, False
            logger.info("replica %s admitted", rep.name)
            return True
        except Exception as exc:  # noqa: BLE001 - any failure keeps it out, with the reason shown
            rep.reason = f"not admitted: {getattr(exc, 'message', None) or exc!r}"
            rep.unreachable = getattr(exc, "code", None) == "backend_unreachable"
            return False
        finally:
            self._checking.discard(rep.name)

    async def admit_all(self, admit: Admit | None) -> None:
        self._admit = admit
        await asyncio.gather(*(self.admit(r) for r in list(self.replicas.values()) if not r.up))

    async def check(self) -> None:
        """One round: re-read the backends file if it changed, health-check every replica."""
        path = self.config.backends_file
        if path:
            with contextlib.suppress(OSError):
                if os.stat(path).st_mtime != self._file_mtime:
                    await self.sync()
        reps = list(self.replicas.values())
        states = await asyncio.gather(*(r.client.health() for r in reps if r.up))
        for rep, state in zip([r for r in reps if r.up], states, strict=True):
            rep.failed_checks = 0 if state["healthy"] else rep.failed_checks + 1
            if rep.failed_checks >= _FAILED_CHECKS:  # a refused connection in a call takes it out at once
                error = str(state.get("error", "not healthy"))
                self.take_out(rep.name, f"health check failed: {error}",
                              unreachable=not error.startswith("HTTP "))
        await asyncio.gather(*(self.admit(r) for r in reps if not r.up and not r.removed))
        for name, rep in list(self.replicas.items()):
            if rep.removed and rep.in_flight == 0:
                await rep.client.close()
                del self.replicas[name]

    async def health_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.health_interval_s)
            self._wake.clear()
            try:
                await self.check()
            except Exception:  # noqa: BLE001 - the loop must outlive one bad round
                logger.exception("replica health round failed")

    # --- for routes without a session -----------------------------------------------------------------------

    async def ready(self) -> None:
        """With no replica up, try to admit the out ones now rather than at the next health round, so a call
        that arrives just after a backend came up is served (and one that cannot be gets that backend's own
        error at once)."""
        if not self.healthy():
            await asyncio.gather(*(self.admit(r) for r in list(self.replicas.values()) if not r.removed))

    async def route(self, model: str | None, aliases: Collection[str] = ()) -> str:
        await self.ready()
        return await self.pick().client.route(model, aliases)

    async def models(self) -> tuple[int, bytes]:
        await self.ready()
        return await self.pick().client.models()

    async def health(self) -> dict[str, Any]:
        """``/health``'s backend part: healthy when at least one replica takes calls."""
        states = [r.state() for r in self.replicas.values()]
        return {"healthy": any(s["healthy"] for s in states), "replicas": states,
                "sessions_moved": self.moves}


class ReplicaCollector:
    """Prometheus view of the pool, read at scrape time."""

    def __init__(self, pool: ReplicaPool) -> None:
        self.pool = pool

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        up = GaugeMetricFamily(names.REPLICA_UP, "1 when the replica takes new calls", labels=["replica"])
        load = GaugeMetricFamily(names.REPLICA_IN_FLIGHT, "model calls in flight", labels=["replica"])
        calls = CounterMetricFamily(names.REPLICA_CALLS, "model calls sent", labels=["replica"])
        outs = CounterMetricFamily(names.REPLICA_TAKEN_OUT, "times taken out", labels=["replica"])
        for rep in self.pool.replicas.values():
            up.add_metric([rep.name], 1.0 if rep.up else 0.0)
            load.add_metric([rep.name], rep.in_flight)
            calls.add_metric([rep.name], rep.calls)
            outs.add_metric([rep.name], rep.failures)
        yield from (up, load, calls, outs)
        yield CounterMetricFamily(names.SESSIONS_MOVED, "sessions moved to another replica (prefix-cache "
                                  "misses)", value=self.pool.moves)


POOL_KEY = web.AppKey("steptap_replica_pool", ReplicaPool)
