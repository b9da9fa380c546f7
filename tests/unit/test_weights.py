"""The weight swapper without a model server: the gate (held calls, draining, serialized swaps), the order and
parameters of the backend calls, refusals before anything is paused, persistence of the version in a real log,
the ``/admin/weights`` route on the real app, and the learner's publishing side.

The backend here is a fault injector: it stalls or fails the reload on demand, which a real vLLM cannot be
made to do (tests/integration/test_swap_vllm.py swaps a real server). It records every call, to show what
reached it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from steptap.middleware.app import create_app
from steptap.middleware.config import ProxyConfig
from steptap.middleware.errors import status_of
from steptap.middleware.exceptions import SwapError
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.records import PolicyVersion, SessionOpened, Step, Trajectory
from steptap.middleware.sessions.control import SESSIONS_KEY
from steptap.middleware.weights.checks import check_weights_dir, tensor_shapes
from steptap.middleware.weights.routes import SWAPPER_KEY
from steptap.middleware.weights.swapper import LORA_PREFIX, WeightSwapper

TOKEN = "stc-weights-test"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MakeClient = Callable[..., Awaitable[TestClient]]


class FaultInjector:
    """A stand-in vLLM for the swap protocol only: records calls; ``reload_gate`` stalls the reload until set,
    ``fail`` makes a route answer 500."""

    def __init__(self, model_dir: str = "/nonexistent") -> None:
        self.calls: list[tuple[str, Any]] = []
        self.reload_gate = asyncio.Event()
        self.reload_gate.set()
        self.fail: set[str] = set()
        self.model_dir = model_dir
        self.adapters: set[str] = set()
        self.weight_label = "default"
        self.paused = False

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        self.calls.append((request.path_qs, body))
        if request.path in self.fail:
            return web.json_response(
                {"error": {"message": f"injected failure of {request.path}"}}, status=500
            )
        if request.path == "/collective_rpc":
            await self.reload_gate.wait()
        if request.path == "/v1/models":
            return web.json_response({"data": [{"id": m} for m in ["tiny", *sorted(self.adapters)]]})
        if request.path == "/server_info":
            return web.json_response({"vllm_config": f"model='{self.model_dir}', device_config=cpu, seed=0"})
        if request.path == "/v1/load_lora_adapter":
            self.adapters.add(body["lora_name"])
            return web.Response(text="Success")
        if request.path == "/v1/unload_lora_adapter":
            self.adapters.discard(body["lora_name"])
            return web.Response(text="Success")
        if request.path == "/reset_prefix_cache":
            return web.json_response({"success": True})
        if request.path == "/weight_info":
            return web.json_response({"weight_version": self.weight_label})
        if request.path == "/update_weight_version":
            self.weight_label = body["new_version"]
        if request.path == "/is_paused":
            return web.json_response({"is_paused": self.paused})
        if request.path in ("/pause", "/resume"):
            self.paused = request.path == "/pause"
        return web.json_response({"status": "ok"})

    def routes(self) -> list[str]:
        return [path for path, _ in self.calls]


@pytest.fixture
async def backend() -> AsyncIterator[tuple[FaultInjector, str]]:
    fake = FaultInjector()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    server = TestServer(app)
    await server.start_server()
    yield fake, str(server.make_url("")).rstrip("/")
    await server.close()


def model_dir(root: Path, *, tied: bool | None = False, rows: int = 4) -> Path:
    """A minimal Hugging Face directory: config.json and one safetensors file (written by hand: no torch)."""
    root.mkdir(parents=True, exist_ok=True)
    cfg: dict[str, Any] = {"model_type": "qwen2"}
    if tied is not None:
        cfg["tie_word_embeddings"] = tied
    (root / "config.json").write_text(json.dumps(cfg))
    tensors = {"lm_head.weight": [rows, 2], "model.embed_tokens.weight": [4, 2]}
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in tensors.items():
        size = shape[0] * shape[1] * 4
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    (root / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * offset)
    return root


def adapter_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    return root


# --- the swap protocol --------------------------------------------------------------------------------------


async def test_swap_calls_the_backend_in_order_with_mode_wait(
    backend: tuple[FaultInjector, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, url = backend
    base = model_dir(tmp_path / "base")
    fake.model_dir = str(base)
    sw = WeightSwapper(url, mode="drain")
    new = model_dir(tmp_path / "new")
    assert await sw.swap(path=str(new)) == 1
    assert fake.routes() == [
        "/server_info",
        "/pause?mode=wait",
        "/collective_rpc",
        "/update_weight_version",
        "/reset_prefix_cache",
        "/reset_encoder_cache",  # full weights: the vision tower may have changed (a LoRA below leaves it)
        "/resume",
    ]
    assert fake.calls[2][1] == {"method": "reload_weights", "kwargs": {"weights_path": str(new)}}
    assert sw.path == str(new) and sw.cpu_backend is True

    fake.calls.clear()
    ad = adapter_dir(tmp_path / "ad")
    monkeypatch.chdir(tmp_path)
    assert await sw.swap(lora_path="ad") == 2  # a relative path is the proxy's, made absolute for vLLM
    assert fake.routes() == [
        "/pause?mode=wait",
        "/v1/load_lora_adapter",
        "/update_weight_version",
        "/reset_prefix_cache",
        "/resume",
    ]
    assert fake.calls[1][1] == {"lora_name": f"{LORA_PREFIX}-v2", "lora_path": str(ad)}
    async with sw.gate() as ticket:
        assert ticket.version == 2 and ticket.served_model == f"{LORA_PREFIX}-v2"

    fake.calls.clear()
    assert await sw.swap(lora_path=str(ad), version=7) == 7
    assert ("/v1/unload_lora_adapter", {"lora_name": f"{LORA_PREFIX}-v2"}) in fake.calls  # the old one goes
    assert fake.adapters == {f"{LORA_PREFIX}-v7"}
    await sw.close()


async def test_new_calls_wait_during_a_swap_and_in_flight_calls_finish_first(
    backend: tuple[FaultInjector, str], tmp_path: Path
) -> None:
    fake, url = backend
    sw = WeightSwapper(url, mode="drain", cpu_backend=True, model_dir=str(model_dir(tmp_path / "base")))
    new = model_dir(tmp_path / "new")

    in_flight_done = asyncio.Event()
    release = asyncio.Event()

    async def in_flight() -> int:
        async with sw.gate() as t:
            await release.wait()
            in_flight_done.set()
            return t.version

    first = asyncio.ensure_future(in_flight())
    await asyncio.sleep(0.01)
    fake.reload_gate.clear()  # the reload will stall until we say
    swap = asyncio.ensure_future(sw.swap(path=str(new)))
    await asyncio.sleep(0.05)
    assert fake.routes() == []  # the proxy drains its own calls before pausing vLLM
    assert sw.state().swapping and sw.state().in_flight == 1

    async def new_call() -> int:
        async with sw.gate() as t:
            return t.version

    held = [asyncio.ensure_future(new_call()) for _ in range(3)]
    await asyncio.sleep(0.05)
    assert sw.state().held == 3 and not any(h.done() for h in held)

    release.set()  # the in-flight call finishes on the old version; then pause and (stalled) reload
    assert await first == 0
    while "/collective_rpc" not in fake.routes():
        await asyncio.sleep(0.005)
    assert fake.routes()[0] == "/pause?mode=wait"
    await asyncio.sleep(0.05)
    assert sw.state().held == 3 and not any(h.done() for h in held)  # still held while loading

    fake.reload_gate.set()
    assert await swap == 1
    assert await asyncio.gather(*held) == [1, 1, 1]  # released onto the new version
    st = sw.state()
    assert (
        st.held == 0 and st.in_flight == 0 and st.last_held_wait_s is not None and st.last_held_wait_s > 0.1
    )
    assert st.last_swap_s is not None and st.last_swap_s >= st.last_held_wait_s
    assert (
        st.last_paused_s is not None and 0.05 < st.last_paused_s < st.last_swap_s
    )  # paused while loading only
    await sw.close()


async def test_concurrent_swaps_run_one_after_the_other(
    backend: tuple[FaultInjector, str], tmp_path: Path
) -> None:
    fake, url = backend
    sw = WeightSwapper(url, mode="drain", cpu_backend=True, model_dir=str(model_dir(tmp_path / "base")))
    dirs = [str(model_dir(tmp_path / f"w{i}")) for i in range(3)]
    versions = await asyncio.gather(*(sw.swap(path=d) for d in dirs))
    assert sorted(versions) == [1, 2, 3] and sw.version == 3
    # never two pauses without a resume between them
    seq = [r for r in fake.routes() if r in ("/pause?mode=wait", "/resume")]
    assert seq == ["/pause?mode=wait", "/resume"] * 3
    await sw.close()


async def test_a_failed_reload_resumes_releases_and_keeps_the_version(
    backend: tuple[FaultInjector, str], tmp_path: Path
) -> None:
    fake, url = backend
    sw = WeightSwapper(url, cpu_backend=True, model_dir=str(model_dir(tmp_path / "base")))
    fake.fail.add("/collective_rpc")
    fake.reload_gate.clear()
    swap = asyncio.ensure_future(sw.swap(path=str(model_dir(tmp_path / "new"))))
    while not sw.state().swapping:
        await asyncio.sleep(0.001)

    async def new_call() -> int:
        async with sw.gate() as t:
            return t.version

    held = asyncio.ensure_future(new_call())
    fake.reload_gate.set()
    with pytest.raises(SwapError) as err:
        await swap
    assert status_of(err.value) == 502 and "injected failure of /collective_rpc" in err.value.message
    assert "restart" in err.value.message  # vllm 0.32 may hold no usable weights after a failed reload
    assert await held == 0
    assert fake.routes()[-1] == "/resume"
    st = sw.state()
    assert st.version == 0 and st.failures == 1 and st.degraded is not None
    await sw.close()


async def test_a_failure_after_loading_rolls_the_weights_back(
    backend: tuple[FaultInjector, str], tmp_path: Path
) -> None:
    fake, url = backend
    base = str(model_dir(tmp_path / "base"))
    sw = WeightSwapper(url, mode="drain", cpu_backend=True, model_dir=base)
    fake.fail.add("/reset_prefix_cache")
    with pytest.raises(SwapError, match="reset_prefix_cache"):
        await sw.swap(path=str(model_dir(tmp_path / "new")))
    reloads = [body["kwargs"]["weights_path"] for route, body in fake.calls if route == "/collective_rpc"]
    assert reloads == [str(tmp_path / "new"), base] and sw.version == 0 and fake.routes()[-1] == "/resume"
    fake.calls.clear()
    with pytest.raises(SwapError):
        await sw.swap(lora_path=str(adapter_dir(tmp_path / "ad")))
    assert ("/v1/unload_lora_adapter", {"lora_name": f"{LORA_PREFIX}-v1"}) in fake.calls  # never routed to
    assert fake.adapters == set() and sw.state().lora_name is None and sw.version == 0
    await sw.close()


async def test_a_call_outlasting_the_drain_bound_is_cut_and_the_swap_goes_on(
    backend: tuple[FaultInjector, str], tmp_path: Path
) -> None:
    """A slow reader must not hold the swap (and every held agent) for long: past ``drain_timeout_s`` its call
    is cancelled, marked as cut (relay records it as a failed step), and the swap proceeds."""
    fake, url = backend
    sw = WeightSwapper(
        url, cpu_backend=True, model_dir=str(model_dir(tmp_path / "base")), drain_timeout_s=0.1, mode="drain"
    )
    entered = asyncio.Event()

    async def slow_call() -> None:
        async with sw.gate():
            entered.set()
            await asyncio.Event().wait()  # a reader that never reads

    call = asyncio.ensure_future(slow_call())
    await entered.wait()
    assert await sw.swap(path=str(model_dir(tmp_path / "new"))) == 1
    assert call.cancelled() and sw.was_cut(call) and sw.state().cut_calls == 1
    assert fake.routes()[0] == "/pause?mode=wait" and fake.routes()[-1] == "/resume"
    async with sw.gate() as t:  # the gate is open again, on the new version
        assert t.version == 1
    await sw.close()


async def test_a_failed_resume_is_an_error_not_a_log_line(
    backend: tuple[FaultInjector, str], tmp_path: Path
) -> None:
    fake, url = backend
    sw = WeightSwapper(url, cpu_backend=True, model_dir=str(model_dir(tmp_path / "base")))
    fake.fail.add("/resume")
    with pytest.raises(SwapError, match="resume failed") as err:
        await sw.swap(path=str(model_dir(tmp_path / "new")))
    # The new weights are loaded and persisted-equivalent: the version moved, and the caller is told.
    assert status_of(err.value) == 502 and err.value.code == "resume_failed" and sw.version == 1
    assert sw.state().replicas[url]["error"] is not None and sw.failures == 1
    await sw.close()


async def test_reconcile_resumes_a_paused_backend_and_reloads_weights_under_another_label(
    backend: tuple[FaultInjector, str], tmp_path: Path
) -> None:
    """A proxy killed mid-swap: vLLM left paused and labelled with a version the log never persisted."""
    fake, url = backend
    base = str(model_dir(tmp_path / "base"))
    fake.weight_label, fake.paused = "7", True
    sw = WeightSwapper(url, cpu_backend=True, model_dir=base)
    await sw.reconcile(url)
    reloads = [body["kwargs"]["weights_path"] for route, body in fake.calls if route == "/collective_rpc"]
    assert reloads == [base] and fake.weight_label == "0" and not fake.paused
    fake.calls.clear()
    await sw.reconcile(url)  # now consistent: nothing to do
    assert fake.routes() == ["/weight_info", "/is_paused"]
    await sw.close()


# --- refusals before anything is paused ---------------------------------------------------------------------


def test_check_weights_dir_refusals(tmp_path: Path) -> None:
    base = model_dir(tmp_path / "base")
    check_weights_dir(str(model_dir(tmp_path / "ok")), cpu_backend=True, reference=str(base))
    with pytest.raises(SwapError, match="tie_word_embeddings") as err:
        check_weights_dir(str(model_dir(tmp_path / "tied", tied=True)), cpu_backend=True)
    assert err.value.code == "tied_embeddings"
    check_weights_dir(str(model_dir(tmp_path / "tied-gpu", tied=True)), cpu_backend=False)  # fine on GPU
    nested = model_dir(tmp_path / "nested")
    (nested / "config.json").write_text(
        json.dumps({"tie_word_embeddings": False, "text_config": {"tie_word_embeddings": True}})
    )
    with pytest.raises(SwapError, match="tie_word_embeddings"):
        check_weights_dir(str(nested), cpu_backend=True)
    with pytest.raises(SwapError) as err:
        check_weights_dir(str(model_dir(tmp_path / "wide", rows=5)), cpu_backend=True, reference=str(base))
    assert (
        err.value.code == "weights_mismatch" and "lm_head.weight [5, 2] (served: [4, 2])" in err.value.message
    )
    assert tensor_shapes(base) == {"lm_head.weight": [4, 2], "model.embed_tokens.weight": [4, 2]}
    with pytest.raises(SwapError, match="not found"):
        check_weights_dir(str(tmp_path / "nope"), cpu_backend=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(SwapError, match="safetensors"):
        check_weights_dir(str(empty), cpu_backend=True)


# --- persistence --------------------------------------------------------------------------------------------


async def test_version_is_persisted_and_restored(backend: tuple[FaultInjector, str], tmp_path: Path) -> None:
    fake, url = backend
    log = await TrajectoryLog.open(str(tmp_path / "log"))
    sw = WeightSwapper(url, log, cpu_backend=True, model_dir=str(model_dir(tmp_path / "base")))
    await sw.swap(path=str(model_dir(tmp_path / "a")))
    await sw.swap(lora_path=str(adapter_dir(tmp_path / "ad")), version=4)
    await log.close()
    await sw.close()
    with pytest.raises(SwapError) as err:  # a version that cannot be persisted never goes live
        await sw.swap(path=str(model_dir(tmp_path / "b")))
    assert err.value.code == "log_error" and sw.version == 4
    # the new weights were loaded before the log refused: the old version's weights are put back
    reloads = [body["kwargs"]["weights_path"] for route, body in fake.calls if route == "/collective_rpc"]
    assert reloads[-2:] == [str(tmp_path / "b"), str(tmp_path / "a")]
    await sw.close()

    log = await TrajectoryLog.open(str(tmp_path / "log"))
    records = list(log.records())
    assert [r.version for r in records if isinstance(r, PolicyVersion)] == [1, 4]
    again = WeightSwapper(url, cpu_backend=True)
    assert log.last_policy_version == records[-1]
    assert again.restore(log.last_policy_version) == 4
    assert again.path == str(tmp_path / "a")  # the base weights under the LoRA version
    assert again.lora_name == f"{LORA_PREFIX}-v4" and again.lora_path == str(tmp_path / "ad")
    fake.adapters.clear()
    await again.start()  # a restarted proxy reloads the routed adapter into a backend that lost it
    assert fake.adapters == {f"{LORA_PREFIX}-v4"}
    await again.close()
    await log.close()


async def test_every_reader_answers_one_policy_version_after_a_swap_compaction_and_restart(
    backend: tuple[FaultInjector, str], tmp_path: Path, aiohttp_client: MakeClient
) -> None:
    """The latest policy version has one answer: the swapper's, the log's record of it, /health, /metrics and
    the replica's label agree after swaps, after compaction dropped the segment of the last full-weights swap
    (a LoRA version on top of it is the last record), and after a restart on that log."""
    fake, url = backend
    base = model_dir(tmp_path / "base")
    fake.model_dir = str(base)
    log = await TrajectoryLog.open(str(tmp_path / "log"), segment_bytes=1024)
    sw = WeightSwapper(url, log, cpu_backend=True, model_dir=str(base))
    full = model_dir(tmp_path / "a")
    await sw.swap(path=str(full))
    await sw.swap(lora_path=str(adapter_dir(tmp_path / "ad")))
    before = sw.state()
    assert (before.version, before.path, before.lora_name) == (2, str(full), f"{LORA_PREFIX}-v2")
    cursor = ""
    for i in range(12):  # finished sessions, acknowledged: the segments of both versions can go
        await log.append(SessionOpened(trajectory_id=f"t{i}"))
        cursor = await log.append(Trajectory(id=f"t{i}", status="finished", steps=[
            Step(trajectory_id=f"t{i}", prompt_token_ids=list(range(40)))]))
    assert 1 in await log.compact(cursor)
    kept = [r for r in log.records() if isinstance(r, PolicyVersion)]
    assert [r.version for r in kept] == [2]  # the full-weights swap's record is gone, the latest carried on
    await log.close()
    await sw.close()

    client = await aiohttp_client(create_app(ProxyConfig(backend=url, log=str(tmp_path / "log"),
                                                         control_token=TOKEN)))
    after = client.app[SWAPPER_KEY].state()
    for field in ("version", "path", "lora_path", "lora_name", "mode"):
        assert getattr(after, field) == getattr(before, field), field
    health = await (await client.get("/health")).json()
    assert health["policy_version"] == health["weights"]["version"] == 2
    assert "steptap_policy_version 2.0" in await (await client.get("/metrics")).text()
    assert fake.weight_label == "2"
    log_after = client.app[SESSIONS_KEY].log
    assert [r.version for r in log_after.records() if isinstance(r, PolicyVersion)][-1] == 2


def test_the_latest_record_alone_restores_every_transition() -> None:
    """Compaction keeps only the latest ``PolicyVersion``, so each record holds the whole state: through the
    log's codec and back, it restores the state it was written from, whatever came before it."""
    from steptap.middleware.records import log_decoder, msgpack_encoder
    from steptap.middleware.weights.policy import Policy

    configured = Policy(path="/configured")
    a = configured.from_disk(1, "/a")
    b = a.adapter(2, "/ad")
    c = b.transferred(3)  # on no disk: the last disk weights stay named
    d = c.adapter(4, "/ad2")
    e = d.from_disk(5, "/e")
    for state in (a, b, c, d, e):
        record = log_decoder.decode(msgpack_encoder.encode(state.record()))
        assert configured.restored(record) == state
    assert (c.path, c.on_disk, c.lora_name, d.lora_name) == ("/a", False, None, f"{LORA_PREFIX}-v4")
    # records written before they held the whole state
    assert configured.restored(PolicyVersion(version=2, lora_path="/ad")) == Policy(
        version=2, path="/configured", lora_path="/ad")
    assert configured.restored(PolicyVersion(version=3)).on_disk is False
    assert configured.restored(None) == configured


