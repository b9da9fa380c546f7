"""``LearnerConfig``: every knob of ``steptap learn``, with its default, in one msgspec Struct.

A config file (TOML) sets any subset of the fields; every field is also a command-line flag
(``--lr 1e-5``, ``--lora-rank 8``, ``--no-resume``), generated from the Struct so the two never drift
(``steptap.middleware.cli.flags``, the one generator; a field's help is its ``msgspec.Meta`` description).
Precedence: defaults < file < flags < ``STEPTAP_CONTROL_TOKEN`` (only when no token was given).
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from steptap.middleware.cli.flags import add_struct_flags
from steptap.middleware.cli.flags import described as _help  # a field's description is its flag's help


class LearnerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # -- where the data comes from and where the weights go
    proxy_url: Annotated[str, _help("one proxy (an alias kept for proxy_urls)")] = "http://127.0.0.1:8400"
    proxy_urls: Annotated[tuple[str, ...], _help(
        "several proxies: every stream consumed, every version published to all")] = ()
    control_token: Annotated[str, _help("empty: $STEPTAP_CONTROL_TOKEN")] = ""
    consumer: Annotated[str, _help(
        "the stream consumer name: its cursor is acknowledged at checkpoints")] = "learner"
    model_dir: Annotated[str, _help("Hugging Face model directory the policy starts from")] = ""
    engine: Annotated[Literal["torch", "verl"], _help(
        "torch: this process; verl: verl's TrainingWorker group on Ray")] = "torch"
    device: Annotated[str, _help("auto: cuda when available, else cpu")] = "auto"
    seed: Annotated[int, _help("torch's random seed")] = 0
    num_threads: Annotated[int, _help("torch CPU threads; 0: torch's default")] = 0

    # -- the verl engine (engine = "verl"): FSDP2 TrainingWorkers on a Ray cluster; see docs/verl-engine.md
    ray_address: Annotated[str, _help(
        "empty: start a local Ray cluster; auto: join the running one; or HOST:PORT")] = ""
    workers: Annotated[int, _help(
        "training workers: one per GPU (on a CPU-only cluster, one process each)")] = 1
    nodes: Annotated[int, _help("Ray nodes the workers spread over (workers per node = workers / nodes)")] = 1
    worker_cpus: Annotated[int, _help("CPUs each worker reserves from Ray")] = 1
    fsdp_size: Annotated[int, _help("FSDP shard group size; -1: shard over all workers")] = -1
    param_offload: Annotated[bool, _help(
        "FSDP: keep parameters in CPU memory between uses (large models on few GPUs)")] = False
    optimizer_offload: Annotated[bool, _help("FSDP: keep optimizer state in CPU memory")] = False
    dynamic_bsz: Annotated[bool, _help(
        "micro-batches by token budget (micro_batch_tokens per worker), verl's packing")] = True
    gradient_checkpointing: Annotated[bool, _help(
        "recompute activations in backward (GPU memory for time)")] = False
    model_dtype: Annotated[str, _help(
        "parameter dtype on a GPU: fp32 (float32 weights and optimizer state, bf16 compute) | bf16")] = "fp32"

    # -- tracking through verl.utils.tracking.Tracking, besides the JSON-lines metrics file
    trackers: Annotated[tuple[str, ...], _help(
        "e.g. console tensorboard wandb mlflow (wandb runs offline unless configured)")] = ()
    project: Annotated[str, _help("the tracker's project name")] = "steptap"
    experiment: Annotated[str, _help("the tracker's run name")] = "learn"

    # -- algorithm (verl.trainer.ppo.core_algos, by name)
    algorithm: Annotated[str, _help(
        "advantage estimator: grpo | rloo | reinforce_plus_plus | ... | gae (step-level, value head)"
    )] = "grpo"
    policy_loss: Annotated[str, _help("vanilla (PPO-clip) | gspo | cispo | ...")] = "vanilla"
    loss_agg_mode: Annotated[str, _help(
        "verl loss aggregation: token-mean | seq-mean-token-sum | seq-mean-token-mean | ...")] = "token-mean"
    norm_adv_by_std: Annotated[bool, _help("GRPO's std scaling (False: Dr.GRPO)")] = True
    gamma: Annotated[float, _help("discount over steps for per-step (process) rewards")] = 1.0
    lam: Annotated[float, _help("gae: GAE lambda over steps")] = 0.95
    value_lr: Annotated[float, _help("gae: the value head's AdamW learning rate")] = 1e-3
    value_clip: Annotated[float, _help(
        "gae: verl's cliprange_value around the values the advantages were computed with")] = 0.5
    clip_ratio_low: Annotated[float, _help("PPO clip below 1 (ratio >= 1 - this)")] = 0.2
    clip_ratio_high: Annotated[float, _help("PPO clip above 1 (ratio <= 1 + this)")] = 0.2
    clip_ratio_c: Annotated[float, _help("dual-clip bound for negative advantages")] = 3.0
    entropy_coef: Annotated[float, _help("entropy bonus in the loss; 0: off")] = 0.0
    kl_coef: Annotated[float, _help("> 0: KL loss to a frozen reference")] = 0.0
    kl_type: Annotated[str, _help(
        "verl kl_penalty name: kl | abs | mse | low_var_kl | k3+ ...")] = "low_var_kl"
    reference_dir: Annotated[str, _help("the reference model; empty: model_dir")] = ""

    # -- batches and optimisation
    batch_groups: Annotated[int, _help("groups (GRPO prompts) per update")] = 8
    group_size: Annotated[int, _help("members expected per group when the trajectories do not say")] = 8
    group_timeout_s: Annotated[float, _help(
        "a group that waited this long is used with the members it has")] = 120.0
    min_group_members: Annotated[int, _help(
        "fewer complete members after the timeout: dropped (counted)")] = 2
    skip_uniform_groups: Annotated[bool, _help(
        "dynamic sampling (DAPO): a group whose members all got one reward gives a group-relative estimator "
        "no signal; it is consumed, logged as a skipped_group row and not counted toward the batch, which "
        "waits for groups that vary (the driver resamples)")] = False
    epochs: Annotated[int, _help("passes over each batch (PPO epochs); > 1 makes the clip matter")] = 1
    micro_batch_tokens: Annotated[int, _help("token budget of one forward/backward (padded tokens)")] = 8192
    lr: Annotated[float, _help("AdamW learning rate")] = 1e-6
    weight_decay: Annotated[float, _help("AdamW weight decay")] = 0.0
    betas: Annotated[tuple[float, float], _help("AdamW betas")] = (0.9, 0.999)
    grad_clip: Annotated[float, _help("gradient norm clip")] = 1.0
    train_aborted: Annotated[bool, _help(
        "aborted/timed-out members count toward their group but are not trained on")] = False
    train_anonymous: Annotated[bool, _help(
        "anonymous calls (no session) are one-step trajectories anyone reaching the proxy can write: not "
        "trained on")] = False

    # -- LoRA (peft); rank 0 trains all weights
    lora_rank: Annotated[int, _help("LoRA rank; 0: train all weights")] = 0
    lora_alpha: Annotated[int, _help("LoRA alpha (the update is scaled by alpha / rank)")] = 16
    lora_dropout: Annotated[float, _help("dropout on the LoRA branch")] = 0.0
    lora_targets: Annotated[tuple[str, ...], _help("module names LoRA adapts")] = (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

    # -- off-policy data
    max_staleness: Annotated[int, _help(
        "steps sampled > this many versions behind are dropped / down-weighted; -1: off")] = 4
    stale_mode: Annotated[Literal["drop", "downweight"], _help(
        "what happens to steps older than max_staleness")] = "drop"
    stale_decay: Annotated[float, _help("downweight: weight = stale_decay ** (lag - max_staleness)")] = 0.5
    truncation_mode: Annotated[Literal["correct", "drop"], _help(
        "steps sampled with top_p < 1 or top_k > 0")] = "correct"
    rollout_is: Annotated[Literal["none", "token", "sequence"], _help(
        "verl rollout correction (decoupled TIS)")] = "none"
    rollout_is_threshold: Annotated[float, _help("rollout_is: the importance weights' upper bound")] = 2.0
    rollout_rs: Annotated[str, _help("verl rejection sampling modes, e.g. \"token_k1\"; empty: off")] = ""
    rollout_rs_threshold: Annotated[str, _help("rollout_rs: its threshold(s), verl's format")] = ""
    pack_extends: Annotated[bool, _help("merge `extends` chains into one sequence")] = True

    # -- vision steps (learner/vision.py)
    vision_check: Annotated[Literal["warn", "stop"], _help(
        "the first batch with vision steps: the learner's logprobs against vLLM's beyond vision_logprob_tol "
        "are an error line and a metric (warn), or stop the learner (stop)")] = "warn"
    vision_logprob_tol: Annotated[float, _help(
        "largest per-token logprob gap the vision check accepts (1e-4: the tests' float32 tolerance; a bf16 "
        "learner needs more)")] = 1e-4

    # -- the run's health (learner/health.py, docs/health.md)
    health_check: Annotated[Literal["stop", "warn", "off"], _help(
        "what the health check does when nothing can be learned (no reward variance, no token in the loss, "
        "logprobs unlike vLLM's): stop the run with the diagnosis, or only warn; it always warns, after the "
        "first update")] = "stop"
    health_window: Annotated[int, _help(
        "batches in a row with nothing learnable before the check stops the run")] = 5
    health_gap_nats: Annotated[float, _help(
        "the mean |vLLM - learner| logprob of the first batch beyond which the run stops (the learner does "
        "not score with the weights vLLM sampled with)")] = 0.5
    health_stall_s: Annotated[float, _help(
        "no batch for this long: the check reads the proxies (sessions that never finish, pending rewards)")
    ] = 300.0

    # -- loop, checkpoints, what the user sees
    push_every: Annotated[int, _help("publish weights to the proxy every N updates; 0: never")] = 1
    weights_dir: Annotated[str, _help(
        "where published weights go (a path vLLM can read)")] = "./steptap-weights"
    weight_sync: Annotated[Literal["disk", "collective"], _help(
        "disk: write a directory vLLM reloads; collective: broadcast into vLLM's workers (gloo on CPU, NCCL "
        "on CUDA); full weights only: LoRA adapters always go through disk (docs/weight-transfer.md)"
    )] = "disk"
    transfer_address: Annotated[str, _help(
        "collective: this host's address as vLLM's workers reach it; empty: guessed")] = ""
    transfer_timeout_s: Annotated[float, _help(
        "collective: bound on the rendezvous and on each tensor")] = 120.0
    disk_every: Annotated[int, _help(
        "collective: every Nth version through disk anyway, so a replica that restarts (or a run whose "
        "learner died) finds weights on disk at most N versions old; 0: never (only when a proxy asks)")] = 10
    checkpoint_dir: Annotated[str, _help("any fsspec URL")] = "./steptap-checkpoints"
    checkpoint_every: Annotated[int, _help("updates; the stream cursor is acknowledged only here")] = 10
    keep_checkpoints: Annotated[int, _help("checkpoints kept (older ones are deleted)")] = 2
    resume: Annotated[bool, _help("continue from the latest checkpoint in checkpoint_dir")] = False
    max_updates: Annotated[int, _help("stop after this many updates; 0: run until stopped")] = 0
    metrics_file: Annotated[str, _help("JSON-lines metrics, one line per update")] = "steptap-metrics.jsonl"
    tensorboard_dir: Annotated[str, _help("empty: off (needs the tensorboard package)")] = ""
    progress: Annotated[bool, _help("rich progress bar and one status line per update")] = True

    def validate(self) -> LearnerConfig:
        """Raise ``ValueError`` with every problem at once; checks verl's registries by name."""
        from verl.trainer.ppo import core_algos

        problems = []
        if not self.model_dir:
            problems.append("model_dir is required")
        for name in ("model_dir", "reference_dir"):  # a hub name (org/name) is left to transformers
            path = getattr(self, name)
            if path and _looks_like_a_path(path) and not Path(path).expanduser().is_dir():
                problems.append(f"{name} {path!r}: no such directory")
        if self.algorithm not in core_algos.ADV_ESTIMATOR_REGISTRY:
            problems.append(f"algorithm {self.algorithm!r}: gae or a critic-free verl advantage estimator")
        if self.algorithm == "gae" and not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1
                                            and self.value_lr > 0):
            problems.append("gae needs 0 <= gamma <= 1, 0 <= lam <= 1 and value_lr > 0")
        if self.policy_loss not in core_algos.POLICY_LOSS_REGISTRY or self.policy_loss == "bypass_mode":
            problems.append(f"policy_loss {self.policy_loss!r}: one of "
                            f"{sorted(core_algos.POLICY_LOSS_REGISTRY)}")
        for name in ("batch_groups", "group_size", "epochs", "micro_batch_tokens", "checkpoint_every",
                     "health_window"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if self.lr <= 0:
            problems.append("lr must be > 0")
        from steptap.learner.health import BATCH_SCOPE

        if self.skip_uniform_groups and self.algorithm in BATCH_SCOPE:
            problems.append(f"skip_uniform_groups: {self.algorithm} compares a sample with the batch, not "
                            "its group; a uniform group still teaches it")
        if not (self.health_gap_nats > 0 and self.health_stall_s > 0):
            problems.append("health_gap_nats and health_stall_s must be > 0")
        if not 0 < self.stale_decay <= 1:
            problems.append("stale_decay must be in (0, 1]")
        if self.rollout_rs and not self.rollout_rs_threshold:
            problems.append("rollout_rs needs rollout_rs_threshold")
        if self.engine == "verl":
            problems += verl_engine_problems(self)
        if problems:
            raise ValueError("invalid learner config:\n  " + "\n  ".join(problems))
        return self

    def through_disk(self, version: int) -> bool:
        """Whether ``version`` is published through disk: always under ``weight_sync = "disk"``; under
        collective, every ``disk_every``-th (a proxy that wants one, ``disk_wanted``, gets it regardless)."""
        return self.weight_sync == "disk" or (self.disk_every > 0 and version % self.disk_every == 0)

    def urls(self) -> list[str]:
        """The proxies to stream from and publish to: ``proxy_urls``, else ``proxy_url``; each as both clients
        parse it (``/v1`` stripped: one proxy named twice is one)."""
        from steptap.middleware.client import proxy_url

        return list(dict.fromkeys(proxy_url(u).name for u in (self.proxy_urls or (self.proxy_url,))))

    def token(self) -> str:
        from steptap.middleware.client import default_control_token

        return self.control_token or default_control_token() or ""

    def as_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


def _url_problems(urls: tuple[str, ...]) -> list[str]:
    """What is wrong with each proxy URL, as both clients would refuse it (at start, not at the first
    publish)."""
    from steptap.middleware.client import proxy_url

    out = []
    for url in urls:
        try:
            proxy_url(url)
        except ValueError as exc:
            out.append(str(exc))
    return out


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
    cfg = msgspec.convert(data, LearnerConfig)
    problems = _url_problems(cfg.proxy_urls or (cfg.proxy_url,))
    if problems:  # here, not at the first publish or stream
        raise ValueError("invalid learner config:\n  " + "\n  ".join(f"proxy_urls: {p}" for p in problems))
    return cfg


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--field-name`` per ``LearnerConfig`` field (``flags.py``: its help the field's description),
    default None = unset, so a value from the config file stands unless a flag is given."""
    add_struct_flags(parser, LearnerConfig, layered=True)


def _looks_like_a_path(name: str) -> bool:
    """A local path, not a hub name (``org/name``: one slash, no leading dot, slash or tilde)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


def config_from_argv(argv: list[str] | None, prog: str = "steptap learn") -> LearnerConfig:
    parser = argparse.ArgumentParser(prog=prog,
                                     description="Train the policy on the steptap trajectory stream.")
    parser.add_argument("--config", help="TOML file with LearnerConfig fields (top level or [learner])")
    add_config_flags(parser)
    args = vars(parser.parse_args(argv))
    path = args.pop("config")
    return load_config(path, args).validate()
