"""The torch engine on the tiny model: packing is exact, temperature/truncation give the right behaviour
logprobs, LoRA trains only the adapter (and its reference is the base), checkpoints round-trip via fsspec."""

from __future__ import annotations

import pytest
import torch

from steptap.learner import checkpoint
from steptap.learner.config import LearnerConfig
from steptap.learner.engines.torch_engine import TorchEngine, sampler_logprobs, token_logprobs
from steptap.learner.rows import build_batch
from steptap.middleware.records import Sampling, Step, Trajectory

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> TorchEngine:
    return TorchEngine(LearnerConfig(model_dir=str(tiny_model_dir), lr=1e-3,
                                     micro_batch_tokens=64).validate())


def _raw_logprobs(eng: TorchEngine, ids: list[int], start: int) -> list[float]:
    """What vLLM records: log softmax of the unscaled logits at each response position."""
    with torch.no_grad():
        logits = eng.model(input_ids=torch.tensor([ids])).logits[0, :-1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    return lp[start - 1:].tolist()


def _chain_trajs(eng: TorchEngine, temperature: float = 1.0, top_p: float = 1.0) -> list[Trajectory]:
    """Two groups of two trajectories, each a 2-step `extends` chain, logprobs recorded from the model."""
    trajs = []
    for g in range(2):
        for m in range(2):
            p1 = [5 + g, 17, 33 + m, 40]
            r1 = [100 + m, 200 + g, 300]
            p2 = p1 + r1 + [41, 42]
            r2 = [400 + m * 7, 500]
            full = p2 + r2
            lp = _raw_logprobs(eng, full, 1)
            s1 = Step(index=0, prompt_token_ids=p1, response_token_ids=r1, prefix="first",
                      response_logprobs=lp[len(p1) - 1:len(p1) - 1 + len(r1)],
                      sampling=Sampling(temperature=temperature, top_p=top_p))
            s2 = Step(index=1, prompt_token_ids=p2, response_token_ids=r2, prefix="extends",
                      response_logprobs=lp[len(p2) - 1:],
                      sampling=Sampling(temperature=temperature, top_p=top_p))
            trajs.append(Trajectory(id=f"t{g}{m}", group_id=f"g{g}", status="finished", steps=[s1, s2],
                                    rewards={"r": float(m + g * 0.5)}))
    return trajs


def test_sampler_logprobs_reduce_to_plain_softmax_without_truncation() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 50, generator=gen)
    targets = torch.randint(0, 50, (2, 5), generator=gen)
    temp = torch.full((2, 5), 0.7)
    plain = token_logprobs(logits, targets, temp)
    same = sampler_logprobs(logits, targets, temp, torch.ones(2, 5), torch.zeros(2, 5, dtype=torch.long))
    torch.testing.assert_close(same, plain)
    top1 = sampler_logprobs(logits, logits.argmax(-1), temp, torch.ones(2, 5),
                            torch.ones(2, 5, dtype=torch.long))
    torch.testing.assert_close(top1, torch.zeros(2, 5))  # top_k = 1: the argmax is certain
    nucleus = sampler_logprobs(logits, logits.argmax(-1), temp, torch.full((2, 5), 0.5),
                               torch.zeros(2, 5).long())
    assert bool((nucleus >= token_logprobs(logits, logits.argmax(-1), temp)).all())  # renormalised upward


def _rounding_budget(eng: TorchEngine, longest: int) -> float:
    """How far two float32 evaluations of the same loss may drift apart, relative to the scale of what they
    compute. A sum of n terms carries at most ~n*u relative error (u = float32 unit roundoff, the standard
    gamma_n bound); to first order the bounds of composed steps add, so the budget is u times the summed
    lengths of the reductions between a parameter and the loss: the vocabulary softmax, and per layer the
    hidden and MLP projections and the attention over the sequence. Packing changes the reduction order (other
    shapes, other micro-batches), never the mathematics, so anything above this is a packing bug, which moves
    a gradient by the order of the gradient itself."""
    c = eng.model.config
    u = torch.finfo(torch.float32).eps / 2
    return u * (c.vocab_size + c.num_hidden_layers * (c.hidden_size + c.intermediate_size + longest))


