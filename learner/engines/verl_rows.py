"""A steptap batch as verl's rows (the ``verl`` engine's layout): one row per steptap sequence (a step, or an
``extends`` chain packed into one); the first step's prompt is verl's prompt (left-padded later), the rest its
response (right-padded), with the mask set on the steps' response tokens only, as verl lays out multi-turn
rollouts. Rows are padded to a multiple of the workers with one-token rows that train nothing."""

from __future__ import annotations

from typing import Any

import torch

from steptap.learner.rows import Batch


def verl_rows(batch: Batch, advs: list[torch.Tensor], workers: int, pad_id: int) -> dict[str, Any]:
    """``advs``: each sample's token advantages (algos.compute_advantages). Per row: prompt, response, mask
    (a trained token), advantages, vLLM's recorded logprobs, temperature, vision inputs, and ``fresh`` (a
    trained token the learner's current version sampled: the logprob gap's, learner/health.py)."""
    seqs = list(batch.sequences)
    n_pad = -len(seqs) % workers  # every worker gets the same number of rows
    prompts: list[torch.Tensor] = []
    responses: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    advantages: list[torch.Tensor] = []
    recorded: list[torch.Tensor] = []
    fresh: list[torch.Tensor] = []
    temps: list[float] = []
    visions = [seq.vision for seq in seqs] + [None] * n_pad  # a vision row's image inputs
    for seq in seqs:
        first = batch.samples[seq.samples[0]]
        p = first.offset  # the first step's response starts here: everything before is verl's prompt
        resp = seq.input_ids[p:]
        mask, adv, rec, new = (torch.zeros(len(resp)) for _ in range(4))
        for i in seq.samples:
            s = batch.samples[i]
            lo, hi = s.offset - p, s.offset - p + len(s.response_ids)
            # a stale token (weight 0) is out of the mask, so out of the loss and of rollout correction too
            mask[lo:hi] = (torch.tensor(s.weights()) > 0).float()
            adv[lo:hi], rec[lo:hi] = advs[i], torch.tensor(s.logprobs)
            new[lo:hi] = mask[lo:hi] * float(s.policy_version == batch.version)
        temps.append(first.temperature)
        prompts.append(torch.tensor(seq.input_ids[:p]))
        responses.append(torch.tensor(resp))
        for lst, t in ((masks, mask), (advantages, adv), (recorded, rec), (fresh, new)):
            lst.append(t)
    for _ in range(n_pad):  # a one-token row with nothing to train: weightless under any loss aggregation
        prompts.append(torch.tensor([pad_id]))
        responses.append(torch.tensor([pad_id]))
        for lst in (masks, advantages, recorded, fresh):
            lst.append(torch.zeros(1))
        temps.append(1.0)
    return dict(prompts=prompts, responses=responses, mask=masks, adv=advantages, recorded=recorded,
                temps=temps, n_real=len(seqs), vision=visions, fresh=fresh)
