"""``steptap trained-model``: a checkpoint's policy written as a model directory computes what the learner's
policy computed (merged or as an adapter), and every unusable input is one line of error, not a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from steptap.learner import checkpoint, trained
from steptap.learner.config import LearnerConfig
from steptap.learner.engines.torch_engine import TorchEngine
from steptap.learner.rows import build_batch
from steptap.middleware.records import Sampling, Step, Trajectory

torch.set_num_threads(1)
IDS = torch.tensor([[5, 17, 33, 40, 100, 200, 300, 41]])


def _batch() -> list[Trajectory]:
    trajs = []
    for m in range(2):
        step = Step(index=0, prompt_token_ids=[5, 17, 33, 40], response_token_ids=[100 + m, 200, 300],
                    response_logprobs=[-1.0, -1.0, -1.0], sampling=Sampling(temperature=1.0))
        trajs.append(Trajectory(id=f"t{m}", group_id="g", status="finished", steps=[step],
                                rewards={"r": float(m)}))
    return trajs


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


@pytest.fixture(scope="module")
def run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A LoRA run's checkpoint after two updates, laid out as the daemon writes it; its policy's logits."""
    cfg = LearnerConfig(model_dir=str(tiny_model_dir), lora_rank=4, lora_alpha=8, lr=5e-2, kl_coef=0.0,
                        lora_targets=("q_proj", "v_proj")).validate()
    eng = TorchEngine(cfg)
    for _ in range(2):
        eng.train_step(build_batch(_batch(), version=0))
    root = tmp_path_factory.mktemp("run") / "checkpoints"
    checkpoint.save(str(root), {"engine": eng.state_dict(), "cursor": "0:1", "consumed_after_cursor": [],
                                "version": 2, "updates": 2, "config": cfg.as_dict()}, keep=1)
    return {"root": root, "policy": _logits(eng.model), "base": str(tiny_model_dir)}


def test_the_merged_model_computes_the_trained_policy(run: dict, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "trained"
    assert trained.main([str(run["root"]), str(out)]) == 0
    assert "version 2 (merged)" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    got = _logits(model)
    torch.testing.assert_close(got, run["policy"], rtol=1e-4, atol=1e-4)
    base = _logits(AutoModelForCausalLM.from_pretrained(run["base"], dtype=torch.float32))
    assert (got - base).abs().max() > 1e-2  # the adapter moved it: the base alone would not pass above
    assert not any("lora" in k for k in model.state_dict())
    base = Path(run["base"])
    assert {p.name for p in base.iterdir()} <= {p.name for p in out.iterdir()}  # tokenizer, template...
    assert (out / "tokenizer_config.json").read_bytes() == (base / "tokenizer_config.json").read_bytes()
    source = json.loads((out / trained.SOURCE_FILE).read_text())
    assert source["version"] == 2 and source["adapter"] is False and source["lora_rank"] == 4


def test_the_adapter_alone_on_its_base_computes_the_trained_policy(run: dict, tmp_path: Path) -> None:
    from peft import PeftModel

    ckpt = next(p for p in run["root"].iterdir() if p.name.startswith("ckpt-"))  # one ckpt-N by name
    out = tmp_path / "adapter"
    assert trained.main([str(ckpt), str(out), "--adapter"]) == 0
    assert (out / "adapter_config.json").is_file() and not (out / "config.json").exists()
    base = AutoModelForCausalLM.from_pretrained(run["base"], dtype=torch.float32)
    torch.testing.assert_close(_logits(PeftModel.from_pretrained(base, out)), run["policy"],
                               rtol=1e-4, atol=1e-4)


def test_unusable_inputs_are_one_line_errors(run: dict, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    def error(*argv: str) -> str:
        assert trained.main(list(argv)) == 1
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]  # after transformers' loading bar, where a model was loaded
        assert last.startswith("steptap trained-model: ") and "Traceback" not in err
        return last

    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    assert "not empty: pass --force" in error(str(run["root"]), str(full))
    assert "is a file" in error(str(run["root"]), str(full / "keep.txt"), "--force")
    assert (full / "keep.txt").read_text() == "mine"  # nothing replaced without --force
    assert "not a steptap checkpoint" in error(str(tmp_path / "nothing"), str(tmp_path / "o1"))
    moved = tmp_path / "moved-base"
    assert "pass --model-dir" in error(str(run["root"]), str(tmp_path / "o2"), "--model-dir", str(moved))
    assert not (tmp_path / "o2").exists()
    # a checkpoint whose config does not fit its tensors (other targets, another rank): named, no traceback
    for field, value in (("lora_targets", ["q_proj", "k_proj", "v_proj"]), ("lora_rank", 8)):
        state = checkpoint.load_latest(str(run["root"]))
        state["config"][field] = value
        bent = tmp_path / f"bent-{field}"
        checkpoint.save(str(bent), state, keep=1)
        assert "other LoRA settings" in error(str(bent), str(tmp_path / f"o-{field}"))
    # the run's base found elsewhere: --model-dir, and --force replaces a full directory
    shutil.copytree(run["base"], moved)
    assert trained.main([str(run["root"]), str(full), "--model-dir", str(moved), "--force"]) == 0
    assert not (full / "keep.txt").exists() and (full / "config.json").is_file()


def test_a_full_fine_tune_has_no_adapter(tiny_model_dir: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    cfg = LearnerConfig(model_dir=str(tiny_model_dir), kl_coef=0.0).validate()
    eng = TorchEngine(cfg)
    checkpoint.save(str(tmp_path / "ck"), {"engine": eng.state_dict(), "version": 0, "updates": 0,
                                           "config": cfg.as_dict()}, keep=1)
    assert trained.main([str(tmp_path / "ck"), str(tmp_path / "a"), "--adapter"]) == 1
    assert "no adapter" in capsys.readouterr().err
    assert trained.main([str(tmp_path / "ck"), str(tmp_path / "m")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    torch.testing.assert_close(_logits(merged), _logits(eng.model))
