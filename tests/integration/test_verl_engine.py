"""The verl engine (verl's TrainingWorker over FSDP2, on a local Ray cluster of CPU workers over gloo) against
the torch engine: on the same batch, with the optimizer settings matched explicitly, the loss and the updated
weights agree at world size 2, within a tolerance derived from what legitimately differs.

What differs is float32 reduction order (verl pads prompts on the left, splits micro-batches its own way and,
at world size 2, all-reduces gradients over gloo). So the tolerance is measured, not picked: the torch engine
is run twice on the same batch with two different micro-batch splits, and the largest difference between
those two runs (``d``) bounds how far either engine may be from the exact result; the two engines may then
differ by ``2 d`` (triangle inequality). Each bound has a floor of float32 epsilon times the size of the
reduction, for quantities the two torch runs happen to get bit-identical. The gradient norm (and so the clip
coefficient, which scales every clipped gradient) is a float32 sum over about a million squares per tensor:
its error is measured against the same norm in float64, and doubled likewise.

Weights are compared through AdamW's first step, which is exact to write down: ``w1 = w0 - lr * g / (|g| +
eps)`` (bias-corrected, weight decay 0). That map is monotone in ``g``, so the verl weights must lie in the
interval the torch gradient +- its tolerance maps to (elementwise), plus float32 rounding of ``w`` and of the
few operations AdamW's step makes on the update.
"""

from __future__ import annotations

import pytest
import torch

from steptap.learner.config import LearnerConfig
from steptap.learner.engines.torch_engine import TorchEngine
from steptap.learner.rows import Batch, build_batch
from steptap.middleware.records import Sampling, Step, Trajectory

torch.set_num_threads(1)
EPS32 = torch.finfo(torch.float32).eps
LR, ADAM_EPS = 1e-3, 1e-8


def _config(model_dir: str, **kw: object) -> LearnerConfig:
    # Matched explicitly: verl's AdamW defaults to weight decay 0.01, the torch engine's to 0.
    fields = dict(model_dir=model_dir, lr=LR, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1.0,
                  truncation_mode="drop")
    return LearnerConfig(**{**fields, **kw}).validate()


def _batch(eng: TorchEngine) -> Batch:
    """Two groups of two 2-step ``extends`` chains (packed: verl sees multi-turn rows with masked tool
    tokens), off-policy: the recorded logprobs are the model's minus 0.4 on every other token, so ratios leave
    the clip range and the loss is far from 0."""
    trajs = []
    for g in range(2):
        for m in range(2):
            p1, r1 = [5 + g, 17, 33 + m, 40], [100 + m, 200 + g, 300]
            p2 = p1 + r1 + [41, 42]
            r2 = [400 + m * 7, 500, 600 + g]
            full = p2 + r2
            with torch.no_grad():
                logits = eng.model(input_ids=torch.tensor([full])).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(full[1:])[:, None])[:, 0]
            lp = lp - 0.4 * (torch.arange(len(lp)) % 2)
            s1 = Step(index=0, prompt_token_ids=p1, response_token_ids=r1, prefix="first",
                      response_logprobs=lp[len(p1) - 1:len(p1) - 1 + len(r1)].tolist(), sampling=Sampling())
            s2 = Step(index=1, prompt_token_ids=p2, response_token_ids=r2, prefix="extends",
                      response_logprobs=lp[len(p2) - 1:].tolist(), sampling=Sampling())
            trajs.append(Trajectory(id=f"t{g}{m}", group_id=f"g{g}", status="finished", steps=[s1, s2],
                                    rewards={"r": float(m + g * 0.5)}))
    return build_batch(trajs, version=0)


