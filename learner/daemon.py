"""``steptap learn``: train the policy on the proxy's trajectory stream and hot-swap the weights into vLLM.

    steptap learn --config examples/learner.toml [--lr 1e-5 --max-updates 100 ...]

``main`` does setup, ``train()``, cleanup, each once. ``train()`` is the whole loop: take ``batch_groups``
complete groups from the stream, build rows, one engine step, log, publish every ``push_every`` updates,
checkpoint (and only then acknowledge the stream) every ``checkpoint_every`` updates.

Acknowledgement. Groups finish out of stream order, so the learner keeps a ledger of delivered cursors: it
acknowledges the longest prefix of the stream whose trajectories were all trained on or deliberately dropped,
and stores in the checkpoint the ids it has already consumed beyond that prefix. ``--resume`` restores the
weights, optimizer, version and update count, reopens the stream at the checkpoint's cursor and skips those
ids: nothing acknowledged or already trained is trained again; a crash between checkpoints re-delivers (and
re-trains) what came after the last checkpoint, never loses it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import Counter, OrderedDict

import aiohttp
import torch

from steptap.learner import checkpoint
from steptap.learner.config import LearnerConfig, config_from_argv
from steptap.learner.engines.base import make_engine
from steptap.learner.metrics_log import MetricsLog, update_row
from steptap.learner.rows import build_batch
from steptap.middleware.client import Delivery, SteptapClient, SteptapError, SyncSteptapClient
from steptap.middleware.records import Trajectory

log = logging.getLogger("steptap.learner")


class Ledger:
    """Delivered cursors in stream order; which are consumed; the acknowledgeable prefix."""

    def __init__(self) -> None:
        self._pending: OrderedDict[str, list] = OrderedDict()  # tid -> [cursor, consumed]
        self.acked: str | None = None

    def deliver(self, d: Delivery) -> None:
        self._pending[d.trajectory.id] = [d.cursor, False]

    def consume(self, tids: list[str]) -> None:
        for tid in tids:
            if tid in self._pending:
                self._pending[tid][1] = True

    def frontier(self) -> tuple[str | None, list[str]]:
        """(the cursor up to which everything is consumed, ids consumed beyond it); drops the prefix."""
        while self._pending and next(iter(self._pending.values()))[1]:
            _, (cursor, _) = self._pending.popitem(last=False)
            self.acked = cursor
        return self.acked, [tid for tid, (_, done) in self._pending.items() if done]


class Grouper:
    """Collects a group's members (``group_id``) until ``group_size`` have arrived, in any final status
    (an aborted member counts toward its group, it does not discard it), or until the group has waited
    ``timeout_s``."""

    def __init__(self, cfg: LearnerConfig) -> None:
        self.cfg = cfg
        self.open: dict[str, tuple[float, list[Trajectory]]] = {}
        self.ready: list[list[Trajectory]] = []
        self.counts: Counter = Counter()

    def add(self, traj: Trajectory) -> None:
        key = traj.group_id or f"_single:{traj.id}"
        _, members = self.open.setdefault(key, (time.monotonic(), []))
        members.append(traj)
        if traj.group_id is None or len(members) >= (traj.group_size or self.cfg.group_size):
            self.ready.append(self.open.pop(key)[1])

    def take(self, n: int) -> tuple[list[list[Trajectory]], list[Trajectory]]:
        """Up to ``n`` ready groups, and the members of timed-out groups too small to train on."""
        now, small = time.monotonic(), []
        for key, (since, members) in list(self.open.items()):
            if now - since >= self.cfg.group_timeout_s:
                del self.open[key]
                trainable = [t for t in members if t.status == "finished" or self.cfg.train_aborted]
                if len(trainable) >= self.cfg.min_group_members:
                    self.counts["groups_timed_out"] += 1
                    self.ready.append(members)
                else:
                    self.counts["dropped_small_group"] += len(members)
                    small += members
        out, self.ready = self.ready[:n], self.ready[n:]
        return out, small


class Learner:
    def __init__(self, cfg: LearnerConfig) -> None:
        self.cfg = cfg
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        torch.manual_seed(cfg.seed)
        self.engine = make_engine(cfg)
        self.client = SteptapClient(cfg.proxy_url, cfg.token() or None)
        self.ledger, self.grouper = Ledger(), Grouper(cfg)
        self.version, self.updates, self.cursor, self.skip = 0, 0, None, set()
        self.checkpointed = -1  # the update count of the last checkpoint
        self.pass_through: list[Trajectory] = []  # eval trajectories: consumed, counted, never trained
        self.unreadable = 0  # stream records the client could not decode and skipped (reported in the notes)
        self.stop = asyncio.Event()
        self.metrics = MetricsLog(cfg.metrics_file, cfg.tensorboard_dir, cfg.progress, cfg.max_updates,
                                 cfg.trackers, cfg.project, cfg.experiment, cfg.as_dict())
        state = checkpoint.load_latest(cfg.checkpoint_dir) if cfg.resume else None
        if state is not None:
            self.engine.load_state_dict(state["engine"] if "engine" in state else state)
            self.version, self.updates, self.cursor = state["version"], state["updates"], state["cursor"]
            self.skip = set(state.get("consumed_after_cursor", []))
            self.ledger.acked, self.checkpointed = self.cursor, self.updates
            self.metrics.note(f"resumed at update {self.updates}, version {self.version}, cursor {self.cursor}")
        else:
            self.version = _proxy_version(cfg.proxy_url)

    async def train(self) -> None:
        self.pump = pump = asyncio.create_task(self._pump())
        try:
            while not self._finished():
                groups, t0 = await self._next_groups(), time.perf_counter()
                batch = build_batch([t for g in groups for t in g] + self._drain(), version=self.version,
                                    **self._row_options())
                batch.counts.update(self.grouper.counts)
                self.grouper.counts.clear()
                stats = await asyncio.to_thread(self.engine.train_step, batch) if batch.samples else None
                self.ledger.consume(batch.trajectory_ids)
                if stats is None:  # nothing trainable: consumed and counted, not an update
                    self.metrics.note(f"nothing to train in {len(batch.trajectory_ids)} trajectories: "
                                      f"{dict(batch.counts)}")
                    continue
                self.updates += 1
                if self.cfg.push_every and self.updates % self.cfg.push_every == 0:
                    await asyncio.to_thread(self._publish)
                self.metrics.log(update_row(self.updates, batch, stats, self.version, time.perf_counter() - t0))
                if self.updates % self.cfg.checkpoint_every == 0:
                    await self.checkpoint()
        finally:
            pump.cancel()

    # -- the stream ---------------------------------------------------------------------------------
    async def _pump(self) -> None:
        """Stream -> grouper. The client reconnects by itself when the proxy restarts."""
        async for d in self.client.trajectories(self.cfg.consumer, cursor=self.cursor):
            skipped = self.client.skipped.get(self.cfg.consumer, 0)
            if skipped != self.unreadable:  # never fatal: the cursor moved past them, an ack covers them
                self.metrics.note(f"skipped {skipped - self.unreadable} unreadable record(s) in the stream")
                self.unreadable = skipped
            self.ledger.deliver(d)
            if d.trajectory.id in self.skip:  # consumed before the checkpoint we resumed from: stays consumed
                self.ledger.consume([d.trajectory.id])
                continue
            if d.trajectory.mode == "eval":
                self.pass_through.append(d.trajectory)
            else:
                self.grouper.add(d.trajectory)

    async def _next_groups(self) -> list[list[Trajectory]]:
        groups: list[list[Trajectory]] = []
        while len(groups) < self.cfg.batch_groups and not self.stop.is_set():
            if self.pump.done():  # the stream gave up (a 4xx: wrong token, unknown route): say why
                self.pump.result()
                raise RuntimeError("the trajectory stream ended")
            more, small = self.grouper.take(self.cfg.batch_groups - len(groups))
            groups += more
            self.pass_through += small
            if len(groups) < self.cfg.batch_groups:
                await asyncio.sleep(0.2)
        return groups

    def _drain(self) -> list[Trajectory]:
        out, self.pass_through = self.pass_through, []
        return out

    def _row_options(self) -> dict:
        c = self.cfg
        return dict(gamma=c.gamma, max_staleness=c.max_staleness, stale_mode=c.stale_mode,
                    stale_decay=c.stale_decay, truncation_mode=c.truncation_mode, pack_extends=c.pack_extends,
                    train_aborted=c.train_aborted)

    def _finished(self) -> bool:
        return self.stop.is_set() or bool(self.cfg.max_updates and self.updates >= self.cfg.max_updates)

    # -- publish and checkpoint ---------------------------------------------------------------------
    def _publish(self) -> None:
        from steptap.learner.publish import PublishError, swap_written

        try:
            t0 = time.monotonic()
            path = self.engine.write_weights(self.cfg.weights_dir)
            self.version = swap_written(path, self.cfg.proxy_url, self.cfg.token(), self.cfg.weights_dir,
                                        lora=self.engine.lora, written_s=time.monotonic() - t0)
        except (PublishError, OSError) as exc:  # refused, or the proxy is down: it serves the old weights (or
            # restarts with them); training goes on and the next push carries this update too
            self.metrics.note(f"[red]publish failed[/red]: {exc}")

    async def checkpoint(self) -> None:
        if self.updates == self.checkpointed:
            return  # nothing new since the last one (a clean stop right after a periodic checkpoint)
        self.checkpointed = self.updates
        cursor, consumed_after = self.ledger.frontier()
        state = {
            "engine": await asyncio.to_thread(self.engine.state_dict),  # weights, optimizer, RNG
            "cursor": cursor,
            "consumed_after_cursor": consumed_after,
            "version": self.version,
            "updates": self.updates,
            "config": self.cfg.as_dict(),
        }
        path = await asyncio.to_thread(checkpoint.save, self.cfg.checkpoint_dir, state,
                                       keep=self.cfg.keep_checkpoints)
        if cursor is not None:  # acknowledge only once the checkpoint that covers it is durable
            try:
                await self.client.ack(self.cfg.consumer, cursor)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, SteptapError) as exc:
                # The proxy is restarting: the next checkpoint acknowledges (its cursor covers this one), and
                # until then a re-delivery is skipped by the client's de-duplication.
                self.metrics.note(f"[yellow]ack failed[/yellow] ({exc}); retried at the next checkpoint")
        self.metrics.note(f"checkpoint {path} (cursor {cursor}, version {self.version})")

    async def close(self) -> None:
        await self.client.close()
        self.metrics.close()
        await asyncio.to_thread(self.engine.close)


def _proxy_version(proxy_url: str) -> int:
    """The proxy's current policy version (its /health), or 0 when it cannot be asked."""
    try:  # a 503 (backend down) is an answer too: its body has the version
        return int(SyncSteptapClient(proxy_url, timeout_s=5.0).health().get("policy_version") or 0)
    except (OSError, ValueError, TypeError, SteptapError):
        return 0


async def _run(cfg: LearnerConfig) -> None:
    learner = await asyncio.to_thread(Learner, cfg)  # setup (model load) off the loop
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, learner.stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass
    try:
        await learner.train()
        await learner.checkpoint()  # a clean stop checkpoints (and acknowledges) what it trained
    finally:
        await learner.close()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = config_from_argv(argv)
    asyncio.run(_run(cfg))
    return 0