# --- the route on the real app ------------------------------------------------------------------------------


async def test_admin_weights_route(
    backend: tuple[FaultInjector, str], tmp_path: Path, aiohttp_client: MakeClient
) -> None:
    fake, url = backend
    fake.model_dir = str(model_dir(tmp_path / "base"))
    client = await aiohttp_client(
        create_app(ProxyConfig(backend=url, log=str(tmp_path / "log"), control_token=TOKEN))
    )
    new = str(model_dir(tmp_path / "new"))

    resp = await client.post("/admin/weights", json={"path": new})
    assert resp.status == 401 and (await resp.json())["error"]["type"] == "authentication_error"
    opened = await (await client.post("/sessions", json={}, headers=AUTH)).json()
    resp = await client.post(
        "/admin/weights", json={"path": new}, headers={"Authorization": f"Bearer {opened['api_key']}"}
    )
    assert resp.status == 403
    for bad in ({}, {"path": new, "lora_path": new}, {"path": new, "extra": 1}, {"path": 3}):
        resp = await client.post("/admin/weights", json=bad, headers=AUTH)
        assert resp.status == 400, bad
        assert set((await resp.json())["error"]) == {"message", "type", "code"}
    assert fake.routes().count("/pause?mode=wait") == 0

    resp = await client.post("/admin/weights", json={"path": new, "version": 3}, headers=AUTH)
    body = await resp.json()
    assert resp.status == 200 and body["version"] == 3 and body["swap_s"] >= 0
    resp = await client.post("/admin/weights", json={"path": new, "version": 3}, headers=AUTH)
    assert resp.status == 409 and (await resp.json())["error"]["code"] == "stale_version"
    tied = str(model_dir(tmp_path / "tied", tied=True))
    resp = await client.post("/admin/weights", json={"path": tied}, headers=AUTH)
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "tied_embeddings"

    health = await (await client.get("/health")).json()
    assert health["policy_version"] == 3
    assert health["weights"]["version"] == 3 and health["weights"]["failures"] == 2
    assert health["weights"]["last_swap_s"] >= 0 and health["weights"]["held"] == 0
    metrics = await (await client.get("/metrics")).text()
    assert "steptap_policy_version 3.0" in metrics and "steptap_weight_swap_failures_total 2.0" in metrics
    assert client.app[SWAPPER_KEY].version == 3


