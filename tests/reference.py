"""The reference the captured logprobs are checked against: a float32 transformers forward pass.

vLLM returns raw logprobs (before temperature) by default, so `temperature=1.0` is the matching default.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any


@functools.lru_cache(maxsize=4)
def _load(model_dir: str, adapter_dir: str | None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(min(2, torch.get_num_threads()))  # the test machine's cores are shared
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


def _response_logprobs(
    model_dir: str | Path, prompt_ids: list[int], response_ids: list[int], temperature: float,
    adapter_dir: str | Path | None,
) -> Any:
    """[R, V] log-softmax at each response position, from one forward pass over prompt + response."""
    import torch

    model = _load(str(Path(model_dir).resolve()), None if adapter_dir is None
                  else str(Path(adapter_dir).resolve()))
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])  # [1, P+R]
    with torch.no_grad():
        logits = model(ids).logits[0].float()  # [P+R, V]
    # Position t predicts token t+1: the response's logits start one before it.
    start = len(prompt_ids) - 1
    return torch.log_softmax(logits[start : start + len(response_ids)] / temperature, dim=-1)  # [R, V]


def reference_logprobs(
    model_dir: str | Path,
    prompt_ids: list[int],
    response_ids: list[int],
    temperature: float = 1.0,
    adapter_dir: str | Path | None = None,
) -> list[float]:
    """log p(response_ids[i] | prompt_ids + response_ids[:i]) for each i, from one forward pass."""
    import torch

    logprobs = _response_logprobs(model_dir, prompt_ids, response_ids, temperature, adapter_dir)
    return logprobs.gather(1, torch.tensor(response_ids)[:, None])[:, 0].tolist()


def reference_argmax(model_dir: str | Path, prompt_ids: list[int], response_ids: list[int],
                     exclude: Sequence[int] = ()) -> list[int]:
    """The model's most likely token at each response position (given the response so far), ``exclude``d ids
    left out (the stop tokens vLLM masks under ``min_tokens``): a greedy reply the model sampled on its own
    equals this."""
    logprobs = _response_logprobs(model_dir, prompt_ids, response_ids, 1.0, None)  # [R, V]
    logprobs[:, list(exclude)] = float("-inf")
    return logprobs.argmax(dim=-1).tolist()


def _common(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def reference_logprobs_of(model_dir: str | Path, calls: Sequence[tuple[list[int], list[int]]],
                          temperature: float = 1.0) -> list[list[float]]:
    """``reference_logprobs`` of several (prompt, response) pairs, one forward pass per token sequence: a pair
    whose ids are the start of a longer pair's prompt (an agent's earlier turn) is read from that pair's pass.
    An agent session of 40k-token prompts costs one pass, not one per call; and a sequence that shares a start
    with the one before (an agent whose turns do not extend each other, but keep its long system prompt) is
    computed from that start's cached keys and values, so only its new tail is run (an exact computation:
    causal attention at a position reads only the positions before it)."""
    import torch
    from transformers import DynamicCache

    seqs = [list(p) + list(r) for p, r in calls]
    # each pair's covering sequence: the longest one that starts with all of its ids
    cover = [max((j for j, s in enumerate(seqs) if s[: len(seq)] == seq), key=lambda j: len(seqs[j]))
             for seq in seqs]
    out: list[list[float]] = [[] for _ in calls]
    model = _load(str(Path(model_dir).resolve()), None)
    cache, cached = DynamicCache(), []  # the keys and values of the ids in ``cached``
    for j in sorted(set(cover)):
        covered = [i for i, c in enumerate(cover) if c == j]
        first = min(len(calls[i][0]) - 1 for i in covered)  # position t predicts token t+1
        keep = min(_common(cached, seqs[j]), first)  # every logit this sequence needs comes after ``keep``
        cache.crop(keep)
        with torch.no_grad():
            logits = model(torch.tensor([seqs[j][keep:]]), past_key_values=cache,
                           use_cache=True).logits[0].float()  # [T - keep, V]
        cached = seqs[j]
        for i in covered:
            prompt, response = calls[i]
            start = len(prompt) - 1 - keep
            lp = torch.log_softmax(logits[start : start + len(response)] / temperature, dim=-1)
            out[i] = lp.gather(1, torch.tensor(list(response))[:, None])[:, 0].tolist()
    return out
