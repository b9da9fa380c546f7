"""/app/site's main is the bundle's main (as the task shipped it) plus one revert commit whose tree is the
expected one: the hashes below are fixed by the bundle's contents. git runs from /usr/bin with no system or
user configuration and with hooks and fsmonitor off, so nothing configured in the repository runs."""

import subprocess
import sys
import time

REPO = "/app/site"
SAFE = ["-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null", "-c", f"safe.directory={REPO}"]
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1", "LC_ALL": "C"}
OLD_TIP = "97d449ccee607d45b9be92df6351b9e526fd9d23"  # "Mention sales"
THEME = "9d820711433379f8af4947900193d92f14429148"  # "Switch to the new theme"
REVERTED_TREE = "b560c8d6b3273ef710b5c3a5547c2d5bb72685de"  # the old tip's files with the theme undone

DEADLINE = time.monotonic() + 20  # every command together, well inside the verifier's 30 s


def _left() -> float:
    return max(0.1, DEADLINE - time.monotonic())


def git(*args: str) -> str:
    run = subprocess.run(["/usr/bin/git", *SAFE, "-C", REPO, *args], capture_output=True, text=True,
                         env=ENV, timeout=_left())
    assert run.returncode == 0, (args, run.stderr)
    return run.stdout


def test_main_is_the_old_history_plus_one_commit() -> None:
    assert git("rev-parse", "refs/heads/main^@").split() == [OLD_TIP]


def test_the_new_commit_undoes_the_theme_and_nothing_else() -> None:
    assert git("rev-parse", "refs/heads/main^{tree}").strip() == REVERTED_TREE


def test_the_message_is_git_reverts_default() -> None:
    message = git("log", "-1", "--format=%B", "refs/heads/main")
    assert message.startswith('Revert "Switch to the new theme"\n\nThis reverts commit ' + THEME + ".")


def test_main_is_checked_out_and_clean() -> None:
    assert git("symbolic-ref", "HEAD").strip() == "refs/heads/main"
    assert git("status", "--porcelain", "--untracked-files=all") == ""


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
