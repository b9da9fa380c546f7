"""algos.py calls verl's functions: the learner's advantages and losses equal verl's core_algos applied
directly to the same tensors (for grpo, rloo, reinforce_plus_plus, vanilla and gspo), and the learner's
per-sample path (rows -> algos.compute_advantages) puts the return where verl expects it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
from verl.workers.config import ActorConfig
from verl.workers.config.actor import PolicyLossConfig

from steptap.learner import algos
from steptap.learner.config import LearnerConfig
from steptap.learner.rows import Sample

torch.set_num_threads(1)


def _samples() -> list[Sample]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for g in range(3):
        for k in range(4):
            n = 2 + (g * 4 + k) % 5
            out.append(Sample(trajectory_id=f"t{g}{k}", group=f"g{g}", step_index=0,
                              response_ids=list(range(n)), logprobs=[-1.0] * n, temperature=1.0, top_p=1.0,
                              top_k=-1, policy_version=0, ret=float(torch.rand(1, generator=gen))))
    return out


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus"])
def test_advantages_equal_verl(name: str) -> None:
    samples = _samples()
    cfg = LearnerConfig(model_dir="x", algorithm=name)
    ours = algos.compute_advantages(samples, cfg)

    # The same data built by hand, straight into verl.
    width = max(len(s.response_ids) for s in samples)
    scores, mask = torch.zeros(len(samples), width), torch.zeros(len(samples), width)
    for i, s in enumerate(samples):
        mask[i, : len(s.response_ids)] = 1
        scores[i, len(s.response_ids) - 1] = s.ret
    index = np.array([s.group for s in samples], dtype=object)
    if name == "grpo":
        ref, _ = core_algos.compute_grpo_outcome_advantage(scores, mask, index, norm_adv_by_std_in_grpo=True)
    elif name == "rloo":
        ref, _ = core_algos.compute_rloo_outcome_advantage(scores, mask, index, config=AlgoConfig())
    else:
        ref, _ = core_algos.compute_reinforce_plus_plus_outcome_advantage(scores, mask,
                                                                          config=AlgoConfig(gamma=1.0))
    for i, s in enumerate(samples):
        torch.testing.assert_close(ours[i], ref[i, : len(s.response_ids)], rtol=0, atol=0)
    # And the result is not trivial: advantages differ within a group.
    assert torch.stack([a[0] for a in ours]).std() > 0.1


def test_staleness_weight_scales_the_advantage() -> None:
    samples = _samples()
    base = algos.compute_advantages(samples, LearnerConfig(model_dir="x"))
    samples[0].weight = 0.25
    scaled = algos.compute_advantages(samples, LearnerConfig(model_dir="x"))
    torch.testing.assert_close(scaled[0], base[0] * 0.25)
    torch.testing.assert_close(scaled[1], base[1])


def _loss_inputs(seed: int = 1) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    b, t = 6, 9
    old = -torch.rand(b, t, generator=gen) * 3
    new = (old + torch.randn(b, t, generator=gen) * 0.4).requires_grad_(True)
    adv = torch.randn(b, t, generator=gen)
    mask = torch.rand(b, t, generator=gen) > 0.25
    return old, new, adv, mask


@pytest.mark.parametrize("loss", ["vanilla", "gspo"])
def test_policy_loss_equals_verl(loss: str) -> None:
    old, new, adv, mask = _loss_inputs()
    cfg = LearnerConfig(model_dir="x", policy_loss=loss, clip_ratio_low=0.2, clip_ratio_high=0.28)
    ours, metrics = algos.policy_loss(algos.actor_config(cfg), new, old, adv, mask)

    direct_cfg = ActorConfig(strategy="fsdp", rollout_n=8, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
                             clip_ratio_low=0.2, clip_ratio_high=0.28,
                             policy_loss=PolicyLossConfig(loss_mode=loss))
    fn = core_algos.compute_policy_loss_vanilla if loss == "vanilla" else core_algos.compute_policy_loss_gspo
    ref, ref_metrics = fn(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
                          loss_agg_mode="token-mean", config=direct_cfg)
    torch.testing.assert_close(ours, ref)
    assert metrics["pg_clipfrac"] == pytest.approx(ref_metrics["actor/pg_clipfrac"])
    assert metrics["pg_clipfrac"] > 0  # the inputs do reach the clip
    # Gradients are verl's too.
    (g_ours,) = torch.autograd.grad(ours, new)
    (g_ref,) = torch.autograd.grad(fn(old_log_prob=old, log_prob=new, advantages=adv, response_mask=mask,
                                      loss_agg_mode="token-mean", config=direct_cfg)[0], new)
    torch.testing.assert_close(g_ours, g_ref)


def test_micro_batches_with_global_batch_info_sum_to_the_whole_batch_loss() -> None:
    """Gradient accumulation: each micro-batch's loss is its share of the whole batch (verl
    global_batch_info)."""
    old, new, adv, mask = _loss_inputs(2)
    actor = algos.actor_config(LearnerConfig(model_dir="x"))
    whole, _ = algos.policy_loss(actor, new, old, adv, mask)
    n_tok = int(mask.sum())
    parts = [algos.policy_loss(actor, new[s], old[s], adv[s], mask[s], batch_num_tokens=n_tok,
                               global_batch_size=6)[0] for s in (slice(0, 2), slice(2, 6))]
    torch.testing.assert_close(parts[0] + parts[1], whole)


def test_kl_and_entropy_terms_are_verl_kl_penalty_and_agg_loss() -> None:
    old, new, adv, mask = _loss_inputs(3)
    refp = old + 0.1
    ent = torch.rand_like(old)
    cfg = LearnerConfig(model_dir="x", kl_coef=0.05, kl_type="low_var_kl", entropy_coef=0.01)
    actor = algos.actor_config(cfg)
    total, metrics = algos.policy_loss(actor, new, old, adv, mask, ref_log_prob=refp, entropy=ent)
    pg, _ = algos.policy_loss(algos.actor_config(LearnerConfig(model_dir="x")), new, old, adv, mask)
    kl = core_algos.agg_loss(core_algos.kl_penalty(new, refp, "low_var_kl"), mask, "token-mean")
    en = core_algos.agg_loss(ent, mask, "token-mean")
    torch.testing.assert_close(total, pg - 0.01 * en + 0.05 * kl)
    assert metrics["kl_loss"] == pytest.approx(float(kl.detach()))


def test_rollout_correction_is_verl_truncated_importance_sampling() -> None:
    old, _, _, mask = _loss_inputs(4)
    behaviour = old - torch.rand_like(old)  # the sampler put less mass on these tokens
    cfg = LearnerConfig(model_dir="x", rollout_is="token", rollout_is_threshold=2.0)
    w, new_mask, metrics = algos.rollout_correction(cfg, old, behaviour, mask)
    ref, ref_mask, _ = compute_rollout_correction_and_rejection_mask(old, behaviour, mask, rollout_is="token",
                                                                      rollout_is_threshold=2.0)
    torch.testing.assert_close(w, ref.batch["rollout_is_weights"])
    assert torch.equal(new_mask, ref_mask)
    assert float(w[mask].max()) <= 2.0 + 1e-6 and float(w[mask].min()) >= 1.0  # truncated at the threshold
    assert "rollout_corr/rollout_is_mean" in metrics
