"""What the daemon needs from an engine, and the factory that picks one by ``LearnerConfig.engine``.

An engine owns the policy (and its optimizer) wherever it lives: in this process (``torch``) or in a Ray
worker group (``verl``). The daemon only ever calls:

- ``train_step(batch) -> StepStats``: one update on a ``rows.Batch`` (advantages, loss, backward, optimizer);
- ``write_weights(out_dir, version) -> Path``: the current policy as a fresh directory vLLM can load (an HF
  safetensors model directory, or a peft adapter when ``lora`` is true), handed to
  ``publish.publish_written``;
- ``state_dict()`` / ``load_state_dict(state)``: the engine's part of a checkpoint, tensors and plain values
  only (``checkpoint.py`` stores it as safetensors + JSON);
- ``logprob_gap(batch) -> (gap, tokens)``: the vision check, before any update on the batch;
- ``close()``: release workers and processes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple, Protocol

from steptap.learner.config import LearnerConfig
from steptap.learner.rows import Batch


class StepStats(NamedTuple):
    loss: float
    pg_clipfrac: float
    ppo_kl: float  # behaviour (or proximal) -> current policy, on the trained tokens
    kl: float  # to the reference (0 without one)
    entropy: float
    grad_norm: float
    tokens: int  # trained (response) tokens
    seq_tokens: int  # tokens forwarded (prompts included, padding excluded)
    seconds: float
    rollout_is_mean: float = 1.0
    value_loss: float = 0.0  # gae: the value head's loss (0 otherwise)
    value_mean: float = 0.0  # gae: mean value at the steps' action boundaries, before the update
    # mean |vLLM's recorded logprob - the policy's own, raw (temperature 1), before the update| over the
    # trained tokens sampled by the learner's current version (learner/health.py); gap_tokens 0: not measured
    logprob_gap: float = 0.0
    gap_tokens: int = 0


class Engine(Protocol):
    lora: bool  # publishes a peft adapter (LoRA) rather than full weights

    def train_step(self, batch: Batch) -> StepStats: ...

    def write_weights(self, out_dir: str | Path, version: int | None = None) -> Path: ...

    def named_weights(self) -> list[tuple[str, Any]]: ...  # full weights (HF names) for a collective publish

    def state_dict(self) -> dict[str, Any]: ...

    # The vision check (learner/vision.py): the largest gap to the recorded logprobs, and tokens compared
    def logprob_gap(self, batch: Batch) -> tuple[float, int]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def make_engine(cfg: LearnerConfig) -> Engine:
    """The engine ``cfg.engine`` names; imports only what that engine needs."""
    if cfg.engine == "verl":
        from steptap.learner.engines.verl_engine import VerlEngine

        return VerlEngine(cfg)
    from steptap.learner.engines.torch_engine import TorchEngine

    return TorchEngine(cfg)
