"""The learner daemon on a real proxy and stream: staleness drops are counted, checkpoints acknowledge the
stream, and ``--resume`` continues the update/version count and the cursor without re-training anything.

The trajectories are written into the proxy's log beforehand (as the proxy itself writes finished ones), with
a ``PolicyVersion`` record so the proxy restarts at version 5; the learner does not publish here
(push_every=0: the hot swap has its own tests), so no vLLM server is needed and the proxy's backend is a
closed port.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from steptap.learner import checkpoint, daemon, intake
from steptap.learner.config import config_from_argv
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.records import PolicyVersion, Sampling, Step, Trajectory

torch.set_num_threads(1)
PROXY_VERSION = 5
# The trajectories' logprobs are made up (-8.3), not the model's: the run's health check would stop each run
# at its first batch (a logprob gap, docs/health.md); here it only warns
SYNTHETIC = ("--health-check", "warn")


def _traj(group: int, member: int, versions: list[int]) -> Trajectory:
    steps = [Step(trajectory_id=f"g{group}m{member}", index=i, policy_version=v,
                  prompt_token_ids=[5, 6, 7 + i],
                  response_token_ids=[100 + member, 200 + i], response_logprobs=[-8.3, -8.3],
                  sampling=Sampling(temperature=1.0)) for i, v in enumerate(versions)]
    # Group k's rewards are k and k + 0.5: a batch's mean reward says which group was trained.
    return Trajectory(id=f"g{group}m{member}", group_id=f"g{group}", group_size=2, status="finished",
                      steps=steps, rewards={"r": group + 0.5 * member})


async def _write_log(log_dir: Path) -> None:
    log = await TrajectoryLog.open(str(log_dir))
    await log.append(PolicyVersion(version=PROXY_VERSION))
    for g in range(4):
        for m in range(2):
            # group 0 mixes fresh and stale steps: versions 5 and 1 (lag 4 > max_staleness 2), 3 (lag 2: kept)
            await log.append(_traj(g, m, [5, 1, 3] if g == 0 else [PROXY_VERSION]))
    await log.close()


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_staleness_checkpoint_ack_and_resume(make_proxy, tmp_path: Path, tiny_model_dir) -> None:
    log_dir = tmp_path / "log"
    await _write_log(log_dir)
    proxy = await make_proxy("http://127.0.0.1:9", log_dir=log_dir)
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    argv = ["--proxy-url", proxy.url, "--control-token", proxy.token, "--model-dir", str(tiny_model_dir),
            "--consumer", "learner-test", "--batch-groups", "1", "--group-size", "2", "--push-every", "0",
            "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--metrics-file", str(metrics),
            "--max-staleness", "2", "--lr", "1e-3", "--no-progress", "--num-threads", "1", *SYNTHETIC]

    # Run 1: two updates (groups 0 and 1), a checkpoint at update 2 that acknowledges them.
    await daemon._run(config_from_argv([*argv, "--max-updates", "2"]))
    rows = _rows(metrics)
    assert [r["update"] for r in rows] == [1, 2]
    assert [r["reward_mean"] for r in rows] == [0.25, 1.25]
    assert rows[0]["counts"]["dropped_stale"] == 2  # one stale step in each member of group 0, counted
    assert rows[0]["counts"]["trained_steps"] == 4
    assert rows[0]["policy_version"] == PROXY_VERSION and rows[0]["behaviour_version"] == PROXY_VERSION
    state = checkpoint.load_latest(str(ckpt))
    assert state["updates"] == 2 and state["version"] == PROXY_VERSION
    assert state["config"]["max_staleness"] == 2 and state["consumed_after_cursor"] == []
    acked = json.loads((log_dir / "consumers" / "learner-test.cursor").read_text())["cursor"]
    assert acked == state["cursor"]  # acknowledged exactly what the checkpoint covers

    # Run 2, resumed: updates 3 and 4 on groups 2 and 3 only; nothing acknowledged is trained again.
    await daemon._run(config_from_argv([*argv, "--max-updates", "4", "--resume"]))
    rows = _rows(metrics)
    assert [r["update"] for r in rows] == [1, 2, 3, 4]
    assert [r["reward_mean"] for r in rows[2:]] == [2.25, 3.25]
    assert all(r["policy_version"] == PROXY_VERSION for r in rows[2:])
    resumed = checkpoint.load_latest(str(ckpt))
    assert resumed["updates"] == 4
    assert resumed["cursor"] != state["cursor"]
    acked2 = json.loads((log_dir / "consumers" / "learner-test.cursor").read_text())["cursor"]
    assert acked2 == resumed["cursor"]
    # The weights did change across the two runs (the resumed run trained from run 1's weights).
    assert any(not torch.equal(v, state["engine"]["model"][k]) for k, v in resumed["engine"]["model"].items())


@pytest.mark.parametrize("mode", ["downweight"])
async def test_stale_downweight_is_counted(make_proxy, tmp_path: Path, tiny_model_dir, mode: str) -> None:
    log_dir = tmp_path / "log"
    await _write_log(log_dir)
    proxy = await make_proxy("http://127.0.0.1:9", log_dir=log_dir)
    metrics = tmp_path / "m.jsonl"
    await daemon._run(config_from_argv([
        "--proxy-url", proxy.url, "--control-token", proxy.token, "--model-dir", str(tiny_model_dir),
        "--batch-groups", "1", "--group-size", "2", "--push-every", "0", "--max-updates", "1",
        "--checkpoint-dir", str(tmp_path / "c"), "--metrics-file", str(metrics), "--max-staleness", "2",
        "--stale-mode", mode, "--no-progress", "--tensorboard-dir", str(tmp_path / "tb"), *SYNTHETIC]))
    (row,) = _rows(metrics)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))  # TensorBoard is installed here: it logged
    assert row["counts"]["downweighted_stale"] == 2 and row["counts"].get("dropped_stale", 0) == 0
    assert row["counts"]["trained_steps"] == 6


async def test_uniform_groups_are_skipped_logged_and_counted(make_proxy, tmp_path: Path,
                                                             tiny_model_dir) -> None:
    """Dynamic sampling: group 0's members got one reward (nothing for GRPO to learn), group 1's differ. The
    one update trains group 1; group 0 is logged as it is skipped (the row a driver resamples on) and counted
    as consumed in the update's batch."""
    log_dir = tmp_path / "log"
    log = await TrajectoryLog.open(str(log_dir))
    await log.append(PolicyVersion(version=PROXY_VERSION))
    for g in range(2):
        for m in range(2):
            traj = _traj(g, m, [PROXY_VERSION])
            traj.rewards = {"r": float(m * g)}  # group 0: 0 and 0; group 1: 0 and 1
            await log.append(traj)
    await log.close()
    proxy = await make_proxy("http://127.0.0.1:9", log_dir=log_dir)
    metrics = tmp_path / "m.jsonl"
    await daemon._run(config_from_argv([
        "--proxy-url", proxy.url, "--control-token", proxy.token, "--model-dir", str(tiny_model_dir),
        "--batch-groups", "1", "--group-size", "2", "--push-every", "0", "--max-updates", "1",
        "--checkpoint-dir", str(tmp_path / "c"), "--metrics-file", str(metrics), "--skip-uniform-groups",
        "--no-progress", "--num-threads", "1", *SYNTHETIC]))
    skipped, update = _rows(metrics)
    assert skipped["skipped_group"] == "g0" and skipped["cause"] == "no_variance"
    assert skipped["group_reward"] == 0.0 and skipped["trajectories"] == 2
    assert update["update"] == 1 and update["reward_mean"] == 0.5  # group 1 only
    assert update["counts"]["dropped_no_variance"] == 2
    assert update["health"]["groups"] == 1 and update["health"]["groups_varied"] == 1


