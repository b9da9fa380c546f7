"""parse_duration of /app/duration.py, called in a separate python3 (what the module does cannot touch this
process or the reward) on fixed and fresh random strings, against the reference below."""

import json
import random
import subprocess
import sys

DRIVER = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("duration", "/app/duration.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
results = []
for text in json.load(sys.stdin):
    try:
        results.append(["ok", module.parse_duration(text)])
    except Exception as exc:
        results.append(["raised", type(exc).__name__])
print(json.dumps(results))
"""
UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
INVALID = ["", "   ", "10", "h", "5x", "1h 2m", "m5", "1.5h", "-3s", "1hh"]


def _reference(text: str) -> list[object]:
    if text in INVALID:
        return ["raised", "ValueError"]
    total, number = 0, ""
    for ch in text.strip():
        if ch.isdigit():
            number += ch
        else:
            total += int(number) * UNITS[ch]
            number = ""
    return ["ok", total]


def _cases() -> list[str]:
    rng = random.Random()  # fresh inputs every run
    texts = ["1h30m", "90s", "2d4h15m30s", " 45m ", "0s", "100h", "12d", "1m1s"]
    for _ in range(40):
        units = sorted(rng.sample(list(UNITS), rng.randint(1, 4)), key=list(UNITS).index)
        texts.append("".join(f"{rng.randint(0, 999)}{u}" for u in units))
    return texts + INVALID


def test_parse_duration_matches_the_reference() -> None:
    cases = _cases()
    run = subprocess.run([sys.executable, "-I", "-c", DRIVER], input=json.dumps(cases), capture_output=True,
                         text=True, timeout=20, cwd="/tmp")
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(got) == len(cases)
    for text, answer in zip(cases, got, strict=True):
        assert answer == _reference(text), (text, answer)


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
