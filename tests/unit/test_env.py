"""The environment layer without a model: ToolEnv's tool-call handling and scoring, the calculator's safety,
datasets, the environment registry, the resumable runner's state, the log reader and the parquet export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from steptap.adapters.env import DatasetError, Row, RunConfig, ToolEnv, read_rows, resolve_env, write_rows
from steptap.adapters.env.base import parse_number, parse_tool_calls
from steptap.adapters.env.calculator import WELL_FORMED_REWARD, CalculatorTool, make_env, safe_eval
from steptap.adapters.env.runner import DatasetRunner
from steptap.adapters.export import export_trajectories
from steptap.middleware.log.offline import LogReader
from steptap.middleware.log.segments import frame
from steptap.middleware.log.wal import TrajectoryLog
from steptap.middleware.records import Step, Trajectory

ROOT = Path(__file__).resolve().parents[2]


def _call(name: str, args: object, cid: str = "c1") -> dict:
    return {
        "id": cid,
        "type": "function",
        "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)},
    }


async def test_tool_env_runs_calls_sums_process_rewards_and_scores_the_answer() -> None:
    env = make_env(max_steps=3)
    obs = env.reset(
        prompt=[{"role": "user", "content": "What is 6 * 7?"}], reward_model={"ground_truth": "#### 42"}
    )
    assert [m["role"] for m in obs] == ["system", "user"] and env.tools()[0]["function"][
        "name"
    ] == "calculator"

    action = {
        "content": "",
        "tool_calls": [
            _call("calculator", {"expression": "6 * 7"}, "a"),
            _call("calculator", {"expression": "6 *"}, "b"),
        ],
    }
    obs, reward, done, info = await env.step(action)
    assert not done and info["tool_calls"] == 2
    assert reward == WELL_FORMED_REWARD + 0.0  # one well-formed call, one that does not parse
    tool_msgs = obs[-2:]
    assert [m["tool_call_id"] for m in tool_msgs] == ["a", "b"]
    assert json.loads(tool_msgs[0]["content"]) == {"result": 42} and "error" in json.loads(
        tool_msgs[1]["content"]
    )
    assert obs[-3]["role"] == "assistant" and obs[-3]["tool_calls"] == action["tool_calls"]

    obs, reward, done, info = await env.step({"content": "The answer is 42."})
    assert done and reward is None and info["correct"] is True
    assert env.outcome() == 1.0


async def test_tool_env_turns_bad_calls_into_observations_and_truncates() -> None:
    class Boom(CalculatorTool):
        name = "boom"

        def execute(self, args: dict) -> tuple[str, float | None]:
            raise RuntimeError("tool broke")

    env = ToolEnv([CalculatorTool(), Boom()], max_steps=1)
    env.reset(prompt="hi", reward_model={"ground_truth": "3"})
    calls = [_call("nope", {}, "x"), _call("calculator", "{not json", "y"), _call("boom", {}, "z")]
    obs, reward, done, info = await env.step({"content": "", "tool_calls": calls})
    errors = [json.loads(m["content"])["error"] for m in obs[-3:]]
    assert (
        "unknown tool 'nope'" in errors[0] and "not a JSON object" in errors[1] and "tool broke" in errors[2]
    )
    assert reward is None  # no tool gave a process reward
    assert done and info["truncated"]  # max_steps reached on a tool turn
    assert env.outcome() == 0.0  # never answered


def test_hermes_blocks_in_text_are_tool_calls_when_the_server_has_no_parser() -> None:
    text = 'ok <tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'
    calls = parse_tool_calls({"content": text})
    assert [(c["name"], c["arguments"]) for c in calls] == [("calculator", {"expression": "1+2"})]
    assert parse_tool_calls({"content": "no calls here"}) == []


@pytest.mark.parametrize(
    ("text", "value"), [("#### 1,234", 1234.0), ("it is -7.5 or 3", 3.0), ("none", None)]
)
def test_parse_number(text: str, value: float | None) -> None:
    assert parse_number(text) == value


@pytest.mark.parametrize(
    "expr", ["__import__('os')", "2 ** 10", "9" * 13 + " * 9", "x + 1", "1 +" * 100 + "1"]
)
def test_calculator_refuses_anything_but_bounded_arithmetic(expr: str) -> None:
    text, reward = CalculatorTool().execute({"expression": expr})
    assert "error" in json.loads(text) and reward == 0.0
    assert safe_eval("(12 + 7) * 3") == 57


def test_dataset_round_trip_and_clear_errors(tmp_path: Path) -> None:
    rows = [
        {
            "prompt": [{"role": "user", "content": "q0"}],
            "reward_model": {"ground_truth": "1"},
            "agent_name": "calculator",
            "env_kwargs": {"a": 1},
            "data_source": "t",
        },
        {
            "prompt": "q1",
            "reward_model": {"ground_truth": "2"},
            "agent_name": "calculator",
            "env_kwargs": {},
            "data_source": "t",
        },
    ]
    got = read_rows(write_rows(rows, tmp_path / "d.parquet"))
    assert [(r.index, r.agent_name, r.env_kwargs, r.reward_model) for r in got] == [
        (0, "calculator", {"a": 1}, {"ground_truth": "1"}),
        (1, "calculator", {}, {"ground_truth": "2"}),
    ]
    assert got[0].extra == {"data_source": "t"}

    # Struct columns (as other tools write them) unify keys across rows: the missing ones are dropped.
    pq.write_table(
        pa.Table.from_pylist(
            [{"prompt": "a", "env_kwargs": {"x": 1}}, {"prompt": "b", "env_kwargs": {"y": 2}}]
        ),
        tmp_path / "s.parquet",
    )
    assert [r.env_kwargs for r in read_rows(tmp_path / "s.parquet")] == [{"x": 1}, {"y": 2}]

    pq.write_table(pa.Table.from_pylist([{"question": "a"}]), tmp_path / "np.parquet")
    with pytest.raises(DatasetError, match="no 'prompt' column"):
        read_rows(tmp_path / "np.parquet")
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "a", "env_kwargs": "{"}, {"prompt": "b", "env_kwargs": "[1]"}]),
        tmp_path / "bad.parquet",
    )
    with pytest.raises(DatasetError, match="row 0: env_kwargs is not a JSON object"):
        read_rows(tmp_path / "bad.parquet")
    (tmp_path / "text.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match="not a parquet file"):
        read_rows(tmp_path / "text.parquet")


def test_environments_resolve_by_entry_point_file_or_module(tmp_path: Path) -> None:
    assert resolve_env("calculator") is make_env  # registered in pyproject's steptap.envs group
    env = resolve_env(str(ROOT / "examples/calculator_env/scripted.py") + ":make_env")()
    assert isinstance(env, ToolEnv)
    assert resolve_env("steptap.adapters.env.calculator:make_env") is make_env
    with pytest.raises(KeyError, match="registered: .*calculator"):
        resolve_env("no-such-env")


def test_runner_state_skips_finished_groups_and_ignores_a_torn_line(tmp_path: Path) -> None:
    state = tmp_path / "state.jsonl"
    state.write_text('{"epoch": 0, "row": 1, "group_id": "g"}\n{"epoch": 1, "row": 0, "gro')
    rows = [Row(index=i, prompt="p") for i in range(3)]
    runner = DatasetRunner(
        rows, RunConfig(proxy_url="http://x", control_token="t", epochs=2, state_file=str(state))
    )
    assert [(e, r.index) for e, r in runner.todo()] == [(0, 0), (0, 2), (1, 0), (1, 1), (1, 2)]


def _traj(tid: str, steps: int, status: str = "finished", mode: str = "train") -> Trajectory:
    return Trajectory(
        id=tid,
        group_id="g",
        group_size=2,
        mode=mode,
        status=status,
        rewards={"reward": 1.0},
        metadata={"task": "t", "row": 3},
        steps=[
            Step(
                trajectory_id=tid,
                index=i,
                policy_version=i + 1,
                prompt_token_ids=[1, 2, 3 + i],
                response_token_ids=[7, 8 + i],
                response_logprobs=[-0.5, -0.25 * i],
                rewards={"process": 0.1 * i},
                request={"messages": [{"role": "user", "content": "q"}]},
                response={"content": f"r{i}"},
            )
            for i in range(steps)
        ],
    )


async def test_reader_yields_finished_trajectories_once_and_counts_undecodable(tmp_path: Path) -> None:
    log = await TrajectoryLog.open(str(tmp_path / "log"), segment_bytes=4096)
    await log.append(_traj("a", 2, status="running"))
    for tid in ("a", "b", "c"):
        await log.append(_traj(tid, 2, mode="eval" if tid == "c" else "train"))
    await log.append(_traj("a", 2))  # written again (a re-finalized session): yielded once
    await log.close()
    seg = max((tmp_path / "log").glob("seg-*.log"))
    with open(seg, "ab") as f:  # an intact frame this version cannot decode (a future record kind)
        f.write(frame(b"\x81\xa4type\xa6future"))
    reader = LogReader(str(tmp_path / "log"))
    assert [t.id for t in reader.trajectories()] == ["a", "b", "c"]
    assert reader.stats.undecodable == 1 and reader.stats.duplicates == 1
    assert [t.id for t in LogReader(f"file://{tmp_path / 'log'}").trajectories(mode="eval")] == ["c"]
    with pytest.raises(FileNotFoundError):
        list(LogReader(str(tmp_path / "missing")).trajectories())


def test_export_writes_one_row_per_step_with_exact_ids(tmp_path: Path) -> None:
    trajs = [_traj("a", 2), _traj("b", 3), _traj("c", 1)]
    writer = export_trajectories(trajs, tmp_path / "out", rows_per_file=4, batch_rows=2)
    assert writer.rows == 6 and [f.name for f in writer.files] == ["part-00000.parquet", "part-00001.parquet"]
    table = pq.read_table(tmp_path / "out")
    assert table.num_rows == 6
    rows = sorted(table.to_pylist(), key=lambda r: (r["trajectory_id"], r["step_index"]))
    flat = [(t, s) for t in trajs for s in t.steps]
    for row, (traj, step) in zip(rows, flat, strict=False):
        assert row["trajectory_id"] == traj.id and row["step_index"] == step.index
        assert (
            row["prompt_token_ids"] == step.prompt_token_ids
            and row["response_token_ids"] == step.response_token_ids
        )
        assert (
            row["response_logprobs"] == step.response_logprobs
            and row["policy_version"] == step.policy_version
        )
        assert json.loads(row["step_rewards"]) == step.rewards and row["trajectory_reward"] == 1.0
        assert json.loads(row["metadata"]) == traj.metadata and row["num_steps"] == len(traj.steps)
    assert not list((tmp_path / "out").glob(".*.tmp*"))  # parts are renamed into place when complete


def test_export_keeps_huge_sampling_values_and_counts_a_bad_row(tmp_path: Path) -> None:
    """Issue 25, item 11: ``top_k: 2**40`` (a value the agent sent) overflowed an int32 column and aborted the
    whole export. Such values are kept (int64); a row no column can hold is counted, the rest written."""
    huge, bad, fine = _traj("huge", 1), _traj("bad", 2), _traj("fine", 1)
    huge.steps[0].sampling.top_k = 2**40
    huge.steps[0].sampling.max_tokens = 2**40
    bad.steps[1].response_token_ids = [7, 2**70]  # no integer column holds it
    writer = export_trajectories([huge, bad, fine], tmp_path / "out", batch_rows=10)
    assert writer.rows == 3 and writer.bad_rows == 1
    rows = {(r["trajectory_id"], r["step_index"]): r for r in pq.read_table(tmp_path / "out").to_pylist()}
    assert sorted(rows) == [("bad", 0), ("fine", 0), ("huge", 0)]
    assert rows[("huge", 0)]["top_k"] == 2**40 and rows[("huge", 0)]["max_tokens"] == 2**40


def test_env_modules_use_the_client_only_never_the_proxy_server() -> None:
    code = (
        "import sys, json, importlib\n"
        "for m in ('env', 'env.base', 'env.loop', 'env.dataset', 'env.runner', 'env.cli', 'env.calculator',"
        " 'export'): importlib.import_module('steptap.adapters.' + m)\n"
        "server = ('app', 'server', 'proxy', 'sessions', 'log', 'weights', 'launch')\n"
        "heavy = ('torch', 'transformers', 'verl', 'pyarrow')\n"
        "print(json.dumps(sorted([m for m in server if 'steptap.middleware.' + m in sys.modules]"
        " + [h for h in heavy if h in sys.modules])))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_export_files_are_private_whatever_the_umask(tmp_path: Path) -> None:
    """Issue 25 (lows): exported parts hold prompts and replies; they took the umask's mode (0644)."""
    import stat

    old = os.umask(0o022)
    try:
        writer = export_trajectories([_traj("a", 2)], tmp_path / "out", rows_per_file=4, batch_rows=2)
    finally:
        os.umask(old)
    assert writer.files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in writer.files)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o700  # created here: private


def test_env_run_takes_the_control_token_from_the_file_steptap_up_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`steptap up --agents` hands its driver $STEPTAP_CONTROL_TOKEN_FILE, never the token itself."""
    from steptap.adapters.env.cli import main_env
    from steptap.middleware.client import TOKEN_ENV, TOKEN_FILE_ENV

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    token = tmp_path / "control_token"
    token.write_text("")
    monkeypatch.setenv(TOKEN_FILE_ENV, str(token))
    run = ["run", str(tmp_path / "none.parquet"), "--proxy", "http://127.0.0.1:9"]
    with pytest.raises(SystemExit):
        main_env(run)
    assert "empty token file" in capsys.readouterr().err  # a broken file is named, not "no token"
    token.write_text("t0k\n")
    with pytest.raises(SystemExit):
        main_env(run)
    err = capsys.readouterr().err
    assert "no dataset at" in err and "no control token" not in err  # past the token check, to the data
    assert TOKEN_FILE_ENV not in os.environ  # read once, kept from what the run starts
