"""The torch engine's batch as tensors: one row of next-token targets per packed sequence (``Layout``: the
trained tokens' mask, advantages, recorded logprobs and sampling settings at each target), each step's
advantage spread over its response tokens, and the sequences grouped into micro-batches by token budget."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from steptap.learner.rows import Batch


class Layout(NamedTuple):
    """The batch as next-token targets: one row per sequence, position t predicts input_ids[t + 1]."""

    ids: list[torch.Tensor]  # [L] per sequence
    mask: list[torch.Tensor]  # [L-1] bool: a trained response token
    adv: list[torch.Tensor]  # [L-1]
    recorded: list[torch.Tensor]  # [L-1] vLLM's raw logprobs (0 where masked)
    temp: list[torch.Tensor]  # [L-1] sampling temperature (1 where masked)
    top_p: list[torch.Tensor]
    top_k: list[torch.Tensor]
    vision: list[dict[str, Any] | None]  # a vision sequence's image inputs (rows.Sequence.vision)
    fresh: list[torch.Tensor]  # [L-1] bool: a trained token of a step the learner's current version sampled


def layout(batch: Batch, advs: torch.Tensor | None) -> Layout:
    """``batch`` laid out; ``advs``: each sample's advantage, None while it waits on the values (gae:
    ``fill_advantages``)."""
    out = Layout([], [], [], [], [], [], [], [], [])
    for seq in batch.sequences:
        n = len(seq.input_ids) - 1
        ids = torch.tensor(seq.input_ids, dtype=torch.long)
        mask, adv, rec = torch.zeros(n, dtype=torch.bool), torch.zeros(n), torch.zeros(n)
        temp, top_p, top_k = torch.ones(n), torch.ones(n), torch.zeros(n, dtype=torch.long)
        fresh = torch.zeros(n, dtype=torch.bool)  # a trained token the current version sampled
        for i in seq.samples:
            s = batch.samples[i]
            lo, hi = s.offset - 1, s.offset - 1 + len(s.response_ids)  # targets of the response tokens
            mask[lo:hi] = torch.tensor(s.weights()) > 0  # a stale token (weight 0) is out of the loss
            fresh[lo:hi] = mask[lo:hi] & (s.policy_version == batch.version)
            if advs is not None:
                adv[lo:hi] = advs[i]
            rec[lo:hi] = torch.tensor(s.logprobs)
            temp[lo:hi], top_p[lo:hi], top_k[lo:hi] = s.temperature, s.top_p, max(s.top_k, 0)
        for name, t in zip(Layout._fields, (ids, mask, adv, rec, temp, top_p, top_k, seq.vision, fresh),
                           strict=True):
            getattr(out, name).append(t)
    return out


def fill_advantages(lay: Layout, batch: Batch, step_adv: torch.Tensor) -> None:
    """Spread each step's advantage [S] over its response tokens (scaled by each token's staleness
    weight)."""
    for seq, adv in zip(batch.sequences, lay.adv, strict=False):
        for i in seq.samples:
            s = batch.samples[i]
            adv[s.offset - 1 : s.offset - 1 + len(s.response_ids)] = float(step_adv[i]) * torch.tensor(
                s.weights()
            )


def micro_batches(lengths: list[int], budget: int, solo: list[bool] | None = None) -> list[list[int]]:
    """Consecutive groups of sequences whose padded size (count x longest) fits the token ``budget``; a
    ``solo`` sequence (a vision one: its positions come from its own image grids) is a group alone."""
    groups: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    alone = solo or [False] * len(lengths)
    for i, n in enumerate(lengths):
        if cur and (alone[i] or alone[cur[0]] or (len(cur) + 1) * max(longest, n) > budget):
            groups.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    return groups + [cur] if cur else groups
