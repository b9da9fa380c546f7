"""Engine selection: ``--engine verl`` and its cluster flags parse into the config, and what the verl engine
does not do is refused at start with a message naming the alternative (never silently trained otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest

from steptap.learner.config import config_from_argv


def test_verl_flags_parse() -> None:
    cfg = config_from_argv(["--model-dir", "m", "--engine", "verl", "--ray-address", "auto", "--workers", "4",
                            "--nodes", "2", "--truncation-mode", "drop", "--trackers", "console",
                            "tensorboard",
                            "--no-dynamic-bsz", "--param-offload"])
    assert (cfg.engine, cfg.ray_address, cfg.workers, cfg.nodes) == ("verl", "auto", 4, 2)
    assert cfg.trackers == ("console", "tensorboard") and not cfg.dynamic_bsz and cfg.param_offload


@pytest.mark.parametrize(("flags", "message"), [
    (["--algorithm", "gae"], "value model .* torch engine only"),
    (["--truncation-mode", "correct"], "truncation-mode drop"),
    (["--kl-coef", "0.1"], "needs lora_rank > 0"),
    (["--workers", "3", "--nodes", "2"], "multiple of nodes"),
])
def test_verl_engine_refuses_what_it_cannot_do(flags: list[str], message: str) -> None:
    base = ["--model-dir", "m", "--engine", "verl", "--truncation-mode", "drop"]
    with pytest.raises(ValueError, match=message):
        config_from_argv([*base, *flags])


@pytest.mark.parametrize("flags", [["--truncation-mode", "correct"], ["--lora-rank", "8"],
                                   ["--kl-coef", "0.1"]])
def test_the_torch_engine_still_does_them(flags: list[str]) -> None:
    assert config_from_argv(["--model-dir", "m", *flags]).engine == "torch"


def test_a_missing_model_directory_is_named_and_learn_says_each_problem_in_a_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="model_dir '/nonexistent-steptap': no such directory"):
        config_from_argv(["--model-dir", "/nonexistent-steptap"])
    assert config_from_argv(["--model-dir", "Qwen/Qwen3-0.6B"]).model_dir == "Qwen/Qwen3-0.6B"  # a hub name
    assert config_from_argv(["--model-dir", str(tmp_path)]).model_dir == str(tmp_path)
    from steptap.learner import daemon

    assert daemon.main(["--model-dir", str(tmp_path), "--lr", "-1", "--reference-dir", "./nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("steptap learn: invalid learner config:\n") and "Traceback" not in err
    assert "  lr must be > 0\n" in err and "  reference_dir './nope': no such directory" in err
