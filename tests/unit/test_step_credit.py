"""Step-level credit (``algorithm = "gae"``): process rewards stay on the step they were given on, GAE over
steps equals a worked example, the torch engine's value head learns the returns with its own optimizer, and it
is saved in the learner's checkpoint and restored on ``--resume``."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from steptap.learner import algos, checkpoint, daemon
from steptap.learner.config import LearnerConfig, config_from_argv
from steptap.learner.engines.torch_engine import TorchEngine
from steptap.learner.rows import build_batch, step_rewards
from steptap.middleware.records import Sampling, Step, Trajectory

torch.set_num_threads(1)
EPS64 = torch.finfo(torch.float64).eps


def _step(index: int, prompt: list[int], response: list[int], *, rewards: dict | None = None,
          prefix: str = "first", status: str = "ok") -> Step:
    return Step(index=index, prompt_token_ids=prompt, response_token_ids=response, prefix=prefix,
                status=status,
                response_logprobs=[-1.0] * len(response), rewards=rewards or {}, sampling=Sampling())


def _two_step(tid: str = "t", group: str = "g", first_token: int = 1) -> Trajectory:
    """A tool call then an answer: the tool call got a process reward of 0.5 on its step, the answer the
    trajectory reward 1.0 when the session finished."""
    p1, r1 = [first_token, 2, 3], [10, 11]
    p2, r2 = p1 + r1 + [4, 5], [12, 13, 14]
    return Trajectory(id=tid, group_id=group, status="finished", rewards={"answer": 1.0}, steps=[
        _step(0, p1, r1, rewards={"well_formed_call": 0.5}),
        _step(1, p2, r2, prefix="extends")])


def test_gae_over_two_steps_equals_the_worked_example() -> None:
    batch = build_batch([_two_step()], version=0, gamma=0.9)
    assert [s.reward for s in batch.samples] == [0.5, 1.0]  # each reward on the step it was given on
    values = torch.tensor([0.2, 0.6], dtype=torch.float64)  # V at each step's action boundary
    adv, ret = algos.step_gae(batch.samples, values, gamma=0.9, lam=0.8)
    # Worked by hand, gamma = 0.9, lambda = 0.8, V after the last step = 0:
    #   delta_1 = r_1 + 0           - V_1 = 1.0 - 0.6             = 0.4
    #   delta_0 = r_0 + gamma * V_1 - V_0 = 0.5 + 0.9 * 0.6 - 0.2 = 0.84
    #   A_1 = delta_1 = 0.4
    #   A_0 = delta_0 + gamma * lambda * A_1 = 0.84 + 0.72 * 0.4  = 1.128
    #   returns (the value targets) = A + V: 1.328 and 1.0
    # Advantages are then whitened over the batch's steps with verl's masked_whiten, whose mean and variance
    # carry small epsilons: mean = sum / (n + 1e-8); variance = mean of squared deviations, times n / (n - 1);
    # whitened = deviation / sqrt(variance + 1e-8). Without the epsilons: mean 0.764, deviations +-0.364,
    # variance 0.264992, whitened +-0.364 / 0.51477 = +-1/sqrt(2) (two values always whiten to +-1/sqrt(2)).
    tol = 64 * EPS64  # a few dozen float64 operations on numbers of order 1
    assert ret.tolist() == pytest.approx([1.328, 1.0], abs=tol)
    mean = (1.128 + 0.4) / (2 + 1e-8)
    dev = [1.128 - mean, 0.4 - mean]
    var = (dev[0] ** 2 + dev[1] ** 2) / (2 + 1e-8) * 2 / (2 - 1)
    assert adv.tolist() == pytest.approx([d / math.sqrt(var + 1e-8) for d in dev], abs=tol)
    assert adv.tolist() == pytest.approx([2 ** -0.5, -(2 ** -0.5)], abs=1e-7)  # the epsilons' size


def test_gae_is_per_trajectory_and_lambda_zero_is_one_step_td() -> None:
    a, b = _two_step("a"), _two_step("b")
    b.rewards = {"answer": 0.0}
    batch = build_batch([a, b], version=0, gamma=1.0)
    values = torch.tensor([0.1, 0.3, 0.2, 0.4], dtype=torch.float64)
    _, ret = algos.step_gae(batch.samples, values, gamma=1.0, lam=0.0)
    # lambda = 0: return_k = r_k + gamma V_{k+1}; the last step of each trajectory bootstraps from 0, never
    # from the next trajectory's first step.
    assert ret.tolist() == pytest.approx([0.5 + 0.3, 1.0, 0.5 + 0.4, 0.0], abs=8 * EPS64)


def test_a_dropped_steps_reward_moves_to_the_trained_step_before_it() -> None:
    t = _two_step()
    t.steps.append(_step(2, [7], [8], rewards={"late": 2.0}, status="failed"))
    batch = build_batch([t], version=0, gamma=0.5)
    assert step_rewards(sorted(t.steps, key=lambda s: s.index), 1.0) == [0.5, 0.0, 3.0]  # R on the last step
    assert batch.counts["dropped_failed"] == 1
    assert [s.reward for s in batch.samples] == [0.5, 0.5 * 3.0]  # one step later: discounted once


def test_config_accepts_gae_and_checks_its_ranges() -> None:
    assert LearnerConfig(model_dir="m", algorithm="gae").validate().algorithm == "gae"
    with pytest.raises(ValueError, match="lam"):
        LearnerConfig(model_dir="m", algorithm="gae", lam=1.5).validate()
    with pytest.raises(ValueError, match="algorithm 'nope'"):
        LearnerConfig(model_dir="m", algorithm="nope").validate()


def test_engine_value_head_learns_the_returns(tiny_model_dir) -> None:
    """The value head regresses onto the GAE returns: its loss falls over repeated updates on one batch of
    eight distinct states (a linear head on 256 features can fit them; the policy barely moves at lr 1e-9)."""
    cfg = LearnerConfig(model_dir=str(tiny_model_dir), algorithm="gae", lr=1e-9, value_lr=5e-2, gamma=0.9,
                        lam=0.8, micro_batch_tokens=64).validate()
    eng = TorchEngine(cfg)
    trajs = [_two_step(f"t{i}", f"g{i % 2}", first_token=1 + 20 * i) for i in range(4)]  # 8 distinct states
    for i, t in enumerate(trajs):
        t.rewards = {"answer": float(i)}
    batch = build_batch(trajs, version=0, gamma=0.9)
    first = eng.train_step(batch)
    assert first.value_mean == 0.0  # the head starts at V = 0
    assert first.value_loss > 0 and first.tokens == 4 * 5
    for _ in range(30):
        last = eng.train_step(batch)
    assert last.value_loss < first.value_loss / 4, (first.value_loss, last.value_loss)
    assert last.value_mean != 0.0
    # The head has its own parameters and optimizer, apart from the policy's.
    assert eng.value_optimizer is not eng.optimizer
    head = {id(p) for p in eng.value_head.parameters()}
    assert head.isdisjoint(id(p) for p in eng.model.parameters())


def _learner_argv(model_dir: object, ckpt: Path, algorithm: str) -> list[str]:
    # A closed port: a resumed learner never asks the proxy anything before train().
    return ["--proxy-url", "http://127.0.0.1:9", "--control-token", "t", "--model-dir", str(model_dir),
            "--algorithm", algorithm, "--lr", "1e-3", "--value-lr", "5e-2", "--gamma", "0.9", "--lam", "0.8",
            "--micro-batch-tokens", "64", "--checkpoint-dir", str(ckpt), "--metrics-file",
            str(ckpt / "m.jsonl"),
            "--no-progress", "--num-threads", "1"]


def _save_like_the_daemon(eng: TorchEngine, ckpt: Path, updates: int) -> dict:
    state = {"engine": eng.state_dict(), "cursor": None, "consumed_after_cursor": [], "sources": {},
             "version": updates, "updates": updates, "config": eng.cfg.as_dict()}
    checkpoint.save(str(ckpt), state)
    return state


def test_a_resumed_gae_run_has_the_saved_value_head_and_optimizer(tiny_model_dir, tmp_path: Path) -> None:
    """The value head and its AdamW state are in the checkpoint (safetensors + JSON) and ``--resume`` puts
    them back: the resumed head equals the saved one, and its next update equals the uninterrupted run's (it
    would not if the optimizer's moments had been lost)."""
    ckpt = tmp_path / "ckpt"
    cfg = config_from_argv(_learner_argv(tiny_model_dir, ckpt, "gae"))
    eng = TorchEngine(cfg)
    batch = build_batch([_two_step(f"t{i}", "g", first_token=1 + 20 * i) for i in range(2)], version=0,
                        gamma=0.9)
    for _ in range(2):
        eng.train_step(batch)
    saved = _save_like_the_daemon(eng, ckpt, updates=2)["engine"]
    assert any(float(v.abs().sum()) > 0 for v in saved["value_head"].values())  # trained away from V = 0
    on_disk = checkpoint.load_latest(str(ckpt))["engine"]
    assert set(on_disk["value_head"]) == {"weight", "bias"} and on_disk["value_optimizer"]["state"]

    learner = daemon.Learner(config_from_argv([*_learner_argv(tiny_model_dir, ckpt, "gae"), "--resume"]))
    resumed = learner.engine
    assert resumed.value_head_restored and (learner.updates, learner.version) == (2, 2)
    for k, v in eng.value_head.state_dict().items():
        assert torch.equal(resumed.value_head.state_dict()[k], v), k
    mine, theirs = eng.value_optimizer.state_dict()["state"], resumed.value_optimizer.state_dict()["state"]
    assert set(mine) == set(theirs)
    for i in mine:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(torch.as_tensor(mine[i][k]), torch.as_tensor(theirs[i][k])), (i, k)
    a, b = eng.train_step(batch), resumed.train_step(batch)
    assert (a.value_mean, a.value_loss) == (b.value_mean, b.value_loss)
    for k, v in eng.value_head.state_dict().items():
        assert torch.equal(resumed.value_head.state_dict()[k], v), k
    asyncio.run(learner.close())