def _torch_run(model_dir: str, micro_batch_tokens: int) -> tuple:
    eng = TorchEngine(_config(model_dir, micro_batch_tokens=micro_batch_tokens))
    batch = _batch(eng)
    w0 = {k: v.detach().clone() for k, v in eng.model.named_parameters()}
    stats = eng.train_step(batch)
    grads = {k: p.grad.detach().clone() for k, p in eng.model.named_parameters()}  # clipped, as stepped
    w1 = {k: v.detach().clone() for k, v in eng.model.named_parameters()}
    return batch, stats, w0, grads, w1


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict:
    """The torch engine twice: one sequence per micro-batch (12 tokens) vs the whole batch in one: the result
    and its own reduction-order spread; and how far its float32 gradient norm is from the float64 one."""
    batch, a, w0, ga, wa = _torch_run(str(tiny_model_dir), 12)
    _, b, _, gb, _ = _torch_run(str(tiny_model_dir), 1 << 16)
    n = a.tokens
    assert a.pg_clipfrac > 0 and abs(a.loss) > 1e-3  # the batch exercises the clip; the loss is not ~0
    assert a.grad_norm > 1.0  # and the gradient clip: the clip coefficient carries the norm's rounding
    # The clipped gradients are g * c, c = 1 / (norm32 + 1e-6) (torch's clip_grad_norm_), so the exact norm of
    # g is norm64(clipped) * (norm32 + 1e-6): float32 summation over ~1M-element tensors is off by this much.
    clipped64 = torch.sqrt(sum((g.double() ** 2).sum() for g in ga.values())).item()
    norm_rel_err = abs(a.grad_norm - clipped64 * (a.grad_norm + 1e-6)) / a.grad_norm
    d_grad = max(float((ga[k] - gb[k]).abs().max()) for k in ga)
    g_max = max(float(g.abs().max()) for g in ga.values())
    return {
        "batch": batch, "stats": a, "w0": w0, "grads": ga, "w1": wa,
        # Each engine is within its own error of the exact value, so they differ by at most twice that.
        "tol_loss": 2 * max(abs(a.loss - b.loss), EPS32 * n * abs(a.loss)),
        "tol_gnorm": 2 * (norm_rel_err * a.grad_norm + abs(a.grad_norm - b.grad_norm)),
        # per element: the clip coefficient's error (relative) plus the reduction-order spread (absolute)
        "grad_rel": 2 * norm_rel_err,
        "grad_abs": 2 * max(d_grad, EPS32 * n * g_max),
    }


