"""``steptap learn``: train the policy on the proxy's trajectory stream and hot-swap the weights into vLLM.

    steptap learn --config examples/learner.toml [--lr 1e-5 --max-updates 100 ...]

``main`` does setup, ``train()``, cleanup, each once. ``train()`` is the whole loop: take ``batch_groups``
complete groups from the stream, build rows, one engine step, log, publish every ``push_every`` updates,
checkpoint (and only then acknowledge the stream) every ``checkpoint_every`` updates.

Acknowledgement. Groups finish out of stream order, so the learner keeps a ledger of delivered cursors: it
acknowledges the longest prefix of the stream whose trajectories were all trained on or deliberately dropped,
and stores in the checkpoint the delivery keys (id and ``created_at``) it has already consumed beyond that
prefix. ``--resume`` restores the weights, optimizer, version and update count, reopens the stream at the
checkpoint's cursor and skips those keys: nothing acknowledged or already trained is trained again; a crash
between checkpoints re-delivers (and re-trains) what came after the last checkpoint, never loses it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time

import aiohttp
import torch

from steptap.learner import checkpoint, curation
from steptap.learner.config import LearnerConfig, config_from_argv
from steptap.learner.engines.base import StepStats, make_engine
from steptap.learner.health import HealthCheck, HealthStop, figures
from steptap.learner.intake import Grouper, Source
from steptap.learner.metrics_log import MetricsLog, update_row
from steptap.learner.rows import Batch, build_batch
from steptap.learner.vision import Resolve, VisionInputs, VisionMismatch, check_message, vision_config
from steptap.middleware.client import SteptapError, SyncSteptapClient, delivery_key
from steptap.middleware.health import ProxyFigures, Thresholds, proxy_figures
from steptap.middleware.metrics import parse_text
from steptap.middleware.records import Trajectory

logger = logging.getLogger("steptap.learner")
HEALTH_STOP_EXIT = 3  # the exit code of a run the health check stopped (docs/health.md)


class Learner:
    def __init__(self, cfg: LearnerConfig, resolve: Resolve | None = None) -> None:
        """``resolve``: image bytes by digest (the stream client's or the log's) for vision steps; without one
        a vision policy's image steps are dropped as unresolved."""
        self.cfg = cfg
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        torch.manual_seed(cfg.seed)
        self.engine = make_engine(cfg)
        self.sources = [Source(url, cfg.token()) for url in cfg.urls()]
        if vision_config(cfg.model_dir):
            self.vision: VisionInputs | None = VisionInputs(
                cfg.model_dir, resolve or _image_resolver([s.url for s in self.sources], cfg.token()))
        else:
            self.vision = None
        self.vision_checked = False  # the first batch with vision steps is checked against vLLM's logprobs
        self.origin: dict[int, Source] = {}  # id(trajectory) -> the source that delivered it, until consumed
        self.grouper = Grouper(cfg)
        self.version, self.updates = 0, 0
        self.checkpointed = -1  # the update count of the last checkpoint
        self.pass_through: list[Trajectory] = []  # eval and judge ones: consumed, counted, never trained
        # consumed, never trained, and why: anonymous ones (unless train_anonymous), too-small groups
        self.untrained: list[tuple[Trajectory, str]] = []
        self.last_batch_at = self.probed_at = time.monotonic()
        self.stop = asyncio.Event()
        self.metrics = MetricsLog(cfg.metrics_file, cfg.tensorboard_dir, cfg.progress, cfg.max_updates,
                                 cfg.trackers, cfg.project, cfg.experiment, cfg.as_dict())
        self.health = HealthCheck(cfg.health_check, Thresholds(window=cfg.health_window,
                                                              gap_nats=cfg.health_gap_nats,
                                                              stall_s=cfg.health_stall_s), self.metrics.note)
        state = checkpoint.load_latest(cfg.checkpoint_dir) if cfg.resume else None
        if state is not None:
            self.engine.load_state_dict(state["engine"] if "engine" in state else state)
            self.version, self.updates = state["version"], state["updates"]
            self.checkpointed = self.updates
            # One cursor per source; a checkpoint from a single-proxy run holds the first source's.
            per = state.get("sources") or {self.sources[0].url: {
                "cursor": state["cursor"], "consumed_after_cursor": state.get("consumed_after_cursor", [])}}
            for src in self.sources:
                if src.url in per:
                    src.cursor = src.ledger.acked = per[src.url]["cursor"]
                    src.skip = set(per[src.url].get("consumed_after_cursor", []))
            cursors = {s.url: s.cursor for s in self.sources}
            self.metrics.note(f"resumed at update {self.updates}, version {self.version}, cursors {cursors}")
            if cfg.algorithm == "gae" and not getattr(self.engine, "value_head_restored", True):
                self.metrics.note("the checkpoint has no value head (older, or not a gae run): it starts at "
                                  "V = 0")
        else:
            self.version = max(_proxy_state(s.url)[0] for s in self.sources)

    async def train(self) -> None:
        self.pumps = [asyncio.create_task(self._pump(src)) for src in self.sources]
        try:
            while not self._finished():
                groups, t0 = await self._next_groups(), time.perf_counter()
                untrained, self.untrained = self.untrained, []
                trajs = [t for g in groups for t in g] + self._drain()
                marks = await self._curation(trajs)
                # off the loop: a vision step's images are fetched from its proxy while its row is built
                batch = await asyncio.to_thread(build_batch, trajs, version=self.version, curation=marks,
                                                vision=self.vision, dropped=untrained, **self._row_options())
                dropped = curation.note(trajs, marks)
                if dropped:
                    self.metrics.note(dropped)
                batch.counts.update(self.grouper.counts)
                self.grouper.counts.clear()
                gap = await asyncio.to_thread(self._vision_check, batch)
                stats = await asyncio.to_thread(self.engine.train_step, batch) if batch.samples else None
                self._consume(trajs + [t for t, _ in untrained])
                self.last_batch_at = time.monotonic()
                if stats is None:  # nothing trainable: consumed and counted, not an update
                    self.metrics.note(f"nothing to train in {len(batch.trajectory_ids)} trajectories: "
                                      f"{dict(batch.counts)}")
                    self._checked({"time": time.time(), "skipped_batch": len(batch.trajectory_ids),
                                   "policy_version": self.version, "counts": dict(batch.counts)}, batch, None)
                    continue
                self.updates += 1
                row = update_row(self.updates, batch, stats, self.version, time.perf_counter() - t0)
                self._checked(row, batch, stats)  # a stop here publishes nothing
                if self.cfg.push_every and self.updates % self.cfg.push_every == 0:
                    await asyncio.to_thread(self._publish)
                row["policy_version"] = self.version  # after this update's publish
                if gap is not None:
                    row["vision_logprob_gap"] = gap
                self.metrics.log(row)
                if self.updates % self.cfg.checkpoint_every == 0:
                    await self.checkpoint()
        finally:
            for pump in self.pumps:
                pump.cancel()

    def _checked(self, row: dict, batch: Batch, stats: StepStats | None) -> None:
        """The batch's health figures into its row, then the check (learner/health.py); on a stop the row and
        the diagnosis are written before ``HealthStop`` goes up. A batch with nothing to train is logged
        here."""
        row["health"] = figures(batch, stats, self.cfg.algorithm)
        try:
            self.health.batch(row)
        except HealthStop as stop:
            self.metrics.log(row) if "update" in row else self.metrics.log_batch(row)
            self.metrics.log_batch({"time": time.time(), "health_stop": stop.finding.text,
                                    "cause": stop.finding.cause})
            raise
        if "update" not in row:
            self.metrics.log_batch(row)

    def _vision_check(self, batch: Batch) -> float | None:
        """The first batch holding vision steps: the policy's logprobs against vLLM's (learner/vision.py),
        before any update on them; the gap, or None when not checked here."""
        if self.vision_checked or not batch.has_vision:
            return None
        self.vision_checked = True
        gap, tokens = self.engine.logprob_gap(batch)
        if not tokens:  # none sampled by this version: the next vision batch is checked
            self.vision_checked = False
            return None
        error = check_message(gap, self.cfg.vision_logprob_tol, tokens)
        if error is None:
            self.metrics.note(f"vision check: {tokens} response tokens within {gap:.3g} of vLLM's logprobs")
            return gap
        self.metrics.note(f"[red]{error}[/red]")
        logger.error(error)
        if self.cfg.vision_check == "stop":
            raise VisionMismatch(error)
        return gap

    # -- the streams --------------------------------------------------------------------------------
    async def _pump(self, src: Source) -> None:
        """One proxy's stream -> grouper. The client reconnects by itself when that proxy restarts; the other
        streams go on meanwhile."""
        # Steps as logged: the rows expand them one at a time (a long session in linear memory)
        async for d in src.client.trajectories(self.cfg.consumer, cursor=src.cursor, full=False):
            skipped = src.client.skipped.get(self.cfg.consumer, 0)
            if skipped != src.unreadable:  # never fatal: the cursor moved past them, an ack covers them
                self.metrics.note(f"skipped {skipped - src.unreadable} unreadable record(s) in {src.url}'s "
                                  "stream")
                src.unreadable = skipped
            src.ledger.deliver(d)
            key = delivery_key(d.trajectory)
            # consumed before the checkpoint we resumed from: stays consumed (checkpoints before the delivery
            # key held bare ids)
            if key in src.skip or d.trajectory.id in src.skip:
                src.ledger.consume([key])
                continue
            self.origin[id(d.trajectory)] = src
            # eval, judge, an infrastructure error: consumed, counted by the rows (by cause), never trained
            if d.trajectory.mode != "train" or d.trajectory.status == "infra_error":
                self.pass_through.append(d.trajectory)
            elif not self.grouper.add(d.trajectory, src.url):  # anonymous: consumed, never trained
                self.untrained.append((d.trajectory, "skipped_anonymous"))

    def _consume(self, trajs: list[Trajectory]) -> None:
        """Mark trajectories trained on or dropped in the ledger of the source each came from."""
        for traj in trajs:
            src = self.origin.pop(id(traj), None)
            if src is not None:
                src.ledger.consume([delivery_key(traj)])

    async def _next_groups(self) -> list[list[Trajectory]]:
        groups: list[list[Trajectory]] = []
        while len(groups) < self.cfg.batch_groups and not self.stop.is_set():
            for pump in self.pumps:
                if pump.done():  # a stream gave up (a 4xx: wrong token, unknown route): say why
                    pump.result()
                    raise RuntimeError("the trajectory stream ended")
            more, small = self.grouper.take(self.cfg.batch_groups - len(groups))
            groups += [g for g in more if not self._skipped(g)]
            self.untrained += [(t, "dropped_small_group") for t in small]  # consumed, never trained
            if len(groups) < self.cfg.batch_groups:
                await asyncio.sleep(0.2)
                await self._stalled()
        return groups

    def _skipped(self, group: list[Trajectory]) -> bool:
        """``skip_uniform_groups``: a group of one reward is consumed with the next batch, never trained, and
        logged now (the row a lockstep driver watches to resample its task)."""
        rewards = {round(t.reward, 9) for t in group}
        if not self.cfg.skip_uniform_groups or len(rewards) > 1:
            return False
        self.untrained += [(t, "dropped_no_variance") for t in group]
        self.grouper.counts["dropped_no_variance"] += len(group)
        self.metrics.log_batch({"time": time.time(), "skipped_group": group[0].group_id,
                                "cause": "no_variance", "group_reward": rewards.pop(),
                                "trajectories": len(group), "policy_version": self.version})
        return True

    async def _stalled(self) -> None:
        """No batch for ``health_stall_s``: what the proxies say (sessions that never finish, rewards that
        never come: learner/health.py), read from their /metrics every half of it."""
        now, stall = time.monotonic(), self.cfg.health_stall_s
        if now - self.last_batch_at < stall or now - self.probed_at < stall / 2:
            return
        self.probed_at = now
        self.health.proxies(await asyncio.to_thread(_proxy_figures, [s.url for s in self.sources],
                                                    self.cfg.token()))

    async def _curation(self, trajs: list[Trajectory]) -> dict[str, curation.CurationState]:
        """The marks of ``trajs``, asked of the proxy each came from (learner/curation.py)."""
        by_source: dict[int, tuple[Source, list[str]]] = {}
        for t in trajs:
            src = self.origin.get(id(t))
            if src is not None and t.mode == "train":
                by_source.setdefault(id(src), (src, []))[1].append(t.id)
        out: dict[str, curation.CurationState] = {}
        for src, ids in by_source.values():
            out.update(await curation.lookup(src.client, ids, self.stop.is_set, self.metrics.note))
        return out

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
        """Write the weights once (the engine's own writer), swap them into every proxy in parallel under one
        version number (the learner is the version authority; a proxy that missed one catches up at the next,
        newer, version). A refused or unreachable proxy keeps serving its version; training goes on."""
        from steptap.learner.publish import publish_written

        version, lora = self.version + 1, self.engine.lora
        if self.cfg.weight_sync == "collective" and not lora:
            states = [_proxy_state(src.url, self.cfg.token()) for src in self.sources]
            # A proxy made a version of disk weights meanwhile
            version = max(version, *(v + 1 for v, _ in states))
            wanted = [why for _, why in states if why]
            # A replica lost a transferred version: this one goes through disk, whatever disk_every
            if wanted:
                self.metrics.note(f"publishing version {version} through disk: {wanted[0]}")
            elif not self.cfg.through_disk(version):
                self._publish_collective(version)
                return
        try:
            path = self.engine.write_weights(self.cfg.weights_dir, version=version)
        except OSError as exc:
            self.metrics.note(f"[red]publish failed[/red]: {exc}")
            return

        answers = publish_written(path, [s.url for s in self.sources], self.cfg.token(), self.cfg.weights_dir,
                                  version=version, lora=lora)
        for url, answer in answers.items():
            if not isinstance(answer, int):
                self.metrics.note(f"[red]publish failed[/red] on {url}: {answer}")
        if any(isinstance(a, int) for a in answers.values()):
            self.version = version

    def _publish_collective(self, version: int) -> None:
        """``weight_sync = "collective"``: broadcast the full weights into each proxy's vLLM
        (learner/transfer.py), one proxy after the other (each transfer is its own group). A failed transfer
        may have made the last weights on disk a newer version at that proxy (its error says so): the next
        publish goes above it."""
        from steptap.learner.publish import PublishError
        from steptap.learner.transfer import send_collective

        weights = self.engine.named_weights()
        done = False
        for src in self.sources:
            try:
                t0 = time.perf_counter()
                send_collective(weights, src.url, self.cfg.token(), version=version,
                                address=self.cfg.transfer_address, timeout_s=self.cfg.transfer_timeout_s)
                self.metrics.note(f"published version {version} to {src.url} by collective transfer "
                                  f"({'nccl' if weights[0][1].is_cuda else 'gloo'}, "
                                  f"{time.perf_counter() - t0:.2f} s)")
                done = True
            except (PublishError, OSError) as exc:
                self.metrics.note(f"[red]publish failed[/red] on {src.url}: {exc}")
                self.version = max(self.version, _proxy_state(src.url)[0])
        if done:
            self.version = max(self.version, version)

    async def checkpoint(self) -> None:
        if self.updates == self.checkpointed:
            return  # nothing new since the last one (a clean stop right after a periodic checkpoint)
        self.checkpointed = self.updates
        fronts = {src.url: src.ledger.frontier() for src in self.sources}
        cursor, consumed_after = fronts[self.sources[0].url]
        state = {
            "engine": await asyncio.to_thread(self.engine.state_dict),  # weights, optimizer, RNG
            "cursor": cursor,  # the first source's (the only one's, usually)
            "consumed_after_cursor": consumed_after,
            "sources": {url: {"cursor": c, "consumed_after_cursor": after} for url,
                        (c, after) in fronts.items()},
            "version": self.version,
            "updates": self.updates,
            "config": self.cfg.as_dict(),
        }
        path = await asyncio.to_thread(checkpoint.save, self.cfg.checkpoint_dir, state,
                                       keep=self.cfg.keep_checkpoints)
        # Each stream acknowledged on its own, once the checkpoint covering it is durable
        for src in self.sources:
            acked = fronts[src.url][0]
            if acked is None:
                continue
            try:
                await src.client.ack(self.cfg.consumer, acked)
            except (TimeoutError, aiohttp.ClientError, OSError, SteptapError) as exc:
                # That proxy is restarting: the next checkpoint acknowledges (its cursor covers this one), and
                # until then a re-delivery is skipped by the client's de-duplication.
                self.metrics.note(f"[yellow]ack failed[/yellow] on {src.url} ({exc}); retried at the next "
                                  "checkpoint")
        cursors = cursor if len(fronts) == 1 else {u: c for u, (c, _) in fronts.items()}
        self.metrics.note(f"checkpoint {path} (cursor {cursors}, version {self.version})")

    async def close(self) -> None:
        await asyncio.to_thread(self.engine.close)
        for src in self.sources:
            await src.client.close()
        self.metrics.close()


