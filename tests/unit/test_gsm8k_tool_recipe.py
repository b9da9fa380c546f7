"""examples/gsm8k_tool without a GPU: its learner config validates as the verl engine would take it, the
`steptap up` command launch.py builds parses with up's own parser (and the learner flags with the learner's),
both drawn from one learner.toml; the data builder converts GSM8K-shaped rows (written here, never downloaded)
into rows `steptap env run` reads, and names a bad row."""

from __future__ import annotations

import importlib.util
import json
import shlex
from pathlib import Path
from types import ModuleType

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from steptap.adapters.env import read_rows
from steptap.learner.config import config_from_argv, load_config
from steptap.middleware.launch import gpu_recipe
from steptap.middleware.launch.up_parser import STEPTAP, build_parser

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples/gsm8k_tool"


def _load(name: str) -> ModuleType:
    """The recipe's module by path, under its own name (examples/calculator_env has a make_data too)."""
    spec = importlib.util.spec_from_file_location(f"gsm8k_tool_{name}", RECIPE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


launch, make_data = _load("launch"), _load("make_data")

GSM8K = [  # the hub's columns and answer form (openai/gsm8k, main), thousands separator included
    {"question": "Ann has 3 boxes of 12 eggs. How many eggs?", "answer": "3*12=<<3*12=36>>36\n#### 36"},
    {"question": "A car costs $1,200 and a bike $80. Total?", "answer": "<<1200+80=1280>>1280\n#### 1,280"},
]


def test_the_learner_config_is_the_verl_engine_with_lora_and_kl_and_validates() -> None:
    cfg = load_config(launch.CONFIG, {"model_dir": "Qwen/Qwen3-4B-Instruct-2507"}).validate()
    assert cfg.engine == "verl" and cfg.algorithm == "grpo"
    assert cfg.lora_rank > 0 and cfg.kl_coef > 0  # the verl engine's KL needs LoRA (verl_engine_problems)
    assert (cfg.batch_groups, cfg.group_size) == (32, 5)


def _up(argv: list[str]) -> tuple[object, dict[str, str]]:
    args = launch.build_parser().parse_args(argv)
    cmd, env = launch.up_command(args, ["--workdir", "w"])
    assert cmd[: len(STEPTAP) + 1] == [*STEPTAP, "up"]
    return build_parser().parse_args(cmd[len(STEPTAP) + 1:]), env


def test_launch_builds_an_up_command_up_parses_from_the_one_learner_toml(tmp_path: Path) -> None:
    cfg = gpu_recipe.learner_settings(launch.CONFIG)
    up, env = _up(["--data", str(tmp_path), "--replicas", "3", "--learner-gpus", "3", "--updates", "20"])
    assert up.replicas == 3 and up.max_updates == 20 and up.workdir == "w" and up.backend is None
    assert env == {"CUDA_VISIBLE_DEVICES": "3"}
    agents = shlex.split(up.agents)
    assert agents[: len(STEPTAP) + 2] == [*STEPTAP, "env", "run"]
    assert agents[agents.index("--n") + 1] == str(cfg["group_size"])
    assert agents[agents.index("--concurrency") + 1] == str(cfg["group_size"] * cfg["batch_groups"])
    vllm = shlex.split(up.vllm_args)
    assert vllm[vllm.index("--max-lora-rank") + 1] == str(cfg["lora_rank"])  # vLLM takes the adapter
    assert vllm[vllm.index("--gpu-memory-utilization") + 1] == "0.85"  # the learner has its own GPU
    assert up.eval == str(tmp_path / "test.parquet") and "--temperature 0" in up.eval_args  # greedy
    learn = config_from_argv(["--config", up.config, "--model-dir", "m", *shlex.split(up.learn_args)])
    assert learn.engine == "verl" and learn.workers == 1


def test_launch_model_from_the_environment_backends_and_refusals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(launch.MODEL_ENV, "/models/tiny")
    up, env = _up(["--data", str(tmp_path), "--backend", "unix:/s/v.sock", "--batch-groups", "2"])
    assert up.model == "/models/tiny" and up.backend == ["unix:/s/v.sock"] and env == {}
    assert "--batch-groups 2" in up.learn_args and "--concurrency 10" in up.agents
    assert gpu_recipe.model_dir(str(tmp_path)) == str(tmp_path)  # a directory as it is, nothing fetched
    shared, _ = _up(["--data", str(tmp_path)])  # one replica sharing the GPU with the learner
    assert "--gpu-memory-utilization 0.45" in shared.vllm_args
    with pytest.raises(ValueError, match="needs --replicas 2 or more"):
        launch.up_command(launch.build_parser().parse_args(["--data", "d", "--learner-gpus", "1"]), [])
    with pytest.raises(ValueError, match="serve replicas"):
        launch.up_command(launch.build_parser().parse_args(
            ["--data", "d", "--replicas", "2", "--learner-gpus", "1"]), [])


def test_the_builder_converts_gsm8k_rows_into_calculator_rows(tmp_path: Path) -> None:
    src = tmp_path / "gsm8k-test.parquet"
    pq.write_table(pa.Table.from_pylist(GSM8K), src)
    jsonl = tmp_path / "gsm8k-train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    for path, split in ((src, "test"), (jsonl, "train")):
        assert make_data.main(["--input", str(path), "--split", split, "--out", str(tmp_path / "d")]) == 0
        rows = read_rows(tmp_path / "d" / f"{split}.parquet")
        assert [r.reward_model["ground_truth"] for r in rows] == ["36", "1280"]
        assert all(r.agent_name == "calculator" and r.env_kwargs == {} for r in rows)
        assert rows[1].prompt[0]["role"] == "user" and "$1,200" in rows[1].prompt[0]["content"]
        assert json.loads(rows[0].extra["extra_info"])["answer"].endswith("#### 36")


def test_the_builder_names_a_row_without_a_final_answer(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GSM8K[0]) + "\n" + json.dumps({"question": "q?", "answer": "no marker"}) + "\n")
    assert make_data.main(["--input", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert not (tmp_path / "o" / "train.parquet").exists()
    with pytest.raises(make_data.DataError, match="train row 1: no '#### N'"):
        make_data.convert(make_data.read_local(bad), "train")


def test_curve_reports_training_reward_by_sampling_version_and_accuracy_by_evaluated_version(
    tmp_path: Path,
) -> None:
    curve = _load("curve")
    metrics = tmp_path / "metrics.jsonl"
    rows = [
        {"update": 1, "reward_mean": 0.5, "behaviour_version": 0, "policy_version": 1},
        {"eval_version": 0, "eval_accuracy": 0.55},
        {"update": 2, "reward_mean": 0.7, "behaviour_version": 0, "policy_version": 2},
        {"update": 3, "reward_mean": 0.8, "behaviour_version": 2, "policy_version": 3},
        {"eval_version": 3, "eval_accuracy": 0.61},
    ]
    partial = '{"update": 4, "rew'  # a line being written
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows) + partial)
    got = curve.by_version(curve.read_rows(metrics))
    assert got == {0: {"accuracy": 0.55, "reward": 0.6, "batches": 2}, 2: {"reward": 0.8, "batches": 1},
                   3: {"accuracy": 0.61}}
    assert curve.main([str(metrics)]) == 0
    (tmp_path / "evals.jsonl").write_text(json.dumps(rows[1]) + "\n")
    assert curve.main([str(tmp_path / "evals.jsonl")]) == 1  # nothing learned from: a failure to see