# --- the learner's side -------------------------------------------------------------------------------------


class _Saves:
    """Anything with ``save_pretrained`` (the publisher needs nothing else)."""

    def __init__(self, tied: bool = False, peft: bool = False) -> None:
        self.tied = tied
        if peft:
            self.peft_config = {"default": None}

    def save_pretrained(self, out: str, **_: Any) -> None:
        if hasattr(self, "peft_config"):
            adapter_dir(Path(out))
        else:
            model_dir(Path(out), tied=self.tied)


def test_write_weights_is_atomic_and_pruned(tmp_path: Path) -> None:
    from steptap.learner.publish import MARKER, prune, write_weights

    out = tmp_path / "pub"
    a = write_weights(_Saves(), None, out, version=1)
    b = write_weights(_Saves(), None, out, version=1)  # a retried version never reuses a path
    assert a != b and (a / "config.json").is_file() and (a / MARKER).is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp")]
    lora = write_weights(_Saves(peft=True), None, out, lora=True)
    assert (lora / "adapter_config.json").is_file()
    with pytest.raises(TypeError):
        write_weights(_Saves(), None, out, lora=True)

    class Broken(_Saves):
        def save_pretrained(self, out: str, **_: Any) -> None:
            Path(out).mkdir()
            raise OSError("disk full")

    with pytest.raises(OSError):
        write_weights(Broken(), None, out, version=9)
    assert not [p for p in out.iterdir() if p.name.startswith((".tmp", "v000009"))]  # nothing half-written

    (out / "mine").mkdir()  # not ours: never pruned
    removed = prune(out, keep=1, protect=lora)
    assert set(removed) == {a, b} and lora.is_dir() and (out / "mine").is_dir()


