"""examples/gpu_scale without a GPU: its learner config validates as the verl engine takes it; the
`steptap up` command launch.py builds parses with up's own parser, the learner flags with the learner's, and
the agents' driver is one `steptap tasks run` per CLI that the runner's own parser takes, in Harbor's docker
environment behind a proxy bound where the containers reach it; bad placements and agents are refused."""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from steptap.adapters.tasks.cli import _parser_run
from steptap.learner.config import config_from_argv, load_config
from steptap.middleware.launch import gpu_recipe
from steptap.middleware.launch.up_parser import STEPTAP, build_parser

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_scale_launch", ROOT / "examples/gpu_scale/launch.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


launch = _load()


def _up(argv: list[str]) -> tuple[object, dict[str, str]]:
    args = launch.build_parser().parse_args(argv)
    cmd, env = launch.up_command(args, ["--workdir", "w"])
    assert cmd[: len(STEPTAP) + 1] == [*STEPTAP, "up"]
    return build_parser().parse_args(cmd[len(STEPTAP) + 1:]), env


def _runs(driver: str) -> list[list[str]]:
    """Each `steptap tasks run` the driver starts, as argv after `steptap tasks run`."""
    return [shlex.split(part.split(";")[-1])[len(STEPTAP) + 2:] for part in driver.split(" & ")[:-1]]


def _tasks_args(argv: list[str]) -> object:
    cut = argv.index("--") if "--" in argv else len(argv)
    return _parser_run().parse_args(argv[:cut])


def test_the_learner_config_is_the_verl_engine_with_lora_and_kl_and_validates() -> None:
    cfg = load_config(launch.CONFIG, {"model_dir": launch.DEFAULT_MODEL}).validate()
    assert cfg.engine == "verl" and cfg.algorithm == "grpo" and cfg.truncation_mode == "drop"
    assert cfg.lora_rank > 0 and cfg.kl_coef > 0  # the verl engine's KL needs LoRA (verl_engine_problems)
    assert cfg.micro_batch_tokens >= 65536  # one packed Claude Code episode is one sequence
    assert cfg.group_timeout_s >= 1800 and cfg.min_group_members < cfg.group_size


def test_launch_builds_one_tasks_run_per_cli_in_docker_behind_a_bridge_bound_proxy(tmp_path: Path) -> None:
    cfg = gpu_recipe.learner_settings(launch.CONFIG)
    up, env = _up(["--dataset", str(tmp_path), "--replicas", "3", "--learner-gpus", "3,4", "--updates", "5"])
    assert up.replicas == 3 and up.max_updates == 5 and up.backend is None and up.task == "gpu_scale"
    assert env == {"CUDA_VISIBLE_DEVICES": "3,4"}
    assert (up.host, up.port) == ("172.17.0.1", 8400)  # the docker bridge: containers reach it, no one else
    assert "--force-sampling temperature=1.0,top_p=1.0" in up.serve_args
    vllm = shlex.split(up.vllm_args)
    assert vllm[vllm.index("--max-lora-rank") + 1] == str(cfg["lora_rank"])
    assert vllm[vllm.index("--max-model-len") + 1] == "65536"
    learn = config_from_argv(["--config", up.config, "--model-dir", launch.DEFAULT_MODEL,
                              *shlex.split(up.learn_args)])
    assert learn.engine == "verl" and learn.workers == 2  # one worker per learner GPU
    runs = _runs(up.agents)
    assert [r[r.index("--agent") + 1] for r in runs] == ["codex", "claude-code", "pi"]
    for argv in runs:
        args = _tasks_args(argv)
        assert args.sandbox == "harbor" and args.harbor_env == "docker"
        assert args.container_proxy == "http://172.17.0.1:8400" and args.n == cfg["group_size"]
        assert args.concurrency * len(runs) >= cfg["batch_groups"] * cfg["group_size"] - cfg["group_size"]
    assert up.agents.endswith('wait "$p0" || rc=1; wait "$p1" || rc=1; wait "$p2" || rc=1; exit $rc')


@pytest.mark.parametrize(("first", "second", "rc"), [("true", "true", 0), ("true", "false", 1),
                                                     ("false", "true", 1), ("sleep 0.2; false", "true", 1)])
def test_side_by_side_waits_for_every_run_and_fails_if_one_failed(first: str, second: str, rc: int) -> None:
    script = launch.side_by_side([f"sh -c '{first}'", f"sh -c '{second}'"])
    assert subprocess.run(["/bin/sh", "-c", script], timeout=60).returncode == rc


def test_a_plain_command_local_sandbox_and_a_running_backend(tmp_path: Path) -> None:
    up, env = _up(["--dataset", str(tmp_path), "--command", "python3 agent.py", "--sandbox", "local",
                   "--backend", "http://127.0.0.1:9", "-n", "2", "--rounds", "1", "--limit", "1",
                   "--run-dirs", str(tmp_path / "runs")])
    assert up.backend == ["http://127.0.0.1:9"] and env == {} and up.host == "127.0.0.1"
    (argv,) = _runs(up.agents)
    args = _tasks_args(argv)
    assert args.sandbox == "local" and args.agent is None and args.n == 2 and args.limit == 1
    assert argv[argv.index("--") + 1:] == ["python3", "agent.py"]
    assert Path(args.run_dir) == tmp_path / "runs" / "tasks-command"
    learn = config_from_argv(["--config", up.config, "--model-dir", "m", *shlex.split(up.learn_args)])
    assert learn.group_size == 2


@pytest.mark.parametrize(("argv", "error"), [
    (["--replicas", "1", "--learner-gpus", "1"], "needs --replicas 2"),
    (["--replicas", "2", "--learner-gpus", "1"], "serve replicas"),
    (["--backend", "http://h:1", "--replicas", "2"], "give one of the two"),
    (["--agents", "pi,aider"], "comma-separated list"),
    (["--container-proxy", "https://172.17.0.1"], "http://ADDRESS:PORT"),
    (["--command", "./agent.sh"], "runs in --sandbox local"),
])
def test_launch_refuses_what_cannot_run(tmp_path: Path, argv: list[str], error: str) -> None:
    args = launch.build_parser().parse_args(["--dataset", str(tmp_path), *argv])
    with pytest.raises(ValueError, match=error):
        launch.up_command(args, [])
