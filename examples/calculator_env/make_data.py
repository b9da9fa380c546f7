"""Generate arithmetic word problems as a parquet dataset for the ``calculator`` environment (no download).

    python examples/calculator_env/make_data.py --rows 256 --out data/calc-train.parquet --seed 0
    python examples/calculator_env/make_data.py --rows 64 --out data/calc-test.parquet --seed 1

Each row has Agent-R1's columns: ``prompt`` (the question as a user message), ``reward_model``
(``{"style": "rule", "ground_truth": "N"}``), ``agent_name`` (``calculator``) and ``env_kwargs`` (the
expression and answer, which ``scripted.py`` uses to force a correct run on a random model), plus
``data_source`` and a GSM8K-style ``solution`` (``... #### N``).
"""

from __future__ import annotations

import argparse
import random
import sys
from typing import Any

# (template, operator): two numbers a, b from the rng; the answer is ``a OP b``.
TEMPLATES = [
    ("{name} has {a} apples and buys {b} more. How many apples does {name} have now?", "+"),
    ("A shelf holds {a} books. {name} takes {b} of them away. How many books are left on the shelf?", "-"),
    ("{name} packs {a} boxes with {b} pencils in each box. How many pencils does {name} pack?", "*"),
    (
        "A train carries {a} passengers and {b} more get on at the next stop. How many passengers are on it?",
        "+",
    ),
    ("{name} saved {a} dollars and spent {b} dollars on a gift. How many dollars are left?", "-"),
    ("There are {a} rows of chairs with {b} chairs in each row. How many chairs are there?", "*"),
]
NAMES = ["Ava", "Ben", "Chen", "Dana", "Eli", "Fatima", "Gus", "Hana"]


def make_row(rng: random.Random, index: int) -> dict[str, Any]:
    template, op = rng.choice(TEMPLATES)
    a, b = rng.randint(10, 99), rng.randint(2, 99)
    if op == "-" and b > a:
        a, b = b, a
    if op == "*":
        b = rng.randint(2, 19)
    expression = f"{a} {op} {b}"
    answer = a + b if op == "+" else a - b if op == "-" else a * b
    question = template.format(name=rng.choice(NAMES), a=a, b=b)
    return {
        "data_source": "steptap/arithmetic_word_problems",
        "prompt": [{"role": "user", "content": question}],
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "agent_name": "calculator",
        "env_kwargs": {"expression": expression, "answer": answer},
        "solution": f"{expression} = {answer} #### {answer}",
        "index": index,
    }


def make_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [make_row(rng, i) for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="parquet file to write")
    args = p.parse_args(argv)
    from steptap.adapters.env import write_rows

    path = write_rows(make_rows(args.rows, args.seed), args.out)
    print(f"wrote {args.rows} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