async def test_publish_weights_through_the_proxy(
    backend: tuple[FaultInjector, str], tmp_path: Path, aiohttp_client: MakeClient
) -> None:
    from steptap.learner.publish import PublishError, publish_weights

    fake, url = backend
    fake.model_dir = str(model_dir(tmp_path / "base"))
    client = await aiohttp_client(
        create_app(ProxyConfig(backend=url, log=str(tmp_path / "log"), control_token=TOKEN))
    )
    proxy = str(client.make_url("")).rstrip("/")
    out = tmp_path / "pub"
    versions = [
        await asyncio.to_thread(publish_weights, _Saves(), None, proxy, TOKEN, out, keep=2) for _ in range(3)
    ]
    assert versions == [1, 2, 3]
    kept = sorted(p.name for p in out.iterdir())
    assert len(kept) == 2  # keep last K
    reloads = [body for route, body in fake.calls if route == "/collective_rpc"]
    assert reloads[-1]["kwargs"]["weights_path"] in {str(p) for p in out.iterdir()}  # the live one is kept

    with pytest.raises(PublishError, match="tie_word_embeddings") as err:
        await asyncio.to_thread(publish_weights, _Saves(tied=True), None, proxy, TOKEN, out)
    assert err.value.status == 400 and err.value.code == "tied_embeddings"
    assert len(list(out.iterdir())) == 2  # the refused directory is gone
    with pytest.raises(PublishError) as err:
        await asyncio.to_thread(publish_weights, _Saves(), None, proxy, "stc-wrong", out)
    assert err.value.status == 403
    from conftest import free_port

    with pytest.raises(PublishError, match="unreachable") as err:  # a proxy restarting: training goes on
        gone = f"http://127.0.0.1:{free_port()}"
        await asyncio.to_thread(publish_weights, _Saves(), None, gone, TOKEN, out)
    assert err.value.status is None and err.value.code == "proxy_unreachable"
    v = await asyncio.to_thread(publish_weights, _Saves(peft=True), None, proxy, TOKEN, out, lora=True)
    assert v == 4 and client.app[SWAPPER_KEY].state().mode == "lora"
    shutil.rmtree(out)


