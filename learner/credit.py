"""What a trained step is credited with: its return, its own reward, and the weight of each of its tokens.

Returns (documented choice): a step's return is the discounted sum of the per-step (process) rewards from that
step on, plus the trajectory reward discounted from the last step,
``return_k = sum_{j>=k} gamma^(j-k) r_j + gamma^(n-1-k) R``, with n the trajectory's step count. With no
process rewards and gamma = 1 every step of a trajectory gets the trajectory reward. The advantage estimator
then normalises over every trained step of the group (``group_id``), see ``algos.compute_advantages``.

Step rewards (for ``algorithm = "gae"``, step-level credit with a value model): a step's own reward is its
process rewards (``Step.rewards``, given on that step), plus the trajectory reward on the last step. A dropped
step cannot carry credit, so its reward moves to the closest trained step before it (discounted by gamma per
step between them; ``rows.build_batch`` moves it); rewards before the first trained step precede every
trained action and are not used.

Staleness is per token: each token's weight comes from the version that sampled it (``Step.version_spans``).
"""

from __future__ import annotations

from steptap.middleware.records import Step


def step_returns(steps: list[Step], final_reward: float, gamma: float) -> list[float]:
    """Per-step discounted returns, in step order: process rewards, plus ``final_reward`` after the last."""
    out = [0.0] * len(steps)
    running = final_reward  # arrives with the last step (not discounted there)
    for k in range(len(steps) - 1, -1, -1):
        running = float(sum(steps[k].rewards.values())) + (gamma * running if k < len(steps) - 1 else running)
        out[k] = running
    return out


def step_rewards(steps: list[Step], final_reward: float) -> list[float]:
    """Each step's own reward, in step order: its process rewards, plus ``final_reward`` on the last step."""
    out = [float(sum(s.rewards.values())) for s in steps]
    if out:
        out[-1] += final_reward
    return out


def stale_weights(versions: list[int], version: int, max_staleness: int, stale_mode: str, decay: float
                  ) -> list[float]:
    """Each token's staleness weight from the version that sampled it: 1 when fresh; past ``max_staleness``,
    0 (``drop``: out of the loss) or ``decay ** (lag - max_staleness)`` (``downweight``)."""
    if max_staleness < 0:
        return [1.0] * len(versions)
    out = []
    for v in versions:
        lag = version - v
        out.append(1.0 if lag <= max_staleness else 0.0 if stale_mode == "drop"
                   else decay ** (lag - max_staleness))
    return out
