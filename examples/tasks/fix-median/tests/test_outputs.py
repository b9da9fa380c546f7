"""The functions of /app/stats.py, called in a separate python3 (what the module does cannot touch this
process or the reward) on fixed cases and on fresh random lists, against the reference below."""

import json
import random
import subprocess
import sys

DRIVER = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("stats", "/app/stats.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
results = []
for name, values in json.load(sys.stdin):
    before = list(values)
    try:
        results.append(["ok", getattr(module, name)(values), values == before])
    except Exception as exc:
        results.append(["raised", type(exc).__name__, values == before])
print(json.dumps(results))
"""


def _reference(name: str, values: list[int]) -> list[object]:
    if not values:
        return ["raised", "ValueError", True]
    ordered = sorted(values)
    mid = len(ordered) // 2
    answer = {
        "mean": sum(values) / len(values),
        "median": ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2,
        "value_range": max(values) - min(values),
    }[name]
    return ["ok", answer, True]


def _cases() -> list[tuple[str, list[int]]]:
    rng = random.Random()  # fresh inputs every run
    lists = [[1, 2], [4, 1, 3, 2], [7], [5, 1, 3], [], [2, 2, 2, 2], [-3, 10, 0, 4, 9, 1]]
    lists += [[rng.randint(-1000, 1000) for _ in range(rng.randint(1, 12))] for _ in range(40)]
    return [(name, values) for values in lists for name in ("mean", "median", "value_range")]


def test_every_function_matches_the_reference() -> None:
    cases = _cases()
    run = subprocess.run([sys.executable, "-I", "-c", DRIVER], input=json.dumps(cases), capture_output=True,
                         text=True, timeout=20, cwd="/tmp")
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(got) == len(cases)
    for (name, values), answer in zip(cases, got, strict=True):
        assert answer == _reference(name, values), (name, values, answer)


def _main() -> int:
    """Runs the test_ functions in order, stopping at the first failure (the file also runs under pytest,
    where there is one)."""
    for name, test in list(globals().items()):
        if name.startswith("test_") and callable(test):
            try:
                test()
            except Exception as exc:  # a failed assertion, an output that cannot be read, a timeout
                print(f"FAILED {name}: {exc!r}")
                return 1
            print(f"passed {name}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