def _proxy_state(proxy_url: str, token: str | None = None) -> tuple[int, str | None]:
    """The proxy's policy version and why it wants a version through disk (its /health), or (0, None) when it
    cannot be asked."""
    try:  # a 503 (backend down) is an answer too: its body has the version
        health = SyncSteptapClient(proxy_url, token, timeout_s=5.0).health()
        weights = health.get("weights")
        wanted = weights.get("disk_wanted") if isinstance(weights, dict) else None
        return int(health.get("policy_version") or 0), str(wanted) if wanted else None
    except (OSError, ValueError, TypeError, AttributeError, SteptapError):
        return 0, None


def _proxy_figures(urls: list[str], token: str) -> list[ProxyFigures]:
    """Each proxy's health figures, from its /metrics (one that cannot be asked is left out)."""
    out = []
    for url in urls:
        try:
            out.append(proxy_figures(parse_text(SyncSteptapClient(url, token or None, timeout_s=5.0)
                                                .metrics_text())))
        except (OSError, ValueError, SteptapError):
            continue
    return out


def _image_resolver(urls: list[str], token: str) -> Resolve:
    """Image bytes by digest from the proxies the stream comes from (content-addressed: any that holds it)."""
    clients = [SyncSteptapClient(url, token or None, timeout_s=30.0) for url in urls]

    def resolve(sha256: str) -> bytes | None:
        for client in clients:
            try:
                data = client.image(sha256)
            except (OSError, SteptapError):  # that proxy is down or refuses: ask the next
                continue
            if data is not None:
                return data
        return None
    return resolve


async def _run(cfg: LearnerConfig, resolve: Resolve | None = None) -> None:
    learner = await asyncio.to_thread(Learner, cfg, resolve)  # setup (model load) off the loop
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, learner.stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass
    try:
        try:
            await learner.train()
        except HealthStop:  # nothing can be learned: what was trained is kept, and the run stops, saying why
            await learner.checkpoint()
            raise
        await learner.checkpoint()  # a clean stop checkpoints (and acknowledges) what it trained
    finally:
        await learner.close()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        cfg = config_from_argv(argv)
    except ValueError as exc:  # every problem at once, in lines, not a traceback
        print(f"steptap learn: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_run(cfg))
    except HealthStop as stop:  # its row is in the metrics file: steptap up, the console and doctor say it
        print(f"steptap learn: the run's health check stopped it ({stop.finding.cause}): {stop}",
              file=sys.stderr)
        return HEALTH_STOP_EXIT
    return 0
