"""/app/project is a git repository with exactly the asked commit and tag. git runs from /usr/bin with no
system or user configuration and with hooks and fsmonitor off, so nothing configured in the repository runs;
the files' contents are compared with the originals below, not with anything in /app."""

import os
import subprocess
import sys
import time

REPO = "/app/project"
SAFE = ["-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null", "-c", f"safe.directory={REPO}"]
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1", "LC_ALL": "C"}
README = "# tally\n\nCounts the words of standard input: `python3 src/main.py < file.txt`.\n"
MAIN = '"""Counts the words of standard input."""\n\nimport sys\n\nprint(len(sys.stdin.read().split()))\n'

DEADLINE = time.monotonic() + 20  # every command together, well inside the verifier's 30 s


def _left() -> float:
    return max(0.1, DEADLINE - time.monotonic())


def git(*args: str) -> str:
    run = subprocess.run(["/usr/bin/git", *SAFE, "-C", REPO, *args], capture_output=True, text=True,
                         env=ENV, timeout=_left())
    assert run.returncode == 0, (args, run.stderr)
    return run.stdout


def test_main_is_checked_out_and_holds_one_commit() -> None:
    assert os.path.isdir(os.path.join(REPO, ".git"))
    assert git("symbolic-ref", "HEAD").strip() == "refs/heads/main"
    assert git("rev-list", "--count", "refs/heads/main").strip() == "1"
    assert git("for-each-ref", "--format=%(refname)", "refs/heads").split() == ["refs/heads/main"]


def test_the_commit_has_the_exact_author_committer_and_message() -> None:
    fields = git("log", "-1", "--format=%an|%ae|%cn|%ce|%P", "refs/heads/main").strip()
    assert fields == "Ada Lovelace|ada@example.com|Ada Lovelace|ada@example.com|"
    body = git("cat-file", "commit", "refs/heads/main")
    assert body.split("\n\n", 1)[1] == "Initial commit\n"


def test_the_commit_holds_exactly_the_three_files() -> None:
    assert git("ls-tree", "-r", "--name-only", "refs/heads/main").split() == [".gitignore", "README.md",
                                                                              "src/main.py"]
    assert git("cat-file", "blob", "refs/heads/main:README.md") == README
    assert git("cat-file", "blob", "refs/heads/main:src/main.py") == MAIN


def test_out_is_ignored_and_nothing_else_is_left_over() -> None:
    assert git("check-ignore", "-q", "--no-index", "out/main.txt") == ""
    assert git("status", "--porcelain", "--untracked-files=all") == ""


def test_v0_1_0_is_an_annotated_tag_on_the_commit() -> None:
    assert git("cat-file", "-t", "refs/tags/v0.1.0").strip() == "tag"
    assert git("rev-parse", "refs/tags/v0.1.0^{commit}") == git("rev-parse", "refs/heads/main")
    tag = git("cat-file", "tag", "refs/tags/v0.1.0")
    assert tag.split("\n\n", 1)[1] == "First release\n"


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