def test_packed_and_unpacked_batches_give_the_same_loss_and_gradient(engine: TorchEngine) -> None:
    """Packing is exact up to float rounding: loss and gradient agree within the rounding budget above.

    Why this once flaked: it compared the weights *after* AdamW's first step, which moves each weight by about
    lr * g / (|g| + eps). For a weight whose gradient is near Adam's eps (1e-8) a rounding difference of 1e-10
    in g becomes 1e-5 in the weight (lr/eps = 1e5 amplification); whether such a weight exists depends on the
    freshly built model, not on packing. The gradient is what packing promises; the update is compared only
    through it."""
    trajs = _chain_trajs(engine)
    packed = build_batch(trajs, version=0, pack_extends=True)
    flat = build_batch(trajs, version=0, pack_extends=False)
    assert len(packed.sequences) == 4 and len(flat.sequences) == 8
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    opt_state = engine.optimizer.state_dict()

    def run(batch) -> tuple:  # type: ignore[no-untyped-def]
        engine.model.load_state_dict(state)
        engine.optimizer.load_state_dict(opt_state)
        stats = engine.train_step(batch)
        # After train_step each .grad holds the batch's gradient, clipped; both runs clip by their own norm.
        grads = {n: p.grad.clone() for n, p in engine.model.named_parameters()}
        return stats, grads, {k: v.clone() for k, v in engine.model.state_dict().items()}

    a, grad_a, after = run(packed)
    b, grad_b, _ = run(flat)
    engine.model.load_state_dict(state)
    engine.optimizer.load_state_dict(opt_state)
    assert a.tokens == b.tokens == 4 * 5
    assert a.seq_tokens < b.seq_tokens  # packing forwards fewer tokens
    assert abs(a.ppo_kl) < 1e-5 and a.pg_clipfrac == 0.0  # recorded logprobs are the model's: on-policy

    budget = _rounding_budget(engine, max(len(s.input_ids) for s in packed.sequences))
    # On-policy the ratio is 1, so the loss is -mean(advantage) over the trained tokens: its terms are bounded
    # by the advantages' magnitudes.
    from steptap.learner import algos

    adv_scale = float(torch.cat(algos.compute_advantages(packed.samples, engine.cfg)).abs().mean())
    assert abs(a.loss - b.loss) <= budget * adv_scale, (a.loss, b.loss)
    assert abs(a.grad_norm - b.grad_norm) <= budget * a.grad_norm
    scale = max(float(g.abs().max()) for g in grad_a.values())
    worst = max(float((grad_a[n] - grad_b[n]).abs().max()) for n in grad_a)
    assert worst <= budget * scale, (worst, budget * scale)
    assert scale > 0 and any(not torch.equal(v, state[k]) for k, v in after.items())  # the update did happen


def test_temperature_and_truncation_shift_the_raw_recorded_logprobs(engine: TorchEngine) -> None:
    """Raw vLLM logprobs at T = 0.5 (and top_p 0.9) are not the sampler's; the engine corrects them, so
    on-policy data shows no policy change (ppo_kl ~ 0) before the update."""
    for temperature, top_p in ((0.5, 1.0), (0.5, 0.9)):
        batch = build_batch(_chain_trajs(engine, temperature, top_p), version=0, truncation_mode="correct")
        state = {k: v.clone() for k, v in engine.model.state_dict().items()}
        st = engine.train_step(batch)
        engine.model.load_state_dict(state)
        if top_p == 1.0:
            assert abs(st.ppo_kl) < 1e-4  # behaviour = the model at T exactly
        else:
            assert st.ppo_kl <= 1e-4  # truncation only raises the sampler's logprob of a sampled token


