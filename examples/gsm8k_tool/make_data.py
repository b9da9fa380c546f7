"""Convert GSM8K into Agent-R1's row format for the ``calculator`` environment.

    python examples/gsm8k_tool/make_data.py --hub --out data/gsm8k-tool      # openai/gsm8k (downloads)
    python examples/gsm8k_tool/make_data.py --input train.parquet --split train --out data/gsm8k-tool

The input is GSM8K as the hub publishes it (``openai/gsm8k``, config ``main``): one problem per row with
``question`` and ``answer`` columns, the answer a worked solution ending in ``#### N``. ``--input`` reads a
local parquet or JSON-lines file of those columns (nothing is downloaded); ``--hub`` loads both splits with
``datasets`` (a download on first use, then the Hugging Face cache).

Each output row has the columns ``steptap env run`` and ``steptap eval`` read (``docs/envs.md``): ``prompt``
(the question as one user message; the environment adds its system prompt and the tool), ``reward_model``
(``{"style": "rule", "ground_truth": "N"}``, N the number after ``####`` without thousands separators),
``agent_name`` (``calculator``), ``env_kwargs`` (empty: the environment needs nothing per row), plus
``data_source``, ``extra_info`` (split, index, the question and the worked solution) and ``index``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

HUB_NAME, HUB_CONFIG = "openai/gsm8k", "main"
ENV = "calculator"  # the registered environment (steptap.adapters.env.calculator); one definition of the task
_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")


class DataError(ValueError):
    """Input that is not GSM8K-shaped: the row is named."""


def final_answer(solution: str) -> str:
    """The number after GSM8K's ``####`` (``1,080`` -> ``1080``); ``DataError`` when there is none."""
    m = _FINAL.search(solution.strip())
    if m is None:
        raise DataError(f"no '#### N' at the end of the answer: {solution[-80:]!r}")
    return m.group(1).replace(",", "")


def to_row(question: str, solution: str, split: str, index: int) -> dict[str, Any]:
    return {
        "data_source": HUB_NAME,
        "prompt": [{"role": "user", "content": question.strip()}],
        "reward_model": {"style": "rule", "ground_truth": final_answer(solution)},
        "agent_name": ENV,
        "env_kwargs": {},
        "extra_info": {"split": split, "index": index, "question": question, "answer": solution},
        "index": index,
    }


def convert(records: list[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    rows = []
    for i, rec in enumerate(records):
        q, a = rec.get("question"), rec.get("answer")
        if not isinstance(q, str) or not isinstance(a, str) or not q.strip():
            raise DataError(f"{split} row {i}: needs text 'question' and 'answer' columns (GSM8K's)")
        try:
            rows.append(to_row(q, a, split, i))
        except DataError as exc:
            raise DataError(f"{split} row {i}: {exc}") from None
    return rows


def read_local(path: str | Path) -> list[dict[str, Any]]:
    """GSM8K rows from a local ``.parquet`` or ``.jsonl`` file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"no file at {path}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(str(path), columns=["question", "answer"]).to_pylist()
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def read_hub() -> dict[str, list[dict[str, Any]]]:
    """Both splits of openai/gsm8k (``datasets`` downloads them once into its cache)."""
    import datasets

    ds = datasets.load_dataset(HUB_NAME, HUB_CONFIG)
    return {split: ds[split].to_list() for split in ("train", "test")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hub", action="store_true", help=f"load {HUB_NAME} ({HUB_CONFIG}) with datasets")
    src.add_argument("--input", help="a local GSM8K parquet or JSON-lines file (question, answer)")
    p.add_argument("--split", default="train", help="with --input: the split it is (names the output file)")
    p.add_argument("--limit", type=int, default=0, help="only the first N rows of each split (0: all)")
    p.add_argument("--out", required=True, help="output directory: SPLIT.parquet per split")
    args = p.parse_args(argv)
    from steptap.adapters.env import write_rows

    try:
        splits = read_hub() if args.hub else {args.split: read_local(args.input)}
        for split, records in splits.items():
            rows = convert(records[: args.limit or None], split)
            path = write_rows(rows, Path(args.out) / f"{split}.parquet")
            print(f"wrote {len(rows)} rows to {path}")
    except DataError as exc:
        print(f"make_data: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
