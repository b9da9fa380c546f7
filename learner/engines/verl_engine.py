"""The ``verl`` engine: verl's own ``TrainingWorker`` (FSDP2) as a Ray worker group, fed with steptap batches.

    steptap learn --engine verl --workers 2 [--ray-address auto|HOST:PORT] ...

The driver (this process) keeps what the torch engine's driver side does: advantages by verl's estimators
(``algos.compute_advantages``), behaviour logprobs from the recorded ones, and verl's rollout correction. The
workers run verl's FSDP2 engine and verl's ``ppo_loss`` (policy loss, entropy, KL), with micro-batches by
token budget (verl's dynamic batch size) and one optimizer step per epoch over the whole batch, as the torch
engine does: on the same batch both give the same loss and the same update (``tests/integration/
test_verl_engine.py``).

Layout. A steptap sequence (one step, or an ``extends`` chain packed into one) becomes one verl row: the first
step's prompt is verl's prompt (left-padded), the rest is verl's response (right-padded) with
``response_mask`` set on the steps' response tokens only, as verl lays out multi-turn rollouts.

Weights out: the workers' full tensors (``engine.get_per_tensor_param``, what verl's own weight sync uses) are
written as an HF safetensors directory and swapped in through the proxy, as the torch engine's are. With LoRA
(verl's peft adapter) only the adapter trains and is published, in peft's format; the KL reference is then the
base model (verl's ``no_lora_adapter``).
Checkpoints: the workers' full model and optimizer state (``torch.distributed.checkpoint.state_dict``,
gathered to rank 0) goes into steptap's safetensors + JSON checkpoint; verl's own pickled sharded checkpoints
are never written or read.

On a machine without GPUs the workers run on CPU over gloo (``verl_cpu``): the same code path, tested in CI.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from steptap.learner import algos
from steptap.learner.config import LearnerConfig
from steptap.learner.engines.base import StepStats
from steptap.learner.engines.verl_metrics import last, mean, total
from steptap.learner.engines.verl_rows import verl_rows
from steptap.learner.health import gap_sums
from steptap.learner.rows import Batch
from steptap.learner.vision import lora_targets, vision_config

logger = logging.getLogger("steptap.learner.verl")

# The TrainingWorker / engine / platform APIs this module is written against
VERL_RANGE = (">=0.9.1", "<0.10")

def master_port_range(span: int = 256) -> list[int] | None:
    """Where the workers' TCPStore listens: a random window below the machine's ephemeral range. verl's
    default, a ``bind(0)`` port released before the store binds it, lies in that range, where any outgoing
    connection may be given it meanwhile (seen: EADDRINUSE beside other learners and servers); random, so
    learners started together rarely scan from one port. ``None`` (verl's pick) on an unusual range."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if low - 10_000 <= 1024:
        return None
    start = random.randrange(low - 10_000, low - span)
    return [start, start + span]


try:  # the worker class must be importable (by name) in every Ray worker process
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.workers.engine_workers import TrainingWorker
except ImportError:  # verl missing or too old: check_verl_version() says so
    TrainingWorker = object


def check_verl_version() -> str:
    """The installed verl's version, or a clear error when it is outside ``VERL_RANGE``."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.specifiers import SpecifierSet

    try:
        found = version("verl")
    except PackageNotFoundError:
        raise RuntimeError("--engine verl needs verl: pip install 'steptap[learner]'") from None
    want = SpecifierSet(",".join(VERL_RANGE))
    if found not in want:
        raise RuntimeError(f"--engine verl is written against verl {want}; found verl {found}. Install a "
                           f"version in that range, or use --engine torch")
    return found


if TrainingWorker is not object:

    class SteptapTrainingWorker(TrainingWorker):
        """verl's ``TrainingWorker`` plus full-state export/import for steptap's checkpoints and publishes."""

        def __init__(self, config: Any) -> None:
            if os.environ.get("VERL_PLATFORM") == "cpu":
                from steptap.learner.engines import verl_cpu

                verl_cpu.init_gloo()  # before verl builds the backend string cpu:gloo,cpu:gloo
                verl_cpu.register_fsdp2_for_cpu()
            from steptap.learner.engines.verl_vision import fix_nested_select

            fix_nested_select()  # vision rows' 3-D position ids through verl's micro-batching
            super().__init__(config)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def hf_weights(self) -> dict[str, torch.Tensor] | None:
            """The full weights under Hugging Face names, on rank 0 (a collective: every rank gathers)."""
            params, _ = self.engine.get_per_tensor_param()
            out = {name: t.detach().to("cpu", torch.float32).clone() for name, t in params}
            return out if self.rank == 0 else None

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def adapter(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
            """The LoRA adapter under peft's saved names, and its peft config, on rank 0 (a collective)."""
            params, peft_config = self.engine.get_per_tensor_param(base_sync_done=True)
            out = {name: t.detach().to("cpu", torch.float32).clone() for name, t in params}
            return (out, peft_config) if self.rank == 0 else None

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def keep_gradients(self) -> None:
            """From now on keep a full copy of the gradients each optimizer step used (after clipping), for
            checks (verl zeroes them when its train step ends). A collective at every step: checks only."""
            engine, step = self.engine, self.engine.optimizer_step

            def step_and_keep() -> float:
                norm = step()
                self._kept_grads = {
                    n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor")
                        else p.grad).detach().cpu().clone()
                    for n, p in engine.module.named_parameters() if p.grad is not None}
                return norm

            engine.optimizer_step = step_and_keep

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def last_gradients(self) -> dict[str, torch.Tensor] | None:
            return getattr(self, "_kept_grads", None) if self.rank == 0 else None

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def full_state(self) -> dict[str, Any] | None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            model, optim = get_state_dict(self.engine.module, self.engine.optimizer, options=opts)
            return {"model": model, "optimizer": optim} if self.rank == 0 else None

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def load_full_state(self, state: dict[str, Any]) -> None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            set_state_dict(self.engine.module, self.engine.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"],
                           options=StateDictOptions(full_state_dict=True))


