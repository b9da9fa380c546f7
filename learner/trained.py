"""``steptap trained-model CHECKPOINT DIR``: a learner checkpoint's policy as a model directory vLLM serves.

    steptap trained-model runs/x/checkpoints ./trained            # the newest checkpoint, LoRA merged in
    steptap trained-model runs/x/checkpoints/ckpt-00000010 ./adapter --adapter --model-dir ./smollm2

A checkpoint (learner/checkpoint.py) holds only what training changed (the LoRA adapter, or every weight
of a full fine-tune) and the run's config. This builds the policy as the learner built it (the config's
``model_dir`` and LoRA settings), loads the checkpoint into it and writes a Hugging Face directory: by default
the base model with the adapter merged in, which ``steptap vllm``, ``steptap up --no-learner`` or any
transformers code loads as is; with ``--adapter`` the peft adapter alone (vLLM's ``--lora-modules``).
``--model-dir`` names the base model when the config's path is relative to another folder (``steptap up``
writes the one it was given). The directory is written beside ``DIR`` and moved into place when complete, with
``steptap-trained.json`` saying which checkpoint, version and base it came from.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import msgspec

from steptap.learner import checkpoint
from steptap.learner.config import LearnerConfig
from steptap.middleware import files

SOURCE_FILE = "steptap-trained.json"
# never copied from the base: its weights and config (save_pretrained writes them anew), its provenance
WEIGHTS = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json", ".pt", ".pth", ".gguf")
BASE_OWN = {"config.json", "steptap-source.json"}


class TrainedModelError(ValueError):
    """A checkpoint or base model this command cannot use: said in one line, not a traceback."""


def _load(url: str) -> dict[str, Any]:
    """The checkpoint at ``url``: a ``ckpt-N`` directory, or the folder whose ``latest.json`` names one."""
    try:
        state = checkpoint.load_latest(url)
        return state if state is not None else checkpoint.load(url)
    except checkpoint.CheckpointError as exc:
        raise TrainedModelError(str(exc)) from None


def learner_config(state: dict[str, Any], model_dir: str | None) -> LearnerConfig:
    """The run's config from the checkpoint (fields this steptap no longer has are dropped), its base model
    ``model_dir`` when given."""
    saved = state.get("config")
    if not isinstance(saved, dict):
        raise TrainedModelError("the checkpoint has no learner config")
    fields = set(LearnerConfig.__struct_fields__)
    data = {k: v for k, v in saved.items() if k in fields}
    if model_dir:
        data["model_dir"] = model_dir
    try:
        cfg = msgspec.convert(data, LearnerConfig)
    except msgspec.ValidationError as exc:
        raise TrainedModelError(f"the checkpoint's learner config: {exc}") from None
    if not (Path(cfg.model_dir) / "config.json").is_file():
        raise TrainedModelError(f"the base model {cfg.model_dir!r} (the run's model_dir) is not a model "
                                "directory here: pass --model-dir")
    return cfg


def write(url: str, out_dir: str | Path, *, model_dir: str | None = None, adapter: bool = False,
          force: bool = False) -> Path:
    """Write the policy of checkpoint ``url`` into ``out_dir``; returns it."""
    import torch

    from steptap.learner.policy import policy_model

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise TrainedModelError(f"{out} is a file, not a directory")
    if out.exists() and any(out.iterdir()) and not force:
        raise TrainedModelError(f"{out} is not empty: pass --force to replace it")
    state = _load(url)
    cfg = learner_config(state, model_dir)
    if adapter and cfg.lora_rank == 0:
        raise TrainedModelError("--adapter: the run fine-tuned every weight (lora_rank 0), it has no adapter")
    engine_state = state.get("engine")
    if not isinstance(engine_state, dict) or "model" not in engine_state:
        raise TrainedModelError("the checkpoint holds no engine weights")
    model = policy_model(cfg, torch.float32, torch.device("cpu"))
    try:
        checkpoint.restore_model(model, engine_state)
    except ValueError as exc:
        raise TrainedModelError(str(exc)) from None
    if cfg.lora_rank > 0 and not adapter:
        model = model.merge_and_unload()
    base = Path(cfg.model_dir)
    source = {"checkpoint": url, "version": state.get("version"), "updates": state.get("updates"),
              "base": str(base.resolve()), "adapter": adapter, "lora_rank": cfg.lora_rank}

    def fill(tmp: Path) -> None:
        if not adapter:  # the base's tokenizer, chat template, processor: everything but weights and config
            for f in base.iterdir():
                if f.is_file() and f.name not in BASE_OWN and not f.name.endswith(WEIGHTS):
                    shutil.copy2(f, tmp / f.name)
        model.save_pretrained(str(tmp))  # an adapter: adapter_config.json + adapter_model.safetensors
        (tmp / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")

    files.replace_dir(out, fill)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="steptap trained-model",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint directory (ckpt-N) or the run's checkpoint folder "
                        "(its newest)")
    parser.add_argument("dir", help="the model directory to write")
    parser.add_argument("--model-dir", help="the base model (default: the run's model_dir)")
    parser.add_argument("--adapter", action="store_true", help="write the LoRA adapter alone, not merged")
    parser.add_argument("--force", action="store_true", help="replace DIR when it is not empty")
    args = parser.parse_args(argv)
    try:
        out = write(args.checkpoint, args.dir, model_dir=args.model_dir, adapter=args.adapter,
                    force=args.force)
    except TrainedModelError as exc:
        print(f"steptap trained-model: {exc}", file=sys.stderr)
        return 1
    source = json.loads((out / SOURCE_FILE).read_text())
    print(f"version {source['version']} ({'adapter' if args.adapter else 'merged'}) written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
