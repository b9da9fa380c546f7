"""The tool recipe's datasets: 3-digit x 2-digit products for the ``tool_agent`` environment (no download).

    python examples/tool_agent/make_data.py --out data/tool            # train.parquet and test.parquet

``test.parquet`` holds ``--test-rows`` held-out products (the evaluation seed); ``train.parquet`` never
contains one of them. The rows are built by ``steptap.adapters.env.tool_agent.make_rows``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for train.parquet and test.parquet")
    p.add_argument("--train-rows", type=int, default=2000)
    p.add_argument("--test-rows", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from steptap.adapters.env import write_rows
    from steptap.adapters.env.tool_agent import EVAL_SEED, make_rows

    out = Path(args.out)
    write_rows(make_rows(args.train_rows, seed=args.seed, held_out=args.test_rows), out / "train.parquet")
    write_rows(make_rows(args.test_rows, seed=EVAL_SEED), out / "test.parquet")
    print(f"wrote {args.train_rows} training and {args.test_rows} held-out rows to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
