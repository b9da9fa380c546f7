"""The ``torch`` engine: one process, CPU or one GPU, a transformers causal LM, verl's losses.

``TorchEngine.train_step(batch)`` does one update on a ``rows.Batch``: lay the packed sequences out as
next-token targets (learner/engines/torch_layout.py), find the behaviour logprobs (see below), compute verl
advantages, then for each epoch run micro-batches (by token budget) forward + backward with gradient
accumulation, clip, and one AdamW step.

Behaviour logprobs. vLLM records raw logprobs (before temperature and top-p/top-k). For a step sampled at
temperature 1 without truncation they *are* the behaviour policy. Otherwise the learner measures, with its own
weights before the update (one no-grad "proximal" pass), how much temperature and truncation change each
sampled token's logprob, and shifts the recorded value by that: behaviour = recorded + (sampler(T, top-p,
top-k) - raw). This is exact when the learner's weights are the sampler's and keeps the recorded staleness
otherwise. The current policy's logprobs always use logits / T, untruncated.

Loss modes (verl's): without rollout correction ("bypass", the default) PPO's ratio is taken against the
behaviour logprobs directly, so the clip handles the mismatch. With ``rollout_is`` set ("decoupled") the ratio
is taken against the proximal logprobs and verl's truncated importance weights min(proximal/behaviour, c)
multiply the loss.

Vision steps (learner/vision.py). When the model dir is a vision-language model (its config has a
``vision_config``) the policy is loaded as ``AutoModelForImageTextToText``, LoRA adapts only the language
model's linear layers (the vision tower stays as vLLM serves it), and each vision sequence is a micro-batch of
its own whose forward gets its ``pixel_values``, ``image_grid_thw`` and ``mm_token_type_ids`` (the model
computes its M-RoPE positions from them). ``logprob_gap`` is the start-up check against vLLM's logprobs.

Step-level credit (``algorithm = "gae"``). The engine adds a value head: one linear layer on the policy's last
hidden state (detached, so the value loss never moves the policy), with its own AdamW. Before the update a
no-grad pass reads the value at each step's action boundary (the last prompt token, where the step's first
response token is predicted); ``algos.step_gae`` turns rewards and values into per-step advantages (spread
over the step's response tokens) and value targets; each micro-batch then adds verl's value loss to the policy
loss.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from steptap.learner import algos
from steptap.learner.config import LearnerConfig
from steptap.learner.engines.base import StepStats
from steptap.learner.engines.torch_layout import Layout, fill_advantages, layout, micro_batches
from steptap.learner.health import gap_sums
from steptap.learner.policy import model_class, policy_model
from steptap.learner.rows import Batch

__all__ = ["StepStats", "TorchEngine", "pick_device", "sampler_logprobs", "token_logprobs"]


class _Before(NamedTuple):
    """What the no-grad passes before the update found, one item per micro-batch ([B, L-1] each), and the
    values (gae)."""

    old: list[torch.Tensor]  # the logprobs the ratio is taken against: behaviour, or proximal (decoupled)
    masks: list[torch.Tensor]  # the loss mask (rollout correction's rejection applied)
    is_w: list[torch.Tensor | None]  # rollout correction's importance weights
    ref: list[torch.Tensor | None]  # the reference's logprobs (kl_coef > 0)
    is_means: list[float]
    values: torch.Tensor  # gae: [S], the value head at each step's action boundary (zeros without it)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
    """log softmax(logits / T)[target]; logits [B, T, V], targets/temp [B, T] -> [B, T]."""
    scaled = logits.float() / temp.unsqueeze(-1)
    return torch.gather(F.log_softmax(scaled, dim=-1), -1, targets.unsqueeze(-1)).squeeze(-1)


def sampler_logprobs(logits: torch.Tensor, targets: torch.Tensor, temp: torch.Tensor, top_p: torch.Tensor,
                     top_k: torch.Tensor) -> torch.Tensor:
    """The logprob of each target under the sampler's distribution: temperature, then top-k, then top-p
    (vLLM's order), renormalised. Targets outside the kept set get the log of a tiny floor, not -inf."""
    scaled = logits.float() / temp.unsqueeze(-1)  # [B, T, V]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    vocab = scaled.shape[-1]
    ranks = torch.arange(vocab, device=scaled.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(-1)
    keep = ranks < k  # top-k
    probs = F.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    cum = probs.cumsum(-1) - probs  # mass before each token: keep while it is below top_p
    keep &= cum < top_p.unsqueeze(-1)
    keep[..., 0] = True
    kept_sorted = sorted_logits.masked_fill(~keep, float("-inf"))
    kept = torch.full_like(scaled, float("-inf")).scatter(-1, order, kept_sorted)
    logp = F.log_softmax(kept, dim=-1)
    return torch.gather(logp, -1, targets.unsqueeze(-1)).squeeze(-1).clamp(min=-30.0)


class TorchEngine:
    def __init__(self, cfg: LearnerConfig) -> None:
        from transformers import AutoTokenizer

        from steptap.learner.vision import vision_config

        self.cfg = cfg
        self.device = pick_device(cfg.device)
        # float32 parameters and AdamW state unless asked (a bf16 weight drops an update much smaller than
        # 1/256 of itself: most of one at lr 1e-5, measured by scripts/gpu_engines.py); on CUDA the forward
        # runs in bf16 under autocast, as vLLM's does
        gpu = self.device.type == "cuda"
        dtype = torch.bfloat16 if gpu and cfg.model_dtype == "bf16" else torch.float32
        self.bf16_compute = gpu
        torch.manual_seed(cfg.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_dir)
        vcfg = vision_config(cfg.model_dir)
        self.image_token_id = int(vcfg["image_token_id"]) if vcfg else -1
        model = policy_model(cfg, dtype, self.device)
        self.reference = None
        # full fine-tuning needs its own frozen copy for the KL (LoRA just disables the adapter)
        if cfg.lora_rank == 0 and cfg.kl_coef > 0:
            ref = model_class(cfg.model_dir).from_pretrained(cfg.reference_dir or cfg.model_dir, dtype=dtype)
            self.reference = ref.to(self.device).eval().requires_grad_(False)
        self.model = model
        self.model.config.use_cache = False
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                           betas=tuple(cfg.betas))
        self.actor = algos.actor_config(cfg)
        self.value_head: torch.nn.Linear | None = None
        self.value_head_restored = False  # load_state_dict: the head came from the checkpoint
        if cfg.algorithm == "gae":  # starts at V = 0: the first advantages are the whitened returns
            hidden = self.model.config.get_text_config().hidden_size  # a VL model's is its text model's
            self.value_head = torch.nn.Linear(hidden, 1).to(self.device)
            torch.nn.init.zeros_(self.value_head.weight)
            torch.nn.init.zeros_(self.value_head.bias)
            self.value_optimizer = torch.optim.AdamW(self.value_head.parameters(), lr=cfg.value_lr,
                                                     weight_decay=cfg.weight_decay, betas=tuple(cfg.betas))
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.lora = cfg.lora_rank > 0

    # -- the engine interface (engines/base.py) beside train_step -------------------------------------
    def write_weights(self, out_dir: str | Path, version: int | None = None) -> Path:
        from steptap.learner.publish import write_weights

        return write_weights(self.model, self.tokenizer, out_dir, version=version, lora=self.lora)

    def named_weights(self) -> list[tuple[str, Any]]:
        from steptap.learner.transfer import named_weights

        return named_weights(self.model)

    def state_dict(self) -> dict[str, Any]:
        from steptap.learner.checkpoint import trainable_state

        state = {"model": trainable_state(self.model), "optimizer": self.optimizer.state_dict(),
                 "rng": torch.get_rng_state()}
        # Gae: the critic is trained state too, or a resume starts it at V = 0
        if self.value_head is not None:
            state["value_head"] = self.value_head.state_dict()
            state["value_optimizer"] = self.value_optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The policy (and, for gae, the value head with its optimizer) from a checkpoint. A checkpoint
        without a value head (older, or from a GRPO run) leaves the head as built (V = 0):
        ``value_head_restored`` says which; a value head in the checkpoint of an engine without one is
        ignored."""
        from steptap.learner.checkpoint import restore, restore_value_head

        restore(self.model, self.optimizer, state)
        self.value_head_restored = self.value_head is not None and restore_value_head(
            self.value_head, self.value_optimizer, state)

    def close(self) -> None:
        return None

    # -- layout -------------------------------------------------------------------------------------
    def _layout(self, batch: Batch) -> Layout:
        gae = self.value_head is not None  # its advantages need the values first: fill_advantages
        return layout(batch, None if gae else algos.compute_advantages(batch.samples, self.cfg))

    def _boundary_values(self, hidden: torch.Tensor, batch: Batch, mb: list[int]) -> tuple[list[int],
                                                                                           torch.Tensor]:
        """The value head at each step's action boundary in micro-batch ``mb``: (sample indices, values
        [n])."""
        rows, cols, idx = [], [], []
        for r, q in enumerate(mb):
            for i in batch.sequences[q].samples:
                rows.append(r)
                # The last prompt token predicts the first response one
                cols.append(batch.samples[i].offset - 1)
                idx.append(i)
        # [n, H]
        h = hidden[torch.tensor(rows, device=hidden.device), torch.tensor(cols, device=hidden.device)]
        assert self.value_head is not None
        return idx, self.value_head(h.detach().float()).squeeze(-1)

    def _pad(self, rows: list[torch.Tensor], value: float | int) -> torch.Tensor:
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value).to(self.device)

    def _logits(self, model: torch.nn.Module, lay: Layout, mb: list[int]) -> torch.Tensor:
        return self._forward(model, lay, mb)[0]

    def _forward(self, model: torch.nn.Module, lay: Layout, mb: list[int],
                 hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, L-1, V] (position t predicts t + 1) and, when asked, the last hidden state [B, L, H], of
        the sequences ``mb``; a vision sequence (alone in its micro-batch) with its image inputs."""
        ids = [lay.ids[i] for i in mb]
        input_ids = self._pad(ids, self.pad_id)
        attn = self._pad([torch.ones_like(t) for t in ids], 0)
        vision = lay.vision[mb[0]]
        extra = {} if vision is None else {
            "pixel_values": vision["pixel_values"].to(self.device, self.model.dtype),
            "image_grid_thw": vision["image_grid_thw"].to(self.device),
            "mm_token_type_ids": (input_ids == self.image_token_id).long()}
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16_compute):
            out = model(input_ids=input_ids, attention_mask=attn, output_hidden_states=hidden, **extra)
        return out.logits[:, :-1], out.hidden_states[-1] if hidden else None

    # -- one update ---------------------------------------------------------------------------------
    def train_step(self, batch: Batch) -> StepStats:
        t0 = time.perf_counter()
        lay = self._layout(batch)
        mbs = micro_batches([len(t) for t in lay.ids], self.cfg.micro_batch_tokens,
                            [v is not None for v in lay.vision])
        decoupled = self.cfg.rollout_is != "none" or bool(self.cfg.rollout_rs)
        need_prox = decoupled or any(s.temperature != 1.0 or s.truncated for s in batch.samples)
        n_tokens = int(sum(m.sum() for m in lay.mask))
        gae = self.value_head is not None
        gaps: list[tuple[float, int]] = []  # the logprob gap of each micro-batch (learner/health.py)
        before = self._before_update(batch, lay, mbs, decoupled, need_prox, gaps)
        # Step-level advantages need every step's value, so only now (the pass above is the sync point)
        returns = None
        if gae:
            step_adv, returns = algos.step_gae(batch.samples, before.values, self.cfg.gamma, self.cfg.lam)
            fill_advantages(lay, batch, step_adv)
        sums, grad_norm = self._update(batch, lay, mbs, before, returns, need_prox, n_tokens, gaps)
        k = self.cfg.epochs
        return StepStats(
            loss=sums["loss"] / k, pg_clipfrac=sums["pg_clipfrac"] / k, ppo_kl=sums["ppo_kl"] / k,
            kl=sums["kl_loss"] / k, entropy=sums["entropy"] / k, grad_norm=grad_norm, tokens=n_tokens,
            seq_tokens=sum(len(t) for t in lay.ids), seconds=time.perf_counter() - t0,
            rollout_is_mean=sum(before.is_means) / len(before.is_means) if before.is_means else 1.0,
            value_loss=sums["value_loss"] / k,
            value_mean=float(before.values.mean()) if gae else 0.0,
            logprob_gap=sum(g * n for g, n in gaps) / max(1, sum(n for _, n in gaps)),
            gap_tokens=sum(n for _, n in gaps),
        )

    def _before_update(self, batch: Batch, lay: Layout, mbs: list[list[int]], decoupled: bool,
                       need_prox: bool, gaps: list[tuple[float, int]]) -> _Before:
        """The no-grad passes before the update, per micro-batch: the logprobs the ratio is taken against
        (behaviour, or proximal with rollout correction), the loss masks, the reference's logprobs; gae: the
        value at each step's action boundary."""
        gae = self.value_head is not None
        out = _Before([], [], [], [], [], torch.zeros(len(batch.samples)))
        for mb in mbs:
            targets = self._pad([lay.ids[i][1:] for i in mb], 0)
            mask = self._pad([lay.mask[i] for i in mb], False)
            rec = self._pad([lay.recorded[i] for i in mb], 0.0)
            temp = self._pad([lay.temp[i] for i in mb], 1.0)
            behaviour, prox, logits = rec, None, None
            if gae:
                with torch.no_grad():
                    logits, hidden = self._forward(self.model, lay, mb, hidden=True)
                    idx, v = self._boundary_values(hidden, batch, mb)
                    out.values[idx] = v.cpu()
                    del hidden
            if need_prox:
                behaviour, prox = self._behaviour(lay, mb, logits, targets, mask, rec, temp, gaps)
            if decoupled:
                w, mask, m = algos.rollout_correction(self.cfg, prox, behaviour, mask)
                out.is_w.append(w)
                out.is_means.append(m.get("rollout_corr/rollout_is_mean", 1.0))
                out.old.append(prox)
            else:
                out.is_w.append(None)
                out.old.append(behaviour)
            out.masks.append(mask)
            out.ref.append(self._reference_logprobs(lay, mb, targets, temp) if self.cfg.kl_coef > 0 else None)
            logits = None
        return out

    def _behaviour(self, lay: Layout, mb: list[int], logits: torch.Tensor | None, targets: torch.Tensor,
                   mask: torch.Tensor, rec: torch.Tensor, temp: torch.Tensor,
                   gaps: list[tuple[float, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch ``mb``'s behaviour and proximal logprobs [B, T] from the weights before the update: the
        recorded raw logprobs shifted by what temperature and truncation change (module docstring); its
        logprob gap to vLLM's into ``gaps``. ``logits``: the gae pass's, when it ran."""
        with torch.no_grad():
            # Only the trained positions: the sampler's sort over the vocabulary is [N, V], not [B, T, V]
            if logits is None:
                logits = self._logits(self.model, lay, mb)
            picked = logits[mask].unsqueeze(0)  # [1, N, V]
            tg, tp = targets[mask].unsqueeze(0), temp[mask].unsqueeze(0)  # [1, N]
            raw = token_logprobs(picked, tg, torch.ones_like(tp))[0]
            prox = torch.zeros_like(rec).masked_scatter(mask, token_logprobs(picked, tg, tp)[0])
            samp = sampler_logprobs(picked, tg, tp,
                                    self._pad([lay.top_p[i] for i in mb], 1.0)[mask][None],
                                    self._pad([lay.top_k[i] for i in mb], 0)[mask][None])[0]
            del picked, logits
        behaviour = rec.masked_scatter(mask, rec[mask] + (samp - raw))  # [B, T]
        fresh = self._pad([lay.fresh[i] for i in mb], False)
        gaps.append(gap_sums(rec.masked_scatter(mask, raw), rec, fresh))
        return behaviour, prox

    def _update(self, batch: Batch, lay: Layout, mbs: list[list[int]], before: _Before,
                returns: torch.Tensor | None, need_prox: bool, n_tokens: int,
                gaps: list[tuple[float, int]]) -> tuple[dict[str, float], float]:
        """``epochs`` passes over the micro-batches, one optimizer step each over the whole batch: the loss
        figures summed over the epochs, and the last epoch's gradient norm."""
        self.model.train()
        sums = {"loss": 0.0, "pg_clipfrac": 0.0, "ppo_kl": 0.0, "kl_loss": 0.0, "entropy": 0.0,
                "value_loss": 0.0}
        grad_norm = 0.0
        for epoch in range(self.cfg.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            if self.value_head is not None:  # gae
                self.value_optimizer.zero_grad(set_to_none=True)
            for j, mb in enumerate(mbs):
                # temperature 1 everywhere: the first epoch's logprobs are the raw ones, the gap's
                gap = gaps if epoch == 0 and not need_prox else None
                self._accumulate(batch, lay, mb, j, before, returns, n_tokens, sums, gap)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(
                [p for p in self.model.parameters() if p.requires_grad], self.cfg.grad_clip))
            self.optimizer.step()
            if self.value_head is not None:  # gae
                torch.nn.utils.clip_grad_norm_(self.value_head.parameters(), self.cfg.grad_clip)
                self.value_optimizer.step()
        return sums, grad_norm

    def _accumulate(self, batch: Batch, lay: Layout, mb: list[int], j: int, before: _Before,
                    returns: torch.Tensor | None, n_tokens: int, sums: dict[str, float],
                    gaps: list[tuple[float, int]] | None) -> None:
        """Micro-batch ``j``'s forward and backward: its gradients accumulate, its loss is its share of the
        batch's (gae: the value head's loss beside the policy's); its figures added to ``sums``."""
        gae = returns is not None
        targets = self._pad([lay.ids[i][1:] for i in mb], 0)
        temp = self._pad([lay.temp[i] for i in mb], 1.0)
        adv = self._pad([lay.adv[i] for i in mb], 0.0)
        logits, hidden = self._forward(self.model, lay, mb, hidden=gae)
        log_prob = token_logprobs(logits, targets, temp)
        if gaps is not None:
            fresh = self._pad([lay.fresh[i] for i in mb], False)
            gaps.append(gap_sums(log_prob.detach(), before.old[j], fresh))
        entropy = self._entropy(logits, temp)
        loss, m = algos.policy_loss(
            self.actor, log_prob, before.old[j], adv, before.masks[j],
            batch_num_tokens=n_tokens, global_batch_size=len(lay.ids),
            rollout_is_weights=before.is_w[j], ref_log_prob=before.ref[j], entropy=entropy,
        )
        vloss = torch.zeros(())
        if returns is not None:  # the head sees detached features: this loss reaches only the head
            idx, vpred = self._boundary_values(hidden, batch, mb)
            vloss, _ = algos.value_loss(vpred, returns[idx].to(vpred), before.values[idx].to(vpred),
                                        self.cfg.value_clip, num_steps=len(batch.samples))
            sums["value_loss"] += float(vloss.detach())
        (loss + vloss).backward()
        share = float(before.masks[j].sum()) / max(n_tokens, 1)
        sums["loss"] += float(loss.detach())
        sums["pg_clipfrac"] += m.get("pg_clipfrac", 0.0) * share
        sums["ppo_kl"] += m.get("ppo_kl", 0.0) * share
        sums["kl_loss"] += m.get("kl_loss", 0.0) * share
        sums["entropy"] += float((entropy.detach() * before.masks[j]).sum()) / max(n_tokens, 1)

    def _entropy(self, logits: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
        """Per-token entropy of the temperature-scaled policy (a statistic; in the loss only with
        entropy_coef)."""
        ctx = torch.enable_grad() if self.cfg.entropy_coef else torch.no_grad()
        with ctx:
            logp = F.log_softmax(logits.float() / temp.unsqueeze(-1), dim=-1)
            return -(logp.exp() * logp).sum(-1)

    @torch.no_grad()
    def _reference_logprobs(self, lay: Layout, mb: list[int], targets: torch.Tensor,
                            temp: torch.Tensor) -> torch.Tensor:
        if self.reference is not None:
            return token_logprobs(self._logits(self.reference, lay, mb), targets, temp)
        with self.model.disable_adapter():  # LoRA: the base weights are the reference
            return token_logprobs(self._logits(self.model, lay, mb), targets, temp)

    @torch.no_grad()
    def logprob_gap(self, batch: Batch) -> tuple[float, int]:
        """The vision check (learner/vision.py) with this policy before any update, at temperature 1 (vLLM
        records raw logprobs)."""
        from steptap.learner.vision import vision_gap

        lay = self._layout(batch)
        self.model.eval()

        def raw(qs: list[int]) -> list[list[float]]:
            out = []
            for q in qs:
                logits = self._logits(self.model, lay, [q])  # [1, L-1, V]
                ones = torch.ones(logits.shape[:2], device=self.device)
                out.append(token_logprobs(logits, lay.ids[q][1:][None].to(self.device), ones)[0].tolist())
            return out

        return vision_gap(batch, raw)

    # -- sampling (in-process tests and demos without vLLM) -------------------------------------------
    @torch.no_grad()
    def sample(self, prompt_ids: list[int], n: int, max_new_tokens: int,
               temperature: float = 1.0) -> list[tuple[list[int], list[float]]]:
        """``n`` samples of ``prompt_ids`` with transformers ``generate``: (response ids, raw logprobs) each,
        the logprobs as vLLM would record them (log softmax of the unscaled logits)."""
        self.model.eval()
        ids = torch.tensor([prompt_ids] * n, device=self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16_compute):
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                      temperature=temperature, top_p=1.0, top_k=None,
                                      max_new_tokens=max_new_tokens, output_logits=True,
                                      return_dict_in_generate=True, pad_token_id=self.pad_id, use_cache=True)
        resp = out.sequences[:, len(prompt_ids):]  # [n, T]
        logits = torch.stack(out.logits, dim=1).float()  # [n, T, V], raw (before the temperature warper)
        logps = torch.gather(F.log_softmax(logits, -1), -1, resp.unsqueeze(-1)).squeeze(-1)
        eos = self.tokenizer.eos_token_id
        results = []
        for r, lp in zip(resp.tolist(), logps.tolist(), strict=False):
            cut = r.index(eos) + 1 if eos in r else len(r)
            results.append((r[:cut], lp[:cut]))
        return results