class VerlEngine:
    """The driver side: builds the worker group, lays batches out for verl, publishes and checkpoints."""

    def __init__(self, cfg: LearnerConfig) -> None:
        self.version_found = check_verl_version()
        self.cfg = cfg
        self.lora = cfg.lora_rank > 0  # publishes the peft adapter; the reference (KL) is the base model
        self.gap_measured = False  # the logprob gap against vLLM's (learner/health.py), once at least
        self.cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
        t0 = time.perf_counter()
        if self.cpu:
            from steptap.learner.engines import verl_cpu

            verl_cpu.activate()
        import ray
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_dir)
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.image_token_id = int((vision_config(cfg.model_dir) or {}).get("image_token_id", -1))
        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            env = {"RAY_AUTH_MODE": "disabled"} if not cfg.ray_address else {}
            os.environ.update(env)
            runtime_env = {"env_vars": self._worker_env()}
            if cfg.ray_address:
                ray.init(address=cfg.ray_address, runtime_env=runtime_env)
            else:
                ray.init(num_cpus=max(2, cfg.workers * cfg.worker_cpus), include_dashboard=False,
                         runtime_env=runtime_env)
        self.actor = algos.actor_config(self.cfg)
        try:
            self.wg = self._build_group()
        except BaseException:
            self.close()  # give back what was reserved (placement groups, the cluster we started)
            raise
        self.startup_s = time.perf_counter() - t0
        logger.info("verl %s engine on %s: %d workers ready in %.1f s", self.version_found,
                 "cpu" if self.cpu else "cuda", cfg.workers, self.startup_s)

    def _worker_env(self) -> dict[str, str]:
        env = {"TOKENIZERS_PARALLELISM": "false"}
        if self.cpu:
            from steptap.learner.engines import verl_cpu

            env |= verl_cpu.worker_env()
            env["OMP_NUM_THREADS"] = str(max(1, self.cfg.worker_cpus))
        return env

    def _build_group(self) -> Any:
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
        from verl.workers.engine_workers import TrainingWorkerConfig
        from verl.workers.utils.losses import ppo_loss

        c = self.cfg
        from steptap.learner.engines.verl_cpu import attention

        rmpad, attn = attention(self.cpu)
        model = HFModelConfig(path=c.model_dir, use_remove_padding=rmpad,
                              enable_gradient_checkpointing=c.gradient_checkpointing, lora_rank=c.lora_rank,
                              lora_alpha=c.lora_alpha,
                              target_modules=lora_targets(c.lora_targets, c.model_dir),
                              override_config={"attn_implementation": attn})
        mp = {"param_dtype": c.model_dtype, "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
        engine = FSDPEngineConfig(
            strategy="fsdp2", model_dtype=c.model_dtype, mixed_precision=mp, use_torch_compile=False,
            use_dynamic_bsz=c.dynamic_bsz, max_token_len_per_gpu=c.micro_batch_tokens,
            infer_max_token_len_per_gpu=c.micro_batch_tokens, micro_batch_size_per_gpu=1,
            infer_micro_batch_size_per_gpu=1, fsdp_size=c.fsdp_size, param_offload=c.param_offload,
            optimizer_offload=c.optimizer_offload, seed=c.seed,
        )
        optim = FSDPOptimizerConfig(lr=c.lr, weight_decay=c.weight_decay, betas=tuple(c.betas),
                                    clip_grad=c.grad_clip, lr_scheduler_type="constant",
                                    total_training_steps=1)
        config = TrainingWorkerConfig(model_type="language_model", model_config=model, engine_config=engine,
                                      optimizer_config=optim)
        per_node = c.workers // c.nodes
        self.pool = pool = RayResourcePool([per_node] * c.nodes, use_gpu=not self.cpu,
                                           max_colocate_count=c.worker_cpus)
        wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(
            cls=_remote_worker(), config=config), device_name="cpu" if self.cpu else "cuda",
            master_port_range=master_port_range())
        wg.set_loss_fn(partial(ppo_loss, config=self.actor))
        wg.reset()
        return wg

    # -- layout: steptap sequences -> verl's left/right padded rows (verl_rows.py) ------------------------
    def _rows(self, batch: Batch) -> dict[str, Any]:
        advs = algos.compute_advantages(batch.samples, self.cfg)
        return verl_rows(batch, advs, self.cfg.workers, self.pad_id)

    def _tensordict(self, rows: dict[str, Any], **extra: torch.Tensor) -> Any:
        from torch.nn.utils.rnn import pad_sequence
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding

        prompts = pad_sequence([p.flip(0) for p in rows["prompts"]], batch_first=True,
                               padding_value=self.pad_id).flip(1)  # [B, P] left-padded
        p_attn = pad_sequence([torch.ones_like(p).flip(0) for p in rows["prompts"]], batch_first=True).flip(1)
        responses = pad_sequence(rows["responses"], batch_first=True, padding_value=self.pad_id)  # [B, R]
        r_attn = pad_sequence([torch.ones_like(r) for r in rows["responses"]], batch_first=True)
        attn = torch.cat([p_attn, r_attn], dim=1)
        tensors = {
            "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
            "response_mask": pad_sequence(rows["mask"], batch_first=True),
            "advantages": pad_sequence(rows["adv"], batch_first=True),
        }
        if any(v is not None for v in rows["vision"]):  # M-RoPE positions, the images (learner/vision.py)
            from steptap.learner.engines.verl_vision import fix_nested_select, verl_fields

            fix_nested_select()  # the driver splits the batch among the workers with it too
            tensors |= verl_fields(self.cfg.model_dir, self.image_token_id, rows["vision"],
                                   tensors["input_ids"], attn)
        tensors |= extra
        temps = rows["temps"]
        temperature: Any = temps[0] if len(set(temps)) == 1 else torch.tensor(temps, dtype=torch.float32)
        td = tu.get_tensordict(tensors, non_tensor_dict={"temperature": temperature} if isinstance(
            temperature, float) else None)
        if not isinstance(temperature, float):
            td["temperature"] = temperature
        td = left_right_2_no_padding(td)
        if "multi_modal_inputs" in tensors:
            from steptap.learner.engines.verl_vision import position_rows

            position_rows(td)
        return td

    def _logprobs(self, rows: dict[str, Any], *, unit_temperature: bool = False,
                  reference: bool = False) -> torch.Tensor:
        """The workers' current policy logprobs of every response token, [B, R] (no grad); ``reference``: with
        the LoRA adapter disabled (the base model is the reference)."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        r = dict(rows, temps=[1.0] * len(rows["temps"])) if unit_temperature else rows
        td = self._tensordict(r)
        tu.assign_non_tensor(td, compute_loss=False, calculate_entropy=False, no_lora_adapter=reference)
        out = self.wg.infer_batch(td).get()
        return no_padding_2_padding(tu.get(out, "log_probs"), td).float()

    # -- one update -------------------------------------------------------------------------------------
    def train_step(self, batch: Batch) -> StepStats:
        from torch.nn.utils.rnn import pad_sequence
        from verl.utils import tensordict_utils as tu

        t0 = time.perf_counter()
        rows = self._rows(batch)
        mask = pad_sequence(rows["mask"], batch_first=True).bool()
        behaviour = pad_sequence(rows["recorded"], batch_first=True)  # [B, R] vLLM's raw logprobs
        decoupled = self.cfg.rollout_is != "none" or bool(self.cfg.rollout_rs)
        need_temp = any(t != 1.0 for t in rows["temps"])
        extra: dict[str, torch.Tensor] = {}
        old, is_mean, recorded, unit = behaviour, 1.0, behaviour, None
        if need_temp or decoupled:
            prox = self._logprobs(rows)  # the learner's own policy at the sampling temperature
            unit = self._logprobs(rows, unit_temperature=True) if need_temp else prox
            if need_temp:  # raw -> sampler: shift by what the temperature changes, measured on our weights
                behaviour = torch.where(mask, behaviour + prox - unit, 0.0)
            if decoupled:
                w, mask, m = algos.rollout_correction(self.cfg, prox, behaviour, mask)
                extra["rollout_is_weights"] = w
                rows["mask"] = [mask[i, :len(r)].float() for i, r in enumerate(rows["responses"])]
                is_mean = float(m.get("rollout_corr/rollout_is_mean", 1.0))
                old = prox
            else:
                old = behaviour
        elif not self.gap_measured:  # the first batch: one more forward pass, the check against vLLM's
            unit = self._logprobs(rows, unit_temperature=True)
        fresh = pad_sequence(rows["fresh"], batch_first=True).bool()
        gap, gap_n = gap_sums(unit, recorded, fresh) if unit is not None else (0.0, 0)
        self.gap_measured = self.gap_measured or gap_n > 0
        extra["old_log_probs"] = old
        if self.cfg.kl_coef > 0:
            extra["ref_log_prob"] = self._logprobs(rows, reference=True)
        td = self._tensordict(rows, **extra)
        n_rows = len(rows["prompts"])
        tu.assign_non_tensor(td, calculate_entropy=True, global_batch_size=rows["n_real"],
                             mini_batch_size=n_rows,
                             epochs=self.cfg.epochs, seed=self.cfg.seed, dataloader_kwargs={"shuffle": False},
                             compute_loss=True)
        metrics = tu.get(self.wg.train_mini_batch(td).get(), "metrics")
        n_tokens = int(mask.sum())
        k = self.cfg.epochs
        return StepStats(
            # verl's clip fraction and KL are means per micro-batch (per rank), not weighted by token count
            loss=mean(metrics.get("loss")), pg_clipfrac=mean(metrics.get("actor/pg_clipfrac")),
            ppo_kl=mean(metrics.get("actor/ppo_kl")), kl=mean(metrics.get("kl_loss")),
            entropy=total(metrics.get("actor/entropy_loss")) / k, grad_norm=last(metrics.get("grad_norm")),
            tokens=n_tokens, seq_tokens=sum(len(s.input_ids) for s in batch.sequences),
            seconds=time.perf_counter() - t0, rollout_is_mean=is_mean, logprob_gap=gap, gap_tokens=gap_n,
        )

    def logprob_gap(self, batch: Batch) -> tuple[float, int]:
        """The vision check (learner/vision.py): the workers' raw logprobs (temperature 1)."""
        from steptap.learner.vision import vision_gap

        rows = self._rows(batch)
        lp = self._logprobs(rows, unit_temperature=True)  # [B, R]: from each row's first response token

        def raw(qs: list[int]) -> list[list[float]]:  # aligned as the sequence's targets: prompt part 0
            return [[0.0] * (len(rows["prompts"][q]) - 1) + lp[q, :len(rows["responses"][q])].tolist()
                    for q in qs]

        return vision_gap(batch, raw)

    # -- weights out, checkpoints -------------------------------------------------------------------------
    def hf_weights(self) -> dict[str, torch.Tensor]:
        return next(x for x in self.wg.hf_weights() if x is not None)

    def keep_gradients(self) -> None:
        self.wg.keep_gradients()

    def last_gradients(self) -> dict[str, torch.Tensor]:
        """The gradients of the last step (after clipping), after ``keep_gradients()``; for checks."""
        return next(x for x in self.wg.last_gradients() if x is not None)

    def write_weights(self, out_dir: str | Path, version: int | None = None) -> Path:
        from safetensors.torch import save_file

        from steptap.learner.publish import write_dir

        if self.lora:
            return self._write_adapter(out_dir, version)
        weights = self.hf_weights()

        def save(tmp: Path) -> None:
            save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            config = json.loads((Path(self.cfg.model_dir) / "config.json").read_text())
            config["dtype"] = config["torch_dtype"] = "float32"  # what the tensors are (verl writes bfloat16)
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            for name in ("generation_config.json",):
                if (Path(self.cfg.model_dir) / name).exists():
                    shutil.copy(Path(self.cfg.model_dir) / name, tmp / name)
            self.tokenizer.save_pretrained(str(tmp))

        return write_dir(out_dir, save, version=version, lora=False)

    def named_weights(self) -> list[tuple[str, Any]]:
        """The full weights gathered to this driver (CPU): a collective publish sends them over gloo."""
        return list(self.hf_weights().items())

    def _write_adapter(self, out_dir: str | Path, version: int | None) -> Path:
        from safetensors.torch import save_file

        from steptap.learner.publish import write_dir

        tensors, peft_config = next(x for x in self.wg.adapter() if x is not None)
        config = {k: sorted(v) if isinstance(v, set) else v for k, v in peft_config.items()}
        config["base_model_name_or_path"] = self.cfg.model_dir
        config["task_type"] = str(getattr(config.get("task_type"), "value", config.get("task_type")))
        config["peft_type"] = str(getattr(config.get("peft_type"), "value", config.get("peft_type")))

        def save(tmp: Path) -> None:  # what peft's save_pretrained writes
            save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
            (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, default=str))

        return write_dir(out_dir, save, version=version, lora=True)

    def state_dict(self) -> dict[str, Any]:
        state = next(x for x in self.wg.full_state() if x is not None)
        return {"model": state["model"], "optimizer": state["optimizer"], "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wg.load_full_state({"model": state["model"], "optimizer": state["optimizer"]})
        if "rng" in state:
            torch.set_rng_state(state["rng"])

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for w in getattr(getattr(self, "wg", None), "workers", []):
            ray.kill(w)
        # Give the CPUs/GPUs back to the cluster
        for pg in getattr(self, "pool", None) and self.pool.pgs or []:
            remove_placement_group(pg)
        if self._own_ray and ray.is_initialized():
            ray.shutdown()


def _remote_worker() -> Any:
    import ray

    return ray.remote(SteptapTrainingWorker)
