"""pi's task family: small shell tasks in Harbor's format, generated, with a held-out split never trained on.

    python examples/pi_learns/make_tasks.py --out data/pi --train 400 --test 60

writes ``data/pi/train/<task>/`` and ``data/pi/test/<task>/``, each a Harbor task directory::

    instruction.md        the task, and ONE worked tool call (a hermes block for pi's bash tool)
    task.toml             timeouts, resources
    environment/          Dockerfile (container runs) and app/, the working folder's files (local sandbox)
    tests/test.sh         the verifier: writes /logs/verifier/reward.json
    tests/check.py        what test.sh runs; the expected result lives here, out of the agent's reach
    solution/solve.sh     the oracle

Three kinds, each exact and checkable from the files alone:

- ``product``: "Put the product of 347 and 28 into answer.txt."
- ``count``: "Count the lines of data.csv that contain 'plum' and write the number into count.txt."
- ``offbyone``: "util.py's ``total`` skips the last item: fix it so ``python3 test_util.py`` passes."

Rewards (``reward.json``, named parts that add up): ``outcome`` 1.0 for the exact result; ``file`` a small
graded part for the answer file existing with something in it (offbyone: util.py edited and still running),
what a model that ran any command writing the file gets right first, so a GRPO group has variance before the
first exact answer. The held-out split comes from its own seed and no training task shares its parameters
(kind, numbers, word, data).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

EVAL_SEED = 1234  # the held-out tasks; training tasks never share a key with them
FILE_REWARD = 0.1  # the answer file exists and is not empty: small beside the outcome's 1.0
KINDS = ("product", "count", "offbyone")
WORDS = ("plum", "fig", "kiwi", "lime", "pear", "date", "yuzu", "sloe")
FILLER = ("apple", "grape", "melon", "peach", "berry", "lemon", "mango", "olive")

# The worked call, shown in every instruction: pi's bash tool, as a hermes block (SmolLM2's chat template
# renders no tool schema, so this is where the model sees the format). It is shaped like the task but never
# its solution (other numbers, another word, another edit of util.py): the base model copies the example, so
# a generic one ("the sum of 2 and 3 into out.txt") was copied verbatim and earned nothing, while a copy of
# this one writes the task's answer file, which the graded part rewards (README, "Status": the probe's rows).
EXAMPLE = (
    "You have a bash tool. Example: {what}, call it like this:\n"
    "<tool_call>\n"
    '{{"name": "bash", "arguments": {{"command": {command}}}}}\n'
    "</tool_call>"
)


def example(what: str, command: str) -> str:
    return EXAMPLE.format(what=what, command=json.dumps(command))


DOCKERFILE = """FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends python3 && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY app/ /app/
"""

TEST_SH = """#!/bin/bash
# The verifier: runs after the agent has gone, with the system's PATH only; check.py prints the named rewards.
export PATH=/usr/bin:/bin
mkdir -p /logs/verifier
rm -f /logs/verifier/reward.txt /logs/verifier/reward.json
python3 -I /tests/check.py > /logs/verifier/reward.json.tmp || echo '{"outcome": 0.0, "file": 0.0}' \\
    > /logs/verifier/reward.json.tmp
mv /logs/verifier/reward.json.tmp /logs/verifier/reward.json
"""

# check.py: the expected values are filled in; it reads only regular files of at most 64 KiB.
CHECK_PY = '''"""This task's verifier: prints {{"outcome": 0|1, "file": 0|{file_reward}}}, named rewards."""
import json
import os
import stat
import subprocess

KIND = {kind!r}
ANSWER = {answer!r}  # the answer file, in /app
EXPECTED = {expected!r}
FILE_REWARD = {file_reward!r}
ORIGINAL = {original!r}  # offbyone: util.py as the task shipped it