def test_a_checkpoint_without_a_value_head_still_loads(tiny_model_dir, tmp_path: Path, capsys) -> None:
    """A GRPO checkpoint (as every checkpoint before value heads were saved) resumes a gae run with a fresh
    head (V = 0, said in the log); a gae checkpoint resumes a GRPO run, its head ignored."""
    grpo_ckpt, gae_ckpt = tmp_path / "grpo", tmp_path / "gae"
    grpo = TorchEngine(config_from_argv(_learner_argv(tiny_model_dir, grpo_ckpt, "grpo")))
    assert "value_head" not in _save_like_the_daemon(grpo, grpo_ckpt, updates=1)["engine"]
    learner = daemon.Learner(config_from_argv([*_learner_argv(tiny_model_dir, grpo_ckpt, "gae"), "--resume"]))
    assert learner.updates == 1 and not learner.engine.value_head_restored
    assert all(float(v.abs().sum()) == 0 for v in learner.engine.value_head.state_dict().values())
    assert "no value head" in capsys.readouterr().err
    asyncio.run(learner.close())

    gae = TorchEngine(config_from_argv(_learner_argv(tiny_model_dir, gae_ckpt, "gae")))
    _save_like_the_daemon(gae, gae_ckpt, updates=1)
    learner = daemon.Learner(config_from_argv([*_learner_argv(tiny_model_dir, gae_ckpt, "grpo"), "--resume"]))
    assert learner.updates == 1 and learner.engine.value_head is None
    asyncio.run(learner.close())