# --- keep mode (the default): no drain, no cut ------------------------------------------------------------


async def test_keep_swap_pauses_with_keep_and_marks_the_calls_in_flight(
    backend: tuple[FaultInjector, str], tmp_path: Path
) -> None:
    """A call in flight does not hold the swap (no drain): vLLM is paused with ``keep``, and the call's tokens
    after the ones relayed so far are recorded as the new version's."""
    fake, url = backend
    sw = WeightSwapper(url, cpu_backend=True, model_dir=str(model_dir(tmp_path / "base")))
    assert sw.mode == "keep"
    entered, release = asyncio.Event(), asyncio.Event()
    got: dict[str, Any] = {}

    async def streaming_call() -> None:
        async with sw.gate() as ticket:
            assert ticket.spans is not None
            ticket.spans.counter = lambda: {0: 5}  # 5 tokens relayed when the swap comes
            entered.set()
            await release.wait()
            got["spans"] = ticket.spans.of(0)

    call = asyncio.ensure_future(streaming_call())
    await entered.wait()
    # Not held by the call
    assert await asyncio.wait_for(sw.swap(path=str(model_dir(tmp_path / "new"))), 10) == 1
    assert fake.routes() == ["/pause?mode=keep", "/collective_rpc", "/update_weight_version",
                             "/reset_prefix_cache", "/reset_encoder_cache", "/resume"]
    release.set()
    await call
    assert got["spans"] == [[0, 0], [5, 1]] and sw.state().cut_calls == 0 and sw.state().spanning_calls == 1
    await sw.close()