def test_the_logprob_gap_to_the_recorded_logprobs_is_measured_before_the_update(engine: TorchEngine) -> None:
    """The run's health (learner/health.py): mean |recorded - the policy's raw logprob| over the trained
    tokens the current version sampled, read off the passes the update makes anyway, on both paths (T = 1:
    the first epoch's forward; T != 1: the behaviour pass). Logprobs recorded by these very weights: ~0;
    shifted by 2.3 nats (weights other than the sampler's): 2.3; sampled by an older version: not measured."""
    for temperature in (1.0, 0.5):
        state = {k: v.clone() for k, v in engine.model.state_dict().items()}
        trajs = _chain_trajs(engine, temperature)
        st = engine.train_step(build_batch(trajs, version=0))
        tokens = sum(len(s.response_token_ids) for t in trajs for s in t.steps)
        assert st.gap_tokens == tokens and st.logprob_gap < 1e-4
        engine.model.load_state_dict(state)
        for t in trajs:
            for s in t.steps:
                s.response_logprobs = [lp - 2.3 for lp in s.response_logprobs]
        st = engine.train_step(build_batch(trajs, version=0))
        engine.model.load_state_dict(state)
        assert st.gap_tokens == tokens and abs(st.logprob_gap - 2.3) < 1e-3
        assert engine.train_step(build_batch(trajs, version=1)).gap_tokens == 0  # lag 1: not this version's
        engine.model.load_state_dict(state)


def test_lora_trains_only_the_adapter_and_checkpoints_round_trip(tiny_model_dir) -> None:
    cfg = LearnerConfig(model_dir=str(tiny_model_dir), lora_rank=4, lora_alpha=8, lr=1e-2, kl_coef=0.1,
                        lora_targets=("q_proj", "v_proj")).validate()
    eng = TorchEngine(cfg)
    trainable = checkpoint.trainable_state(eng.model)
    assert trainable and all("lora_" in k for k in trainable)
    base_before = {k: v.clone() for k, v in eng.model.state_dict().items() if "lora_" not in k}
    stats = eng.train_step(build_batch(_chain_trajs(eng), version=0))
    assert stats.kl == pytest.approx(0.0, abs=1e-6)  # adapter B starts at zero: policy == reference
    second = eng.train_step(build_batch(_chain_trajs(eng), version=0))
    assert second.kl > 0  # after one update the policy has left the base (the reference)
    for k, v in eng.model.state_dict().items():
        if "lora_" not in k:
            assert torch.equal(v, base_before[k])

    url = "memory://steptap-test-ckpt"
    state = {"model": checkpoint.trainable_state(eng.model), "optimizer": eng.optimizer.state_dict(),
             "cursor": "0:123", "consumed_after_cursor": ["x"], "version": 3, "updates": 2,
             "config": cfg.as_dict(), "rng": torch.get_rng_state()}
    checkpoint.save(url, state, keep=1)
    state["updates"] = 4
    checkpoint.save(url, state, keep=1)
    loaded = checkpoint.load_latest(url)
    assert loaded is not None and loaded["updates"] == 4 and loaded["cursor"] == "0:123"
    assert loaded["config"]["lora_rank"] == 4
    fresh = TorchEngine(cfg)
    checkpoint.restore(fresh.model, fresh.optimizer, loaded)
    for k, v in checkpoint.trainable_state(fresh.model).items():
        torch.testing.assert_close(v, state["model"][k])
    assert checkpoint.load_latest("memory://steptap-no-such-ckpt") is None


def test_decoupled_rollout_correction_and_ppo_epochs(tiny_model_dir) -> None:
    """rollout_is=token: the ratio is taken against the learner's own (proximal) logprobs and verl's truncated
    IS weights min(proximal/behaviour, 2) carry the mismatch; a second PPO epoch sees the clip."""
    cfg = LearnerConfig(model_dir=str(tiny_model_dir), lr=2e-2, epochs=2, rollout_is="token",
                        rollout_is_threshold=2.0).validate()
    eng = TorchEngine(cfg)
    trajs = _chain_trajs(eng)
    on_policy = eng.train_step(build_batch(trajs, version=0))
    # Proximal == behaviour before the update
    assert on_policy.rollout_is_mean == pytest.approx(1.0, abs=1e-4)
    assert on_policy.pg_clipfrac > 0  # epoch 2 runs on updated weights with a large lr: some tokens clip
    for t in trajs:  # the sampler gave these tokens less mass than the learner does now: weights > 1, capped
        for s in t.steps:
            s.response_logprobs = [lp - 1.0 for lp in s.response_logprobs]
    stale = eng.train_step(build_batch(trajs, version=0))
    assert 1.0 < stale.rollout_is_mean <= 2.0 + 1e-6