def _adam_first_step(w0: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return w0 - LR * g / (g.abs() + ADAM_EPS)


def test_verl_engine_equals_the_torch_engine_on_the_same_batch(ray_cluster, tiny_model_dir,
                                                              reference) -> None:
    """At world size 2, which adds the gradients' all-reduce to what one worker does. One worker equals the
    torch engine in test_verl_vision (the gradient norm on the same batch) and trains in the LoRA and crash
    tests below: a second run of this batch at world size 1 re-proved that (CI time)."""
    from steptap.learner.engines.verl_engine import VerlEngine

    workers = 2

    eng = VerlEngine(_config(str(tiny_model_dir), engine="verl", workers=workers, micro_batch_tokens=64))
    try:
        eng.keep_gradients()
        stats = eng.train_step(reference["batch"])
        grads = eng.last_gradients()
        weights = eng.hf_weights()
    finally:
        eng.close()
    ref = reference["stats"]
    print(f"workers={workers}: loss {stats.loss:.8f} vs {ref.loss:.8f} (tol {reference['tol_loss']:.2e}), "
          f"grad norm {stats.grad_norm:.6f} vs {ref.grad_norm:.6f} (tol {reference['tol_gnorm']:.2e}), "
          f"entropy {stats.entropy:.6f} vs {ref.entropy:.6f}, clip fraction {stats.pg_clipfrac} vs "
          f"{ref.pg_clipfrac}")
    assert stats.tokens == ref.tokens and stats.seq_tokens == ref.seq_tokens
    # the run's health: the first batch's logprob gap to the recorded logprobs (0.4 on every other token),
    # measured by the workers' own forward pass as the torch engine measures it
    assert stats.gap_tokens == ref.gap_tokens > 0 and abs(stats.logprob_gap - ref.logprob_gap) <= 1e-4
    assert abs(stats.loss - ref.loss) <= reference["tol_loss"]
    assert abs(stats.grad_norm - ref.grad_norm) <= reference["tol_gnorm"]
    assert set(weights) == set(reference["w1"]) == set(grads)  # HF names, every tensor
    for name, w0 in reference["w0"].items():
        g = reference["grads"][name]
        tol = reference["grad_rel"] * g.abs() + reference["grad_abs"]  # [same shape as g]
        assert bool(((grads[name] - g).abs() <= tol).all()), f"{name}: gradients differ beyond the tolerance"
        # The update: AdamW's first step is monotone in g, so w1 lies in the image of [g - tol, g + tol].
        lo, hi = _adam_first_step(w0, g + tol), _adam_first_step(w0, g - tol)
        # float32 rounding: of w itself, and of the ~8 operations AdamW's step makes on the update (|update|
        # <= lr)
        slack = EPS32 * (w0.abs() + 8 * LR)
        w = weights[name]
        assert bool(((w >= lo - slack) & (w <= hi + slack)).all()), f"{name}: the update differs"
    moved = max(float((weights[k] - reference["w0"][k]).abs().max()) for k in weights)
    assert moved > LR / 2  # and the update did happen



def test_verl_lora_trains_the_adapter_publishes_it_and_takes_kl_to_the_base(ray_cluster, tiny_model_dir,
                                                                            reference,
                                                                           tmp_path) -> None:
    """LoRA on the verl engine: only the adapter moves; the reference for the KL term is the base model (the
    adapter disabled), so the KL is exactly 0 before the first update (B starts at 0: identical logits) and
    positive after it; the published directory is a peft adapter with peft's own names that peft loads."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from peft.utils.save_and_load import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from steptap.learner.engines.verl_engine import VerlEngine

    targets = ("q_proj", "v_proj")
    cfg = _config(str(tiny_model_dir), engine="verl", workers=1, micro_batch_tokens=64, lora_rank=4,
                  lora_alpha=8, lora_targets=targets, kl_coef=0.1, lr=1e-2)
    eng = VerlEngine(cfg)
    try:
        first = eng.train_step(reference["batch"])
        second = eng.train_step(reference["batch"])
        state = eng.state_dict()["model"]
        out = eng.write_weights(tmp_path / "weights", version=1)
    finally:
        eng.close()
    assert first.kl == 0.0 and second.kl > 0
    base = {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in state.items()
            if "lora_" not in k}
    for name, w0 in reference["w0"].items():
        assert torch.equal(base[name], w0), f"{name}: a base weight moved under LoRA"
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "adapter_config.json", "adapter_model.safetensors"]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    want = set(get_peft_model_state_dict(get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)),
        LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), task_type="CAUSAL_LM"))))
    from safetensors.torch import load_file

    saved = load_file(str(out / "adapter_model.safetensors"))
    assert set(saved) == want  # peft's own saved names: what vLLM's LoRA loader reads
    assert any("lora_B" in k and bool(v.abs().max() > 0) for k, v in saved.items())  # trained
    loaded = PeftModel.from_pretrained(model, str(out))
    for k, v in get_peft_model_state_dict(loaded).items():
        assert torch.equal(v, saved[k])
    # The verl workers' state as a checkpoint, then a model directory (steptap trained-model): the adapter
    # merged computes what the published adapter on its base computes
    from steptap.learner import checkpoint, trained

    checkpoint.save(str(tmp_path / "ckpt"), {"engine": {"model": state}, "version": 1, "updates": 2,
                                             "config": cfg.as_dict()}, keep=1)
    assert trained.main([str(tmp_path / "ckpt"), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    ids = torch.tensor([[5, 17, 33, 40, 100, 200]])
    with torch.no_grad():
        got = merged(input_ids=ids).logits
        torch.testing.assert_close(got, loaded(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
        bare = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))(input_ids=ids).logits
    assert (got - bare).abs().max() > 1e-3  # the merge carried the trained adapter, not the base alone


# --- crash and --resume on the verl engine, through the daemon on a real proxy and stream -------------------

PROXY_VERSION = 5


def _traj(group: int, member: int) -> Trajectory:
    steps = [Step(trajectory_id=f"g{group}m{member}", index=0, policy_version=PROXY_VERSION,
                  prompt_token_ids=[5, 6, 7], response_token_ids=[100 + member, 200],
                  response_logprobs=[-8.3, -8.3], sampling=Sampling(temperature=1.0))]
    # Group k's rewards are k and k + 0.5: a batch's mean reward says which group was trained.
    return Trajectory(id=f"g{group}m{member}", group_id=f"g{group}", group_size=2, status="finished",
                      steps=steps, rewards={"r": group + 0.5 * member})


async def test_a_crashed_verl_learner_resumes_its_version_and_cursor(ray_cluster, make_proxy, tmp_path,
                                                                    tiny_model_dir) -> None:
    """Three groups in the log. Run 1 trains groups 0 and 1, checkpoints (acknowledging them), trains group 2
    and is killed before its next checkpoint. ``--resume`` restores the verl workers' weights and optimizer
    from the checkpoint, continues at update 3 and version 5, and re-trains group 2 only (it was never
    acknowledged), never groups 0 and 1."""
    import asyncio
    import json

    from steptap.learner import checkpoint, daemon
    from steptap.learner.config import config_from_argv
    from steptap.middleware.log.wal import TrajectoryLog
    from steptap.middleware.records import PolicyVersion

    log_dir = tmp_path / "log"
    log = await TrajectoryLog.open(str(log_dir))
    await log.append(PolicyVersion(version=PROXY_VERSION))
    for g in range(3):
        for m in range(2):
            await log.append(_traj(g, m))
    await log.close()
    proxy = await make_proxy("http://127.0.0.1:9", log_dir=log_dir)
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    argv = ["--engine", "verl", "--workers", "1", "--truncation-mode", "drop", "--proxy-url", proxy.url,
            "--control-token", proxy.token, "--model-dir", str(tiny_model_dir), "--consumer", "verl-test",
            "--batch-groups", "1", "--group-size", "2", "--push-every", "0", "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", "2", "--metrics-file", str(metrics), "--lr", "1e-3", "--no-progress",
            "--health-check", "warn"]  # made-up logprobs (-8.3): the check would stop at the first batch

    def rows() -> list[dict]:
        return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []

    run1 = asyncio.create_task(daemon._run(config_from_argv([*argv, "--max-updates", "4"])))
    while len(rows()) < 3:  # then it waits for a fourth group that never comes
        assert not run1.done(), run1.exception()
        await asyncio.sleep(0.5)
    run1.cancel()  # the crash: no clean-stop checkpoint
    with pytest.raises(asyncio.CancelledError):
        await run1
    state = checkpoint.load_latest(str(ckpt))
    assert state["updates"] == 2 and state["version"] == PROXY_VERSION
    assert set(state["engine"]) == {"model", "optimizer", "rng"}  # the workers' full state, as safetensors
    acked = json.loads((log_dir / "consumers" / "verl-test.cursor").read_text())["cursor"]
    assert acked == state["cursor"]

    await daemon._run(config_from_argv([*argv, "--max-updates", "3", "--resume"]))
    r = rows()
    assert [x["update"] for x in r] == [1, 2, 3, 3]
    assert [x["reward_mean"] for x in r] == [0.25, 1.25, 2.25, 2.25]  # group 2 again, groups 0 and 1 never
    assert r[3]["policy_version"] == PROXY_VERSION
    resumed = checkpoint.load_latest(str(ckpt))
    assert resumed["updates"] == 3 and resumed["cursor"] != state["cursor"]
    assert json.loads((log_dir / "consumers" / "verl-test.cursor").read_text())["cursor"] == resumed["cursor"]
    # The resumed run started from run 1's checkpointed weights (not the model dir's) and moved them.
    before, after = state["engine"]["model"], resumed["engine"]["model"]
    assert set(before) == set(after) and any(not torch.equal(after[k], before[k]) for k in before)
    # The verl checkpoint as a model directory (steptap trained-model): the workers' weights, as HF reads them
    from transformers import AutoModelForCausalLM

    from steptap.learner import trained

    assert trained.main([str(ckpt), str(tmp_path / "trained")]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "trained", dtype=torch.float32).state_dict()
    for k, v in after.items():
        torch.testing.assert_close(loaded[k], v.float(), rtol=0, atol=0, msg=k)
