"""Advantages, policy losses and rollout correction, by name, from ``verl.trainer.ppo.core_algos``.

Nothing here re-implements an algorithm: each function shapes the learner's data the way verl's trainer
does (``ray_trainer.compute_advantage``, ``workers/utils/losses.ppo_loss``) and calls verl's function.

- Advantages: one row per trained step, ``token_level_rewards`` [S, T] with the step's return at its last
  response token, ``response_mask`` [S, T], ``index`` = group ids (numpy object array). The group index is the
  trajectory's ``group_id``, so every trained step of the group's members is normalised together (documented
  choice; with one step per trajectory this is exactly GRPO/RLOO). Step discounting is already folded into the
  return (credit.step_returns), so verl's token-level ``gamma`` (REINFORCE++) is 1.
- Policy loss: ``get_policy_loss_fn(name)`` with an ``ActorConfig``; the micro-batch's share of the global
  batch goes in the config's ``global_batch_info`` (batch_num_tokens, global_batch_size), as verl's ppo_loss
  does, so gradient accumulation over micro-batches equals one pass over the whole batch.
- Step-level GAE (``algorithm = "gae"``): verl's ``compute_gae_advantage_return`` is token-level; laid out
with
  one *column per step* instead of per token it is GAE over steps: row = trajectory, column k = its k-th
  trained step, reward = the step's own reward (credit.step_rewards), value = the value head at the step's
  action boundary. verl then discounts across steps with gamma and lambda, whitens over every trained step of
  the batch, and returns the value targets; each step's advantage is spread over its response tokens (the
  policy loss stays token-level). The value head's loss is verl's clipped ``compute_value_loss``.
- KL to a reference: ``kl_penalty`` + ``agg_loss``. Rollout correction: verl's
  ``compute_rollout_correction_and_rejection_mask`` (truncated IS weights, optional rejection sampling).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
from verl.workers.config import ActorConfig
from verl.workers.config.actor import PolicyLossConfig

from steptap.learner.config import LearnerConfig
from steptap.learner.rows import Sample


def actor_config(cfg: LearnerConfig) -> ActorConfig:
    """The verl ``ActorConfig`` the policy-loss functions read (clip ratios, aggregation, loss mode)."""
    return ActorConfig(
        strategy="fsdp",  # required by the dataclass; unused by the loss functions
        rollout_n=cfg.group_size,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=cfg.clip_ratio_low,
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_c=cfg.clip_ratio_c,
        loss_agg_mode=cfg.loss_agg_mode,
        entropy_coeff=cfg.entropy_coef,
        use_kl_loss=cfg.kl_coef > 0,
        kl_loss_coef=cfg.kl_coef,
        kl_loss_type=cfg.kl_type,
        policy_loss=PolicyLossConfig(loss_mode=cfg.policy_loss),
    )


def outcome_tensors(samples: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """``token_level_rewards`` [S, T] (return at the last response token), ``response_mask`` [S, T], index."""
    width = max(len(s.response_ids) for s in samples)
    rewards = torch.zeros(len(samples), width)
    mask = torch.zeros(len(samples), width)
    for i, s in enumerate(samples):
        n = len(s.response_ids)
        mask[i, :n] = 1.0
        rewards[i, n - 1] = s.ret
    index = np.array([s.group for s in samples], dtype=object)
    return rewards, mask, index


def estimate_advantages(
    name: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    norm_adv_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's estimator ``name`` called as verl's trainer calls it. Returns (advantages, returns), [S, T]."""
    fn = core_algos.get_adv_estimator_fn(name)
    if name == "grpo":
        return fn(token_level_rewards=token_level_rewards, response_mask=response_mask, index=index,
                  norm_adv_by_std_in_grpo=norm_adv_by_std)
    kwargs: dict[str, Any] = dict(token_level_rewards=token_level_rewards, response_mask=response_mask,
                                  config=AlgoConfig(gamma=1.0, lam=1.0, adv_estimator=name,
                                                    norm_adv_by_std_in_grpo=norm_adv_by_std))
    kwargs["index"] = index
    return fn(**kwargs)


def compute_advantages(samples: list[Sample], cfg: LearnerConfig) -> list[torch.Tensor]:
    """Per-sample token advantages [len(response)], scaled by each token's staleness weight."""
    rewards, mask, index = outcome_tensors(samples)
    adv, _ = estimate_advantages(cfg.algorithm, rewards, mask, index, cfg.norm_adv_by_std)
    return [adv[i, : len(s.response_ids)] * torch.tensor(s.weights(), dtype=adv.dtype) for i,
            s in enumerate(samples)]


