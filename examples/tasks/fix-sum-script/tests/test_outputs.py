"""/app/sum.sh run (in its own bash) on fresh random files, with and without a final newline, with blank lines
and negative numbers: it prints exactly the sum."""

import random
import subprocess
import sys
import tempfile
import time

DEADLINE = time.monotonic() + 20  # every command together, well inside the verifier's 30 s


def _left() -> float:
    return max(0.1, DEADLINE - time.monotonic())


def _files() -> list[str]:
    rng = random.Random()  # fresh inputs every run
    texts = ["1\n2\n3", "1\n2\n3\n", "42", "\n\n5\n\n-7\n", "-1\n-2\n-3"]
    for i in range(12):
        count = rng.randint(1, 20)
        lines = [str(rng.randint(-500, 500)) if rng.random() > 0.15 else "" for _ in range(count)]
        lines[-1] = lines[-1] or "9"
        texts.append("\n".join(lines) + ("\n" if i % 2 else ""))
    return texts


def test_the_sum_is_exact_for_every_file() -> None:
    for text in _files():
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, dir="/tmp") as f:
            f.write(text)
        run = subprocess.run(["/bin/bash", "/app/sum.sh", f.name], capture_output=True, text=True,
                             timeout=_left(), cwd="/tmp")
        expected = sum(int(line) for line in text.split("\n") if line)
        assert run.returncode == 0 and run.stdout == f"{expected}\n", (text, run.stdout, run.stderr)


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
