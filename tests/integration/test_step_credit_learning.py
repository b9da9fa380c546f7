"""Step-level GAE learns: on the tiny model, in-process (transformers sampling, no vLLM), a seeded run of the
two-step task in ``bench/step_credit.py`` (a process reward on step 1, the trajectory reward after step 2)
raises the mean reward clearly above its start. The same script compares GAE with GRPO
(docs/step-credit.md)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import step_credit  # noqa: E402


def test_step_level_gae_raises_the_reward_on_a_two_step_task(tiny_model_dir: Path) -> None:
    curve = step_credit.run(str(tiny_model_dir), "gae", updates=14, seed=0, stop_gain=0.3, prompts=2).rewards
    print(f"gae: reward {curve[0]:.3f} -> {curve[-1]:.3f} in {len(curve)} updates: "
          f"{[round(c, 3) for c in curve]}")
    assert curve[0] < 0.15  # the task starts hard
    assert min(curve[-2:]) > curve[0] + 0.3, curve  # and the last two batches are far above it
