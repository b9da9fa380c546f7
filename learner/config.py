"""``LearnerConfig``: every knob of ``steptap learn``, with its default, in one msgspec Struct.

A config file (TOML) sets any subset of the fields; every field is also a command-line flag
(``--lr 1e-5``, ``--lora-rank 8``, ``--no-resume``), generated from the Struct so the two never drift.
Precedence: defaults < file < flags < ``STEPTAP_CONTROL_TOKEN`` (only when no token was given).
"""

from __future__ import annotations

import argparse
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import msgspec


class LearnerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # -- where the data comes from and where the weights go
    proxy_url: str = "http://127.0.0.1:8400"  # one proxy (an alias kept for proxy_urls)
    proxy_urls: tuple[str, ...] = ()  # several proxies: every stream consumed, every version published to all
    control_token: str = ""  # empty: $STEPTAP_CONTROL_TOKEN
    consumer: str = "learner"  # the stream consumer name: its cursor is acknowledged at checkpoints
    model_dir: str = ""  # Hugging Face model directory the policy starts from
    # Torch: this process; verl: verl's TrainingWorker group on Ray
    engine: Literal["torch", "verl"] = "torch"
    device: str = "auto"  # auto: cuda when available, else cpu
    seed: int = 0
    num_threads: int = 0  # torch CPU threads; 0: torch's default

    # -- the verl engine (engine = "verl"): FSDP2 TrainingWorkers on a Ray cluster; see docs/verl-engine.md
    ray_address: str = ""  # empty: start a local Ray cluster; auto: join the running one; or HOST:PORT
    workers: int = 1  # training workers: one per GPU (on a CPU-only cluster, one process each)
    nodes: int = 1  # Ray nodes the workers spread over (workers per node = workers / nodes)
    worker_cpus: int = 1  # CPUs each worker reserves from Ray
    fsdp_size: int = -1  # FSDP shard group size; -1: shard over all workers
    param_offload: bool = False  # FSDP: keep parameters in CPU memory between uses (large models on few GPUs)
    optimizer_offload: bool = False  # FSDP: keep optimizer state in CPU memory
    dynamic_bsz: bool = True  # micro-batches by token budget (micro_batch_tokens per worker), verl's packing
    gradient_checkpointing: bool = False  # recompute activations in backward (GPU memory for time)
    model_dtype: str = "fp32"  # FSDP parameter dtype: fp32 | bf16 (GPU)

    # -- tracking through verl.utils.tracking.Tracking, besides the JSON-lines metrics file
    # e.g. console tensorboard wandb mlflow (wandb runs offline unless configured)
    trackers: tuple[str, ...] = ()
    project: str = "steptap"  # the tracker's project name
    experiment: str = "learn"  # the tracker's run name

    # -- algorithm (verl.trainer.ppo.core_algos, by name)
    # Advantage estimator: grpo | rloo | reinforce_plus_plus | ... | gae (step-level, value head)
    algorithm: str = "grpo"
    policy_loss: str = "vanilla"  # vanilla (PPO-clip) | gspo | cispo | ...
    loss_agg_mode: str = "token-mean"
    norm_adv_by_std: bool = True  # GRPO's std scaling (False: Dr.GRPO)
    gamma: float = 1.0  # discount over steps for per-step (process) rewards
    lam: float = 0.95  # gae: GAE lambda over steps
    value_lr: float = 1e-3  # gae: the value head's AdamW learning rate
    value_clip: float = 0.5  # gae: verl's cliprange_value around the values the advantages were computed with
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages
    entropy_coef: float = 0.0
    kl_coef: float = 0.0  # > 0: KL loss to a frozen reference
    kl_type: str = "low_var_kl"  # verl kl_penalty name: kl | abs | mse | low_var_kl | k3+ ...
    reference_dir: str = ""  # the reference model; empty: model_dir

    # -- batches and optimisation
    batch_groups: int = 8  # groups (GRPO prompts) per update
    group_size: int = 8  # members expected per group when the trajectories do not say
    group_timeout_s: float = 120.0  # a group that waited this long is used with the members it has
    min_group_members: int = 2  # fewer complete members after the timeout: dropped (counted)
    epochs: int = 1  # passes over each batch (PPO epochs); > 1 makes the clip matter
    micro_batch_tokens: int = 8192  # token budget of one forward/backward (padded tokens)
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    train_aborted: bool = False  # aborted/timed-out members count toward their group but are not trained on
    # anonymous calls (no session) are one-step trajectories anyone reaching the proxy can write: not trained
    # on
    train_anonymous: bool = False

    # -- LoRA (peft); rank 0 trains all weights
    lora_rank: int = 0
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                     "down_proj")

    # -- off-policy data
    max_staleness: int = 4  # steps sampled > this many versions behind are dropped / down-weighted; -1: off
    stale_mode: Literal["drop", "downweight"] = "drop"
    stale_decay: float = 0.5  # downweight: weight = stale_decay ** (lag - max_staleness)
    truncation_mode: Literal["correct", "drop"] = "correct"  # steps sampled with top_p < 1 or top_k > 0
    rollout_is: Literal["none", "token", "sequence"] = "none"  # verl rollout correction (decoupled TIS)
    rollout_is_threshold: float = 2.0
    rollout_rs: str = ""  # verl rejection sampling modes, e.g. "token_k1"; empty: off
    rollout_rs_threshold: str = ""
    pack_extends: bool = True  # merge `extends` chains into one sequence

    # -- loop, checkpoints, what the user sees
    push_every: int = 1  # publish weights to the proxy every N updates; 0: never
    weights_dir: str = "./steptap-weights"  # where published weights go (a path vLLM can read)
    # (docs/weight-transfer.md; full weights only: LoRA adapters always go through disk)
    # Disk: write a directory vLLM reloads; collective: broadcast into vLLM's workers (gloo on CPU, NCCL on
    # CUDA)
    weight_sync: Literal["disk", "collective"] = "disk"
    transfer_address: str = ""  # collective: this host's address as vLLM's workers reach it; empty: guessed
    transfer_timeout_s: float = 120.0  # collective: bound on the rendezvous and on each tensor
    # Collective: every Nth version through disk anyway (a restarted replica reloads it); 0: never
    disk_every: int = 0
    checkpoint_dir: str = "./steptap-checkpoints"  # any fsspec URL
    checkpoint_every: int = 10  # updates; the stream cursor is acknowledged only here
    keep_checkpoints: int = 2
    resume: bool = False
    max_updates: int = 0  # stop after this many updates; 0: run until stopped
    metrics_file: str = "steptap-metrics.jsonl"
    tensorboard_dir: str = ""  # empty: off (needs the tensorboard package)
    progress: bool = True  # rich progress bar and one status line per update

    def validate(self) -> LearnerConfig:
        """Raise ``ValueError`` with every problem at once; checks verl's registries by name."""
        from verl.trainer.ppo import core_algos

        problems = []
        if not self.model_dir:
            problems.append("model_dir is required")
        if self.algorithm not in core_algos.ADV_ESTIMATOR_REGISTRY:
            problems.append(f"algorithm {self.algorithm!r}: gae or a critic-free verl advantage estimator")
        if self.algorithm == "gae" and not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1
                                            and self.value_lr > 0):
            problems.append("gae needs 0 <= gamma <= 1, 0 <= lam <= 1 and value_lr > 0")
        if self.policy_loss not in core_algos.POLICY_LOSS_REGISTRY or self.policy_loss == "bypass_mode":
            problems.append(f"policy_loss {self.policy_loss!r}: one of "
                            f"{sorted(core_algos.POLICY_LOSS_REGISTRY)}")
        for name in ("batch_groups", "group_size", "epochs", "micro_batch_tokens", "checkpoint_every"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if self.lr <= 0:
            problems.append("lr must be > 0")
        if not 0 < self.stale_decay <= 1:
            problems.append("stale_decay must be in (0, 1]")
        if self.rollout_rs and not self.rollout_rs_threshold:
            problems.append("rollout_rs needs rollout_rs_threshold")
        if self.engine == "verl":
            problems += verl_engine_problems(self)
        if problems:
            raise ValueError("invalid learner config:\n  " + "\n  ".join(problems))
        return self

    def urls(self) -> list[str]:
        """The proxies to stream from and publish to: ``proxy_urls``, else ``proxy_url``."""
        return list(dict.fromkeys(u.rstrip("/") for u in (self.proxy_urls or (self.proxy_url,))))

    def token(self) -> str:
        from steptap.middleware.client import default_control_token

        return self.control_token or default_control_token() or ""

    def as_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


def verl_engine_problems(cfg: LearnerConfig) -> list[str]:
    """What ``--engine verl`` cannot do (yet), each with what to use instead."""
    out = []
    if cfg.algorithm == "gae" or getattr(cfg, "value_model", False):
        out.append("engine verl: the step-level value model (algorithm gae) runs on the torch engine only; "
                   "use --engine torch, or a critic-free estimator (grpo, rloo, ...)")
    if cfg.truncation_mode == "correct":
        out.append("engine verl: steps sampled with top_p < 1 or top_k > 0 cannot be corrected exactly "
                   "(verl's workers return per-token logprobs, not the distribution); use --truncation-mode "
                   "drop, or sample with the proxy's training values (temperature 1, top_p 1)")
    if cfg.kl_coef > 0 and cfg.lora_rank == 0:
        out.append("engine verl: kl_coef > 0 needs lora_rank > 0 (the reference is the base model with the "
                   "adapter disabled); a separate reference worker group for full fine-tuning is not built "
                   "yet")
    if cfg.workers < 1 or cfg.nodes < 1 or cfg.workers % cfg.nodes:
        out.append("engine verl: workers must be a positive multiple of nodes")
    return out


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> LearnerConfig:
    """Defaults, then the TOML file (its ``[learner]`` table if it has one), then ``overrides``."""
    data: dict[str, Any] = {}
    if path:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
        data.update(raw.get("learner", raw))
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return msgspec.convert(data, LearnerConfig)


# -- command-line flags generated from the Struct fields


def _flag_type(hint: Any) -> tuple[Any, dict[str, Any]]:
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        return type(choices[0]), {"choices": choices}
    if origin in (list, tuple):
        return None, {"nargs": "*", "type": typing.get_args(hint)[0]}
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _flag_type(args[0])
    return hint, {}


def _field_comments() -> dict[str, str]:
    """``name: type = default  # comment`` lines of the Struct above: the comment is the flag's help."""
    import inspect

    out = {}
    for line in inspect.getsource(LearnerConfig).splitlines():
        head, sep, comment = line.partition("  # ")
        if sep and ":" in head and "=" in head:
            out[head.split(":")[0].strip()] = comment.strip()
    return out


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--field-name`` per ``LearnerConfig`` field (``--x/--no-x`` for booleans), default None =
    unset."""
    hints = typing.get_type_hints(LearnerConfig, include_extras=False)
    comments, defaults = _field_comments(), LearnerConfig().as_dict()
    for name in LearnerConfig.__struct_fields__:
        hint = hints[name]
        flag = "--" + name.replace("_", "-")
        help_ = f"{comments.get(name, '')} (default {defaults[name]!r})".lstrip()
        if hint is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_)
            continue
        type_, extra = _flag_type(hint)
        kw = {} if "nargs" in extra else {"type": type_}
        parser.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=help_, **kw, **extra)


def config_from_argv(argv: list[str] | None, prog: str = "steptap learn") -> LearnerConfig:
    parser = argparse.ArgumentParser(prog=prog,
                                     description="Train the policy on the steptap trajectory stream.")
    parser.add_argument("--config", help="TOML file with LearnerConfig fields (top level or [learner])")
    add_config_flags(parser)
    args = vars(parser.parse_args(argv))
    path = args.pop("config")
    return load_config(path, args).validate()