def test_config_file_flags_env_and_validation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "learner.toml"
    monkeypatch.chdir(tmp_path)  # its model_dir, ./tiny-model, must be a directory
    with pytest.raises(ValueError, match="model_dir './tiny-model': no such directory"):
        config_from_argv(["--config", str(example)])
    (tmp_path / "tiny-model").mkdir()
    cfg = config_from_argv(["--config", str(example), "--lr", "3e-4", "--lora-targets", "q_proj", "v_proj",
                            "--no-progress", "--stale-mode", "downweight"])
    assert (cfg.lr, cfg.lora_targets, cfg.progress, cfg.stale_mode) == (3e-4, ("q_proj", "v_proj"), False,
                                                                        "downweight")
    assert cfg.batch_groups == 4  # from the file
    monkeypatch.setenv("STEPTAP_CONTROL_TOKEN", "from-env")
    assert cfg.token() == "from-env"
    assert config_from_argv(["--config", str(example), "--control-token", "given"]).token() == "given"
    with pytest.raises(ValueError) as err:
        config_from_argv(["--config", str(example), "--algorithm", "nope", "--epochs", "0"])
    assert "algorithm 'nope'" in str(err.value) and "epochs must be >= 1" in str(err.value)
    bad = tmp_path / "bad.toml"
    bad.write_text('model_dir = "m"\nlearning_rate = 1\n')
    with pytest.raises(Exception, match="learning_rate"):
        config_from_argv(["--config", str(bad)])