async def test_a_plain_call_spanning_a_keep_swap_keeps_its_version_and_is_counted_unsplit(
    backend: tuple[FaultInjector, str], tmp_path: Path
) -> None:
    """A non-streamed chat call in flight at a keep swap: the proxy cannot see where its tokens switched, so
    its step keeps the version it started on, and the call is counted as spanning with an unknown split."""
    from prometheus_client import CollectorRegistry, generate_latest

    from steptap.middleware.metrics import UNSPLIT_CALLS
    from steptap.middleware.weights.routes import WeightsCollector

    fake, url = backend
    sw = WeightSwapper(url, cpu_backend=True, model_dir=str(model_dir(tmp_path / "base")))
    entered, release = asyncio.Event(), asyncio.Event()

    async def plain_call() -> Step:
        async with sw.gate() as ticket:  # no counter: nothing streams
            entered.set()
            await release.wait()
            step = Step(policy_version=ticket.version, response_token_ids=[1, 2, 3, 4])
            sw.label([step], ticket.spans)
            return step

    call = asyncio.ensure_future(plain_call())
    await entered.wait()
    assert await sw.swap(path=str(model_dir(tmp_path / "new"))) == 1
    release.set()
    step = await call
    assert step.version_spans == [] and step.token_versions() == [0, 0, 0, 0]
    st = sw.state()
    assert st.spanning_calls == 1 and st.unsplit_calls == 1
    registry = CollectorRegistry()
    registry.register(WeightsCollector(sw))
    assert f"{UNSPLIT_CALLS}_total 1.0" in generate_latest(registry).decode()
    await sw.close()