def step_gae(samples: list[Sample], values: torch.Tensor, gamma: float, lam: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over steps: ``values`` [S] (one per sample, at its action boundary) -> (advantages [S], returns
    [S]).

    Samples of one trajectory must be consecutive and in step order (``rows.build_batch`` makes them so). With
    r_k, V_k the k-th step's reward and value (V after the last step = 0):
    delta_k = r_k + gamma V_{k+1} - V_k, A_k = delta_k + gamma lam A_{k+1}, return_k = A_k + V_k; the
    advantages are then whitened over the batch's steps (a batch of one step has no spread to whiten:
    advantage 0)."""
    if len(samples) < 2:  # return = r (nothing follows); no spread to whiten
        return torch.zeros_like(values), torch.tensor([s.reward for s in samples], dtype=values.dtype)
    rows: list[list[int]] = []
    for i, s in enumerate(samples):
        if i and s.trajectory_id == samples[i - 1].trajectory_id:
            rows[-1].append(i)
        else:
            rows.append([i])
    width = max(len(r) for r in rows)
    rewards = torch.zeros(len(rows), width, dtype=values.dtype)  # [trajectories, steps]
    vals = torch.zeros_like(rewards)
    mask = torch.zeros_like(rewards)
    for r, members in enumerate(rows):
        for k, i in enumerate(members):
            rewards[r, k], vals[r, k], mask[r, k] = samples[i].reward, values[i], 1.0
    adv, ret = core_algos.compute_gae_advantage_return(token_level_rewards=rewards, values=vals,
                                                       response_mask=mask, gamma=gamma, lam=lam)
    index = [(r, k) for r, members in enumerate(rows) for k in range(len(members))]
    pick = torch.tensor([r for r, _ in index]), torch.tensor([k for _, k in index])
    return adv[pick], ret[pick]


def value_loss(vpreds: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor, clip: float,
               num_steps: int) -> tuple[torch.Tensor, float]:
    """verl's clipped value loss for one micro-batch's steps ([n] each), scaled as its share of the batch's
    ``num_steps`` (so accumulating micro-batches equals one pass). Returns (loss, clip fraction)."""
    ones = torch.ones_like(vpreds)[None]
    loss, clipfrac = core_algos.compute_value_loss(
        vpreds=vpreds[None], returns=returns[None], values=old_values[None], response_mask=ones,
        cliprange_value=clip, loss_agg_mode="token-mean", batch_num_tokens=num_steps)
    return loss, float(clipfrac)


def policy_loss(
    actor: ActorConfig,
    log_prob: torch.Tensor,  # [B, T] current policy, with grad
    old_log_prob: torch.Tensor,  # [B, T] behaviour (bypass) or proximal (decoupled) policy
    advantages: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T] bool
    *,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    ref_log_prob: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's PPO loss for one micro-batch (policy loss, minus entropy bonus, plus KL loss), as
    ``verl.workers.utils.losses.ppo_loss`` combines them. Metrics are plain floats."""
    info = actor.global_batch_info
    info["dp_size"] = 1
    info["batch_num_tokens"] = batch_num_tokens
    info["global_batch_size"] = global_batch_size
    info["loss_scale_factor"] = actor.loss_scale_factor
    fn = core_algos.get_policy_loss_fn(actor.policy_loss.loss_mode)
    pg_loss, pg_metrics = fn(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        loss_agg_mode=actor.loss_agg_mode,
        config=actor,
        rollout_is_weights=rollout_is_weights,
    )
    metrics = {k.removeprefix("actor/"): float(v) for k, v in pg_metrics.items()}
    metrics["pg_loss"] = float(pg_loss.detach())
    loss = pg_loss
    if entropy is not None and actor.entropy_coeff:
        ent = core_algos.agg_loss(loss_mat=entropy, loss_mask=response_mask,
                                  loss_agg_mode=actor.loss_agg_mode,
                                  **info)
        loss = loss - actor.entropy_coeff * ent
    if ref_log_prob is not None and actor.use_kl_loss:
        kld = core_algos.kl_penalty(logprob=log_prob, ref_logprob=ref_log_prob, kl_penalty=actor.kl_loss_type)
        kl_loss = core_algos.agg_loss(loss_mat=kld, loss_mask=response_mask,
                                      loss_agg_mode=actor.loss_agg_mode,
                                      **info)
        loss = loss + actor.kl_loss_coef * kl_loss
        metrics["kl_loss"] = float(kl_loss.detach())
    return loss, metrics


def rollout_correction(
    cfg: LearnerConfig,
    proximal_log_prob: torch.Tensor,  # [B, T] the learner's own logprobs before this update
    behaviour_log_prob: torch.Tensor,  # [B, T] the sampler's
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """verl's truncated importance sampling (and optional rejection sampling) for the decoupled loss:
    weights ~ min(pi_proximal / pi_behaviour, threshold). Returns (weights or None, new mask, metrics)."""
    weights, new_mask, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=proximal_log_prob,
        rollout_log_prob=behaviour_log_prob,
        response_mask=response_mask,
        rollout_is=None if cfg.rollout_is == "none" else cfg.rollout_is,
        rollout_is_threshold=cfg.rollout_is_threshold,
        rollout_rs=cfg.rollout_rs or None,
        rollout_rs_threshold=cfg.rollout_rs_threshold or None,
    )
    w = weights.batch["rollout_is_weights"] if weights is not None else None
    return w, new_mask, {k: float(v) for k, v in metrics.items()}