def test_plot_writes_reward_and_loss_curves(tmp_path: Path) -> None:
    from steptap.learner import plot

    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps({"update": i, "reward_mean": i / 10, "reward_std": 0.1,
                                           "loss": 0.01 * i, "kl": 0.0}) + "\n" for i in range(1, 8))
                       + '{"update": 8, "rew')  # a line still being written is skipped
    out = tmp_path / "curves.png"
    assert plot.main([str(metrics), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_ledger_acknowledges_only_the_consumed_prefix_and_remembers_the_rest() -> None:
    from steptap.middleware.client import Delivery, delivery_key

    ledger = intake.Ledger()
    trajs = [Trajectory(id=f"t{i}", created_at=float(i)) for i in range(5)]
    trajs.append(Trajectory(id="t1", created_at=9.0))  # the id t1 used again by a later session
    for i, traj in enumerate(trajs):
        ledger.deliver(Delivery(f"0:{(i + 1) * 10}", traj))
    k = [delivery_key(t) for t in trajs]
    ledger.consume([k[1], k[3]])  # a later group finished first
    assert ledger.frontier() == (None, [k[1], k[3]])  # t0 is still waiting: nothing can be acknowledged
    ledger.consume([k[0]])
    assert ledger.frontier() == ("0:20", [k[3]])  # t0, t1 done: ack up to t1's cursor; t3 done beyond it
    ledger.consume([k[2], k[4]])
    assert ledger.frontier() == ("0:50", [])  # the second t1 is another trajectory: still pending
    ledger.consume([k[5]])
    assert ledger.frontier() == ("0:60", [])


def test_grouper_waits_for_the_group_counts_aborted_members_and_times_out() -> None:
    cfg = config_from_argv(["--model-dir", "m", "--group-size", "3", "--group-timeout-s", "0.05",
                            "--min-group-members", "2"])
    grouper = intake.Grouper(cfg)
    grouper.add(Trajectory(id="a1", group_id="a", status="finished"))
    grouper.add(Trajectory(id="a2", group_id="a", status="aborted"))
    assert grouper.take(5) == ([], [])  # 2 of 3: wait
    grouper.add(Trajectory(id="a3", group_id="a", group_size=3, status="finished"))
    (group,), small = grouper.take(5)
    # The aborted member did not discard it
    assert [t.id for t in group] == ["a1", "a2", "a3"] and small == []
    grouper.add(Trajectory(id="s", status="finished"))  # no group_id: a group of one, ready at once
    assert [[t.id for t in g] for g in grouper.take(5)[0]] == [["s"]]
    grouper.add(Trajectory(id="b1", group_id="b", status="finished"))
    grouper.add(Trajectory(id="b2", group_id="b", status="finished"))
    grouper.add(Trajectory(id="c1", group_id="c", status="finished"))
    import time as _time

    _time.sleep(0.1)
    groups, small = grouper.take(5)
    assert [[t.id for t in g] for g in groups] == [["b1", "b2"]]  # timed out with enough members: used
    assert [t.id for t in small] == ["c1"] and grouper.counts["dropped_small_group"] == 1


def test_anonymous_trajectories_are_not_trained_unless_asked() -> None:
    """Issue 25, item 7: an anonymous call is a one-step trajectory anyone who reaches the proxy can write
    (GRPO takes its raw reward, GAE whitens it in): the learner passes it through, counted, unless asked."""
    anon = Trajectory(id="anon", anonymous=True, status="finished", rewards={"r": 1.0})
    grouper = intake.Grouper(config_from_argv(["--model-dir", "m"]))
    assert grouper.add(anon) is False
    assert grouper.take(5) == ([], []) and grouper.counts["skipped_anonymous"] == 1
    assert grouper.add(Trajectory(id="named", status="finished")) is True
    grouper = intake.Grouper(config_from_argv(["--model-dir", "m", "--train-anonymous"]))
    assert grouper.add(anon) is True and [[t.id for t in g] for g in grouper.take(5)[0]] == [["anon"]]


async def test_learner_survives_a_proxy_restart(tmp_path: Path, tiny_model_dir) -> None:
    """Proxy A serves groups 0-1 and is stopped; groups 2-3 reach the log; proxy B (same port, same log)
    comes up and the same learner process, reconnected, trains them: updates 3 and 4, nothing twice."""
    import asyncio

    from aiohttp.test_utils import TestServer
    from conftest import CONTROL_TOKEN, free_port

    from steptap.middleware.app import create_app
    from steptap.middleware.config import ProxyConfig

    log_dir, port = tmp_path / "log", free_port()
    log = await TrajectoryLog.open(str(log_dir))
    for g in range(2):
        for m in range(2):
            await log.append(_traj(g, m, [0]))
    await log.close()

    async def start_proxy() -> TestServer:
        cfg = ProxyConfig(backend="http://127.0.0.1:9", log=str(log_dir), control_token=CONTROL_TOKEN,
                          port=port)
        server = TestServer(create_app(cfg), port=port)
        await server.start_server()
        return server

    proxy = await start_proxy()
    metrics = tmp_path / "m.jsonl"
    learner = asyncio.create_task(daemon._run(config_from_argv([
        "--proxy-url", f"http://127.0.0.1:{port}", "--control-token", CONTROL_TOKEN,
        "--model-dir", str(tiny_model_dir), "--batch-groups", "1", "--group-size", "2", "--push-every", "0",
        "--max-updates", "4", "--checkpoint-every", "1", "--checkpoint-dir", str(tmp_path / "c"),
        "--metrics-file", str(metrics), "--no-progress", "--num-threads", "1", *SYNTHETIC])))

    async def wait_rows(n: int) -> None:
        for _ in range(1200):
            if learner.done():
                learner.result()  # re-raise
            if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"no {n} updates in time")

    await wait_rows(2)
    await proxy.close()  # the proxy goes away under the learner's open stream
    log = await TrajectoryLog.open(str(log_dir))
    for g in range(2, 4):
        for m in range(2):
            await log.append(_traj(g, m, [0]))
    await log.close()
    await asyncio.sleep(1.0)  # the learner is reconnecting meanwhile
    proxy = await start_proxy()
    try:
        await asyncio.wait_for(learner, timeout=300)
    finally:
        await proxy.close()
    rows = _rows(metrics)
    assert [r["update"] for r in rows] == [1, 2, 3, 4]
    assert [r["reward_mean"] for r in rows] == [0.25, 1.25, 2.25, 3.25]
    final = checkpoint.load_latest(str(tmp_path / "c"))
    acked = json.loads((log_dir / "consumers" / "learner.cursor").read_text())["cursor"]
    assert final["updates"] == 4 and acked == final["cursor"]


async def test_a_wrong_control_token_stops_the_learner_with_the_proxys_error(make_proxy, tmp_path: Path,
                                                                            tiny_model_dir) -> None:
    from steptap.middleware.client import SteptapError

    proxy = await make_proxy("http://127.0.0.1:9", log_dir=tmp_path / "log")
    with pytest.raises(SteptapError) as err:
        await daemon._run(config_from_argv([
            "--proxy-url", proxy.url, "--control-token", "not-the-token", "--model-dir", str(tiny_model_dir),
            "--checkpoint-dir", str(tmp_path / "c"), "--metrics-file", str(tmp_path / "m.jsonl"),
            "--no-progress"]))
    assert err.value.status in (401, 403)  # no token / not the control token