def read(path):
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size > 65536:
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def main():
    text = read(os.path.join("/app", ANSWER))
    rewards = {{"outcome": 0.0, "file": FILE_REWARD if text and text.strip() else 0.0}}
    if KIND == "offbyone":
        # the fixed function, run against the held cases here (not the agent's own test file)
        src = text or ""
        code = src + "\\nimport json, sys\\nprint(json.dumps([total(c) for c in json.loads(sys.argv[1])]))\\n"
        cases = [c for c, _ in EXPECTED]
        try:
            out = subprocess.run(["python3", "-I", "-c", code, json.dumps(cases)], capture_output=True,
                                 text=True, timeout=10, cwd="/tmp")
            got = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            got = None
        # the graded part: util.py edited and still running (the untouched file runs too, and earns nothing)
        rewards["file"] = FILE_REWARD if got is not None and src != ORIGINAL else 0.0
        rewards["outcome"] = 1.0 if got == [want for _, want in EXPECTED] else 0.0
    elif text is not None and text.strip() == str(EXPECTED):
        rewards["outcome"] = 1.0
    print(json.dumps(rewards))


main()
'''

TASK_TOML = """schema_version = "1.4"

[task]
name = "steptap/pi-learns-{name}"
version = "1.0.0"
description = "{kind}: a one-command shell task for a small model driving pi"

[verifier]
timeout_sec = 30.0

[agent]
timeout_sec = 180.0

[environment]
cpus = 1
memory_mb = 512
"""

UTIL_PY = '''def total(items):
    """The sum of every number in items."""
    result = 0
    for i in range({start}, len(items) - 1):
        result += items[i]
    return result
'''

TEST_UTIL_PY = '''from util import total