async def test_keep_lora_swap_loads_beside_the_old_adapter_without_pausing(
    backend: tuple[FaultInjector, str], tmp_path: Path
) -> None:
    fake, url = backend
    sw = WeightSwapper(url, cpu_backend=True, model_dir=str(model_dir(tmp_path / "base")))
    assert await sw.swap(lora_path=str(adapter_dir(tmp_path / "a1"))) == 1
    old = f"{LORA_PREFIX}-v1"
    entered, release = asyncio.Event(), asyncio.Event()

    async def call_on_old() -> None:
        async with sw.gate() as ticket:
            assert ticket.served_model == old
            entered.set()
            await release.wait()

    call = asyncio.ensure_future(call_on_old())
    await entered.wait()
    assert await sw.swap(lora_path=str(adapter_dir(tmp_path / "a2"))) == 2
    new = f"{LORA_PREFIX}-v2"
    assert not [r for r in fake.routes() if r.startswith("/pause")]  # no pause at all
    assert fake.adapters == {old, new}  # the call in flight still runs on the old adapter
    async with sw.gate() as ticket:
        assert ticket.served_model == new  # new calls use the new one at once
    release.set()
    await call  # the call left the gate: the old adapter's unload has started, in the background
    await asyncio.wait_for(sw.adapters.unloaded(), 10)
    assert fake.adapters == {new} and sw.state().last_stall_s == 0.0
    await sw.close()


def test_tokens_per_version_stalls_and_spanning_calls_reach_metrics_and_the_live_view(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from steptap.middleware.launch.view import StatusBoard, parse_prometheus
    from steptap.middleware.weights.routes import WeightsCollector

    sw = WeightSwapper("http://127.0.0.1:9")
    sw.label([Step(policy_version=0, response_token_ids=[1, 2, 3, 4, 5], version_spans=[[0, 0], [2, 1]])],
             None)
    sw.calls.spanning_calls, sw.swaps, sw.max_stall_s = 1, 1, 0.25
    registry = CollectorRegistry()
    registry.register(WeightsCollector(sw))
    board = StatusBoard("http://127.0.0.1:9", tmp_path / "metrics.jsonl")
    board.prom = parse_prometheus(generate_latest(registry).decode())
    assert board.tokens_by_version() == "v0: 2  v1: 3"
    line = board.last_swap()
    assert "longest stall 0.25 s" in line and "1 calls spanned a swap" in line and "cut" not in line
