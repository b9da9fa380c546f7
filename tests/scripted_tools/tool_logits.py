"""Loaded into vLLM's process (test infrastructure): a logits processor that makes the model call tools.

``--logits-processors tool_logits:ScriptedReplies`` with this folder (tests/scripted_tools) on ``PYTHONPATH``
and ``STEPTAP_TOOL_SCRIPT`` naming a script (tool_script.py; ``tool_script.server_options`` gives both). A
request whose last turn matches a rule gets the rule's reply forced token by token, then ``<|im_end|>``; any
other request is left alone. The model and the sampler stay real: vLLM's
default ``--logprobs-mode raw_logprobs`` computes the returned logprobs from the model's logits *before* any
logits processor, so each forced token carries the model's own logprob, which a transformers forward pass
recomputes exactly (docs/platform.md). Runs in vLLM's venv: imports torch and vllm, never steptap.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
from tool_script import SCRIPT_ENV, choose, last_turn, load_script
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig


class ScriptedReplies(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        from transformers import AutoTokenizer

        path = os.environ.get(SCRIPT_ENV)
        if not path:
            raise ValueError(f"{SCRIPT_ENV} must name the tool script this logits processor follows")
        self.rules = load_script(path)
        tokenizer = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)
        self.im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.tokenizer = tokenizer
        # batch index -> (forced ids, the request's live output ids)
        self.forced: dict[int, tuple[list[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token wins

    def _new(self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]):
        if prompt_ids is None:
            return None
        try:  # an exception here would kill vLLM's engine: a request the script cannot serve samples freely
            decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
            reply = choose(self.rules, last_turn(prompt_ids, self.im_start, decode))
            if reply is None:
                return None
            # The text the client gets back decodes from exactly these ids; <|im_end|> ends the turn.
            return self.tokenizer.encode(reply, add_special_tokens=False) + [self.end], output_ids
        except Exception:
            logger.exception("tool script: request left unscripted")
            return None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.forced, batch_update, self._new)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (ids, output_ids) in self.forced.items():
            step = len(output_ids)
            if step < len(ids):
                token = ids[step]
                logits[row].fill_(float("-inf"))
                logits[row, token] = 0.0
        return logits