assert total({case}) == {want}, total({case})
print("ok")
'''


@dataclass
class Spec:
    kind: str
    key: tuple[object, ...]  # what makes two tasks the same task (the held-out split excludes it)
    instruction: str
    answer: str  # the file the verifier reads
    expected: object
    solve: str  # the oracle's command
    example: str  # the instruction's worked call: the task's shape, not its solution
    files: dict[str, str] = field(default_factory=dict)  # the working folder's files

    @property
    def name(self) -> str:
        return f"{self.kind}-" + "-".join(str(k) for k in self.key[1:])


def product_task(a: int, b: int) -> Spec:
    """Put a * b into answer.txt (also the task of tests/integration/test_pi_learns.py)."""
    return Spec("product", ("product", a, b), f"Put the product of {a} and {b} into answer.txt.",
                "answer.txt", a * b, f"echo $(({a} * {b})) > answer.txt",
                example("to put the product of 12 and 34 into answer.txt", "echo $((12 * 34)) > answer.txt"))


def product(rng: random.Random) -> Spec:
    return product_task(rng.randint(100, 999), rng.randint(10, 99))


def count(rng: random.Random) -> Spec:
    word = rng.choice(WORDS)
    other = WORDS[(WORDS.index(word) + 1) % len(WORDS)]  # the example's word: never the task's
    n_lines = rng.randint(6, 14)
    hits = rng.randint(1, n_lines - 2)
    lines = [f"{i},{word},{rng.randint(1, 99)}" for i in range(hits)]
    lines += [f"{i},{rng.choice(FILLER)},{rng.randint(1, 99)}" for i in range(hits, n_lines)]
    rng.shuffle(lines)
    data = "id,fruit,qty\n" + "\n".join(lines) + "\n"
    digest = hashlib.sha256(data.encode()).hexdigest()[:8]  # the data itself is part of the key
    return Spec("count", ("count", word, n_lines, hits, digest),
                f"Count the lines of data.csv that contain '{word}' and write the number into count.txt.",
                "count.txt", hits, f"grep -c {word} data.csv > count.txt",
                example(f"to count the lines of data.csv that contain '{other}' and write the number into "
                        "count.txt", f"grep -c {other} data.csv > count.txt"), {"data.csv": data})


def offbyone(rng: random.Random) -> Spec:
    n = rng.randint(3, 6)
    case = [rng.randint(1, 20) for _ in range(n)]
    held = [[rng.randint(1, 20) for _ in range(rng.randint(2, 6))] for _ in range(3)]
    files = {"util.py": UTIL_PY.format(start=0),
             "test_util.py": TEST_UTIL_PY.format(case=case, want=sum(case))}
    return Spec("offbyone", ("offbyone", *case),
                "util.py's total() skips the last item. Fix util.py so that `python3 test_util.py` passes.",
                "util.py", [(c, sum(c)) for c in [case, *held]],
                "sed -i 's/len(items) - 1/len(items)/' util.py",
                example("to make total() start at the second item of util.py",
                        "sed -i 's/range(0,/range(1,/' util.py"), files)


MAKERS: dict[str, Callable[[random.Random], Spec]] = {"product": product, "count": count,
                                                      "offbyone": offbyone}


def specs(n: int, seed: int, exclude: set[tuple[object, ...]] | None = None,
          kinds: tuple[str, ...] = KINDS) -> list[Spec]:
    """``n`` distinct tasks from ``seed``, the kinds in turn, none whose key is in ``exclude``."""
    rng, seen, out = random.Random(seed), set(exclude or ()), []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 100 * n + 1000:
            raise ValueError(f"cannot draw {n} distinct tasks of {kinds}")
        spec = MAKERS[kinds[len(out) % len(kinds)]](rng)
        if spec.key not in seen:
            seen.add(spec.key)
            out.append(spec)
    return out


def instruction_text(spec: Spec) -> str:
    """The worked call first, then the task: with the task last, the base model put the task's own numbers
    into the example's command (greedy, in a code fence; once in 48 samples as a call), where with the task
    first it copied the example's numbers (README, "Status": the probe's third round)."""
    return f"{spec.example}\n\nNow {spec.instruction[0].lower()}{spec.instruction[1:]}\n"


def write_task(spec: Spec, root: Path) -> Path:
    d = root / spec.name
    if d.exists():
        shutil.rmtree(d)
    (d / "environment" / "app").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "solution").mkdir()
    (d / "instruction.md").write_text(instruction_text(spec))
    (d / "task.toml").write_text(TASK_TOML.format(name=spec.name, kind=spec.kind))
    (d / "environment" / "Dockerfile").write_text(DOCKERFILE)
    for name, text in spec.files.items():
        (d / "environment" / "app" / name).write_text(text)
    (d / "tests" / "test.sh").write_text(TEST_SH)
    (d / "tests" / "check.py").write_text(CHECK_PY.format(
        kind=spec.kind, answer=spec.answer, expected=spec.expected, file_reward=FILE_REWARD,
        original=spec.files.get(spec.answer)))
    (d / "solution" / "solve.sh").write_text(f"#!/bin/bash\nset -e\ncd /app\n{spec.solve}\n")
    for script in (d / "tests" / "test.sh", d / "solution" / "solve.sh"):
        script.chmod(0o755)
    return d


def harbor_box(task: Path, work: Path, logs: Path, *more: str) -> list[str]:
    """A bubblewrap command line laid out as Harbor's container: ``work`` at /app, the task's tests
    read-only at /tests, ``logs`` at /logs, the system read-only, its own pids; then ``more`` bwrap
    arguments."""
    box = [shutil.which("bwrap") or "bwrap", "--die-with-parent", "--unshare-pid",
           "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc", "--dev", "/dev", "--proc", "/proc",
           "--tmpfs", "/tmp", "--bind", str(work), "/app", "--ro-bind", str(task / "tests"), "/tests",
           "--bind", str(logs), "/logs"]
    for link in ("bin", "lib", "lib64", "sbin"):
        target = Path("/") / link
        if target.is_symlink():
            box += ["--symlink", str(target.readlink()), f"/{link}"]
        elif target.is_dir():
            box += ["--ro-bind", str(target), f"/{link}"]
    return box + list(more)


def make(out: Path, train: int, test: int, seed: int = 0, kinds: tuple[str, ...] = KINDS) -> dict[str, int]:
    held = specs(test, EVAL_SEED, kinds=kinds)
    training = specs(train, seed, exclude={s.key for s in held}, kinds=kinds)
    for split, items in (("test", held), ("train", training)):
        for spec in items:
            write_task(spec, out / split)
    return {"train": len(training), "test": len(held)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for train/ and test/")
    p.add_argument("--train", type=int, default=400)
    p.add_argument("--test", type=int, default=60)
    p.add_argument("--seed", type=int, default=0, help="the training tasks' seed (the held-out one is fixed)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    args = p.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not kinds or set(kinds) - set(KINDS):
        p.error(f"--kinds: from {', '.join(KINDS)}")
    counts = make(Path(args.out), args.train, args.test, args.seed, kinds)
    print(json.dumps({"out": args.out, **counts, "kinds": list(kinds)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
