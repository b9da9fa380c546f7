"""The learner on vision steps (issue 23): rows, the torch engine's image inputs, the logprob check.

The "recorded" logprobs come from the tiny vision model itself: a response sampled with transformers
``generate`` (KV cache, M-RoPE deltas at generation time), its raw logprobs taken from generate's logits, as
vLLM records them. The learner recomputes them in one full forward pass with the images; exact means within
the tests' float32 tolerance (1e-4), the default ``vision_logprob_tol``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from vision_steps import DIGESTS, IMAGES, Recorder, blind, trajectories

from steptap.learner.config import LearnerConfig
from steptap.learner.engines.torch_engine import TorchEngine
from steptap.learner.metrics_log import update_row
from steptap.learner.rows import build_batch
from steptap.learner.vision import MISMATCH, UNRESOLVED, VisionInputs, check_message, pad_runs
from steptap.middleware.records import Trajectory

torch.set_num_threads(1)
TOL = LearnerConfig().vision_logprob_tol


@pytest.fixture(scope="module")
def vl_dir(vision_model_dir: Path) -> Path:
    return vision_model_dir


@pytest.fixture(scope="module")
def recorder(vl_dir: Path) -> Recorder:
    return Recorder(vl_dir)


@pytest.fixture(scope="module")
def trajs(recorder: Recorder) -> list[Trajectory]:
    return trajectories(recorder)


def _strip_images(trajs: list[Trajectory]) -> list[Trajectory]:
    import msgspec

    return [msgspec.structs.replace(t, steps=[msgspec.structs.replace(s, images=[]) for s in t.steps])
            for t in trajs]


def test_the_processor_agrees_with_the_expanded_prompt(recorder: Recorder) -> None:
    step = recorder.step(0, DIGESTS, "two", seed=0)
    got = recorder.inputs(step)
    assert isinstance(got, dict) and got["image_grid_thw"].shape == (2, 3)
    want = [int(g.prod()) // 4 for g in got["image_grid_thw"]]
    assert pad_runs(step.prompt_token_ids, recorder.pad) == want and want[0] != want[1]


def test_torch_engine_trains_vision_steps_on_the_recorded_logprobs(vl_dir: Path, recorder: Recorder,
                                                                    trajs: list[Trajectory]) -> None:
    """Vision steps: a sequence each (never packed), the learner's logprobs before the update are vLLM's
    (generate's) within the tolerance, the update is on-policy (ppo_kl ~ 0) and moves the weights. The same
    steps with their images dropped (the prompt's pad tokens read as text) differ: there the check fires."""
    batch = build_batch(trajs, version=0, vision=recorder.inputs)
    assert batch.counts["vision_steps"] == 6 and batch.counts["trained_steps"] == 6
    assert len(batch.sequences) == 6 and batch.counts["packed_steps"] == 0 and batch.has_vision
    assert all(len(s.images) in (1, 2) for s in batch.samples)

    eng = TorchEngine(LearnerConfig(model_dir=str(vl_dir), lr=1e-2, micro_batch_tokens=4096).validate())
    gap, tokens = eng.logprob_gap(batch)
    assert tokens == 6 * 6 and gap <= TOL, gap
    assert check_message(gap, TOL, tokens) is None
    before = {k: v.clone() for k, v in eng.model.state_dict().items()}
    stats = eng.train_step(batch)
    assert abs(stats.ppo_kl) < 1e-5 and stats.pg_clipfrac == 0.0 and stats.tokens == 36
    assert stats.grad_norm > 0
    moved = {k for k, v in eng.model.state_dict().items() if not torch.equal(v, before[k])}
    assert any("visual" in k for k in moved) and any("language_model" in k for k in moved)

    # Images dropped: the same tokens as text, trained as the text path would; the logprobs are not vLLM's
    eng.model.load_state_dict(before)
    text = build_batch(_strip_images(trajs), version=0, vision=recorder.inputs)
    assert not text.has_vision and text.counts["vision_steps"] == 0
    stats = eng.train_step(text)
    assert abs(stats.ppo_kl) > 100 * TOL
    # ... and the check on steps whose recorded logprobs came without the images (vLLM not seeing them) fires
    eng.model.load_state_dict(before)
    gap, tokens = eng.logprob_gap(build_batch(blind(recorder), version=0, vision=recorder.inputs))
    assert tokens == 6 and gap > 100 * TOL
    assert "vision check failed" in (check_message(gap, TOL, tokens) or "")


def test_lora_adapts_only_the_language_model(vl_dir: Path, recorder: Recorder,
                                             trajs: list[Trajectory]) -> None:
    eng = TorchEngine(LearnerConfig(model_dir=str(vl_dir), lora_rank=4, lora_alpha=8, lr=1e-2,
                                    lora_targets=("q_proj", "v_proj", "qkv", "fc1")).validate())
    trainable = [n for n, p in eng.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and "language_model" in n for n in trainable)
    batch = build_batch(trajs[:2], version=0, vision=recorder.inputs)
    gap, _ = eng.logprob_gap(batch)
    assert gap <= TOL  # the adapter starts at zero: the base model's logprobs
    assert eng.train_step(batch).grad_norm > 0


def test_unresolvable_or_mismatched_images_are_dropped_and_counted(vl_dir: Path, recorder: Recorder,
                                                                   trajs: list[Trajectory]) -> None:
    """Never trained as text: an image the resolver lacks, a grid the prompt disagrees with, a text policy."""
    known = {DIGESTS[0]: IMAGES[DIGESTS[0]]}  # the second image is not resolvable
    partial = VisionInputs(vl_dir, known.get)
    batch = build_batch(trajs, version=0, vision=partial)
    # t01 and t11 show both images: their one step each is dropped; the one-image steps train
    assert batch.counts[UNRESOLVED] == 2 and batch.counts["trained_steps"] == 4
    assert {s.trajectory_id for s in batch.samples} == {"t00", "t10"}
    row = update_row(1, batch, None, 0, 0.0)
    assert row["counts"][UNRESOLVED] == 2  # in the metrics like every other drop cause

    import msgspec

    step = trajs[0].steps[0]
    short = msgspec.structs.replace(step, prompt_token_ids=[t for i, t in enumerate(step.prompt_token_ids)
                                                            if not (t == recorder.pad and i % 5 == 0)])
    bad = [msgspec.structs.replace(trajs[0], steps=[short])]
    batch = build_batch(bad, version=0, vision=recorder.inputs)
    assert batch.counts[MISMATCH] == 1 and not batch.samples

    batch = build_batch(trajs[:1], version=0)  # a text policy: no vision inputs
    assert batch.counts["dropped_image_text_model"] == 2 and not batch.samples


def test_a_text_model_dir_is_not_a_vision_one(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="not a vision-language model"):
        VisionInputs(tiny_model_dir, IMAGES.get)


def test_the_daemon_checks_the_first_vision_batch_loudly(
    vl_dir: Path, recorder: Recorder, trajs: list[Trajectory], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The daemon builds the rows with its resolver, checks the first vision batch once: within the tolerance
    it notes the gap; beyond it an error line, and with vision_check = "stop" the learner stops."""
    from steptap.learner import daemon
    from steptap.learner.config import config_from_argv
    from steptap.learner.vision import VisionMismatch

    def learner(check: str) -> daemon.Learner:
        # A closed port: the learner asks the proxy nothing before train()
        return daemon.Learner(config_from_argv([
            "--proxy-url", "http://127.0.0.1:9", "--control-token", "t", "--model-dir", str(vl_dir),
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics-file", str(tmp_path / f"{check}.jsonl"),
            "--no-progress", "--num-threads", "1", "--vision-check", check]), resolve=IMAGES.get)

    unseen = blind(recorder)
    warn = learner("warn")
    assert warn.vision is not None
    with caplog.at_level(logging.ERROR, logger="steptap.learner"):
        gap = warn._vision_check(build_batch(unseen, version=warn.version, vision=warn.vision))
    assert gap is not None and gap > 100 * TOL
    assert any("vision check failed" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    assert warn._vision_check(build_batch(trajs, version=0, vision=warn.vision)) is None  # checked once

    stop = learner("stop")
    good = build_batch(trajs, version=stop.version, vision=stop.vision)
    assert good.counts["vision_steps"] == 6
    gap = stop._vision_check(good)
    assert gap is not None and gap <= TOL
    with pytest.raises(VisionMismatch, match="vision check failed"):
        learner("stop")._vision_check(build_batch(unseen, version=0, vision=stop.vision))


def test_verl_keeps_vision_position_ids_through_its_micro_batching() -> None:
    """verl 0.9.1 re-nests [4, L_i] position ids wrongly when it selects micro-batches (and nests a batch of
    one row on the 4): seen scrambled first, intact after the fixes (learner/engines/verl_vision.py)."""
    from verl.utils import tensordict_utils as tu

    from steptap.learner.engines.verl_vision import fix_nested_select, position_rows

    rows = [torch.arange(4 * n).view(4, n) for n in (23, 30, 41)]

    def td(parts: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        return tu.get_tensordict({"position_ids": torch.nested.as_nested_tensor(parts, layout=torch.jagged)})

    # verl's own re-nesting, unless this process fixed it already
    if not getattr(tu.nested_tensor_from_tensor_list, "steptap_fixed", False):
        picked = tu.index_select_tensor_dict(td(rows), [2, 0])
        # [2, j, 64]: the lengths summed into a dimension, which later splits and paddings read
        assert picked["position_ids"].size(2) == 23 + 41
    one = td(rows[:1])
    assert one["position_ids"]._ragged_idx == 1  # as_nested_tensor took the 4 as ragged
    position_rows(one)
    fix_nested_select()
    fix_nested_select()  # idempotent
    assert one["position_ids"]._ragged_idx == 2 and torch.equal(one["position_ids"].unbind()[0], rows[0])
    picked = tu.index_select_tensor_dict(td(rows), [2, 0])
    assert picked["position_ids"].size(1) == 4 and picked["position_ids"]._ragged_idx == 2
    again = tu.index_select_tensor_dict(picked, [1])
    got = [p for t in (picked, again) for p in t["position_ids"].unbind()]
    assert all(torch.equal(a, b) for a, b in zip(got, [rows[2], rows[0], rows[0]], strict=True))
