"""slugify and title_case of /app/textutils.py, called in a separate python3 (what the module does cannot
touch this process or the reward) on fixed and fresh random strings, against the reference below."""

import json
import random
import re
import subprocess
import sys

DRIVER = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("textutils", "/app/textutils.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
results = []
for name, args in json.load(sys.stdin):
    try:
        results.append(["ok", getattr(module, name)(*args)])
    except Exception as exc:
        results.append(["raised", type(exc).__name__])
print(json.dumps(results))
"""


def _reference(name: str, args: list[object]) -> list[object]:
    if name == "title_case":
        text = str(args[0])
        return ["ok", " ".join(w[:1].upper() + w[1:].lower() for w in text.split(" "))]
    text, max_length = str(args[0]), int(args[1]) if len(args) > 1 else 50
    # only ASCII letters are lowercased and kept: "İ".lower() would give an ASCII "i"
    slug = re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()
    return ["ok", slug[:max_length].rstrip("-")]


def _cases() -> list[tuple[str, list[object]]]:
    rng = random.Random()  # fresh inputs every run
    texts = ["Hello, World!", "  Ünïcode   rocks ", "", "---", "already-a-slug", "Ω", "2024: A Year!",
             "ÀB", "İstanbul", "x" * 60, "word " * 20, "a-b" * 30]
    alphabet = "abcXYZ019 -_.,!?/éßΩ\t"
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(60)]
    cases: list[tuple[str, list[object]]] = [("slugify", [t]) for t in texts]
    cases += [("slugify", [t, rng.randint(1, 20)]) for t in texts]
    cases += [("title_case", [t]) for t in texts[:10]]
    return cases


def test_slugify_and_title_case_match_the_reference() -> None:
    cases = _cases()
    run = subprocess.run([sys.executable, "-I", "-c", DRIVER], input=json.dumps(cases), capture_output=True,
                         text=True, timeout=20, cwd="/tmp")
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(got) == len(cases)
    for (name, args), answer in zip(cases, got, strict=True):
        assert answer == _reference(name, args), (name, args, answer)


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
