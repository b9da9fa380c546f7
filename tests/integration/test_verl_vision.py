"""The verl engine on vision steps (issue 23): verl's TrainingWorker (FSDP2, a CPU worker over gloo on the
session's Ray cluster) gets each vision row's ``multi_modal_inputs`` and M-RoPE ``position_ids``; before
the update its logprobs are the recorded ones (transformers ``generate``'s, as vLLM records them) within the
tests' tolerance, a step whose recorded logprobs were taken without its image is caught by the check, and
the update is the torch engine's (the same gradient norm on the same batch)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vision_steps import Recorder, blind, trajectories

from steptap.learner.config import LearnerConfig
from steptap.learner.engines.torch_engine import TorchEngine
from steptap.learner.rows import build_batch

torch.set_num_threads(1)
TOL = LearnerConfig().vision_logprob_tol


@pytest.fixture(scope="module")
def vl_dir(vision_model_dir: Path) -> Path:
    return vision_model_dir


def test_verl_engine_trains_vision_steps_as_the_torch_engine_does(ray_cluster, vl_dir: Path) -> None:
    from steptap.learner.engines.verl_engine import VerlEngine

    recorder = Recorder(vl_dir)
    batch = build_batch(trajectories(recorder), version=0, vision=recorder.inputs)
    assert batch.counts["vision_steps"] == 6 and len(batch.sequences) == 6
    fields = dict(model_dir=str(vl_dir), lr=1e-2, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1.0,
                  truncation_mode="drop", micro_batch_tokens=4096)
    torch_stats = TorchEngine(LearnerConfig(**fields).validate()).train_step(batch)  # type: ignore[arg-type]

    eng = VerlEngine(LearnerConfig(**fields, engine="verl").validate())  # type: ignore[arg-type]
    try:
        gap, tokens = eng.logprob_gap(batch)
        assert tokens == 36 and gap <= TOL, gap
        unseen, _ = eng.logprob_gap(build_batch(blind(recorder), version=0, vision=recorder.inputs))
        assert unseen > 100 * TOL
        stats = eng.train_step(batch)
        assert abs(stats.ppo_kl) < 1e-5 and stats.pg_clipfrac == 0.0 and stats.tokens == 36
        # The same gradient: float32 reduction order is all that differs (test_verl_engine.py measures it)
        assert stats.grad_norm == pytest.approx(torch_stats.grad_norm, rel=1e-4)
        after, _ = eng.logprob_gap(batch)
        assert after > 100 * TOL  # the update moved the policy
    finally:
        eng.close()
