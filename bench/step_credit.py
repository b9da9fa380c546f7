"""Step-level credit on a two-step task: GAE over steps (value head) against trajectory-level GRPO, same
seeds.

    python bench/step_credit.py --model-dir DIR [--updates 12] [--estimators gae grpo]

The task runs in-process on the torch engine (transformers sampling, no vLLM), like the engine-level learning
test: each trajectory is two steps of an `extends` chain. Step 1 answers a chat prompt; step 2 continues after
the step-1 reply and a fixed user turn. Reward: the fraction of a response's tokens in a fixed 5% of the
vocabulary (every 20th id), given as a *process reward on step 1* and as the trajectory reward for step 2.
The reported reward is their mean (0..1), about 0.05 for a random model.

GRPO sees each step's return (its process reward plus what follows), normalised over its group of 8;
GAE credits each step with its own reward plus the value of what follows (gamma 1, lambda 0.95).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from steptap.learner.config import LearnerConfig
from steptap.learner.engines.torch_engine import TorchEngine
from steptap.learner.rows import build_batch
from steptap.middleware.records import Step, Trajectory

PROMPTS = ["Say something.", "Tell me a story.", "What is new?", "Write a line."]
GROUP_SIZE = 8
MAX_TOKENS = 8


@dataclass
class Curve:
    estimator: str
    rewards: list[float]  # mean reward per update, before that update's step
    seconds: float


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:  # type: ignore[no-untyped-def]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def engine_for(model_dir: str, estimator: str, seed: int = 0) -> TorchEngine:
    torch.manual_seed(seed)
    return TorchEngine(LearnerConfig(model_dir=model_dir, algorithm=estimator, lr=1e-2, value_lr=1e-2,
                                     gamma=1.0, lam=0.95, group_size=GROUP_SIZE, seed=seed).validate())


def rollouts(engine: TorchEngine, update: int, prompts: int = len(PROMPTS)) -> list[Trajectory]:
    """One batch: every prompt x GROUP_SIZE two-step trajectories, sampled by the engine's current weights."""
    tok = engine.tokenizer
    targets = {i for i in range(0, len(tok), 20)} - set(tok.all_special_ids)

    def frac(ids: list[int]) -> float:
        return sum(t in targets for t in ids) / max(len(ids), 1)

    # The second turn's user message, as chat-template tokens appended after the first reply.
    turn = _chat_ids(tok, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                           {"role": "user", "content": "And then?"}])
    second_user = turn[len(_chat_ids(tok, [{"role": "user", "content": "x"}])) + len(tok("y")["input_ids"]):]
    trajs = []
    for g, text in enumerate(PROMPTS[:prompts]):
        p1 = _chat_ids(tok, [{"role": "user", "content": text}])
        for m, (r1, lp1) in enumerate(engine.sample(p1, n=GROUP_SIZE, max_new_tokens=MAX_TOKENS)):
            p2 = p1 + r1 + second_user
            (r2, lp2), = engine.sample(p2, n=1, max_new_tokens=MAX_TOKENS)
            steps = [Step(index=0, prompt_token_ids=p1, response_token_ids=r1, response_logprobs=lp1,
                          policy_version=update, prefix="first", rewards={"in_set": frac(r1)}),
                     Step(index=1, prompt_token_ids=p2, response_token_ids=r2, response_logprobs=lp2,
                          policy_version=update, prefix="extends")]
            trajs.append(Trajectory(id=f"{update}-{g}-{m}", group_id=f"{update}-{g}", group_size=GROUP_SIZE,
                                    status="finished", steps=steps, rewards={"in_set": frac(r2)}))
    return trajs


def mean_reward(trajs: list[Trajectory]) -> float:
    """Mean over trajectories of (step-1 process reward + trajectory reward) / 2."""
    return sum((sum(t.steps[0].rewards.values()) + t.reward) / 2 for t in trajs) / len(trajs)


def run(model_dir: str, estimator: str, updates: int, seed: int = 0, stop_gain: float | None = None,
        prompts: int = len(PROMPTS), log: bool = True) -> Curve:
    """Train for ``updates`` updates (or until the last two batches are ``stop_gain`` above the first)."""
    torch.set_num_threads(1)  # shared cores: more threads only contend, and one thread is deterministic
    engine = engine_for(model_dir, estimator, seed)
    curve, t0 = [], time.perf_counter()
    for update in range(updates):
        trajs = rollouts(engine, update, prompts)
        curve.append(mean_reward(trajs))
        stats = engine.train_step(build_batch(trajs, version=update, gamma=engine.cfg.gamma))
        if log:
            print(f"{estimator} update {update + 1}: reward {curve[-1]:.3f} loss {stats.loss:+.4f} "
                  f"value_loss {stats.value_loss:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        if stop_gain is not None and len(curve) >= 3 and min(curve[-2:]) > curve[0] + stop_gain:
            break
    return Curve(estimator, curve, time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--updates", type=int, default=12)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--estimators", nargs="+", default=["gae", "grpo"])
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="prompts (groups of 8) per update")
    args = parser.parse_args()
    results = [run(args.model_dir, e, args.updates, seed=s, prompts=args.prompts)
               for s in args.seeds for e in args.estimators]
    print("\nestimator  curve (mean reward per update)                             first -> best of last 3 "
          "  s")
    for c in results:
        print(f"{c.estimator:<10} {' '.join(f'{r:.2f}' for r in c.rewards):<55} "
              f"{c.rewards[0]:.3f} -> {max(c.rewards[-3:]):.3f}   {c.seconds:.0f}")


if __name__ == "__main__":
    main()
