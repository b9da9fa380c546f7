"""Every Python file of /app is the original with get_user renamed (by word) and nothing else changed: their
hashes below are the answer key. main.py, run in its own python3, prints what it printed before."""

import hashlib
import os
import stat
import subprocess
import sys

EXPECTED = {
    "main.py": "c1bc241ca4d47bdcb74e972978696dafcfe5847abc41647f0d955aa0819ea390",
    "shop/__init__.py": "069515b50ad56856578dab9bc90f033b426e094f9067d86536c2a950455dbe4a",
    "shop/orders.py": "cb43a83a612fe5e5775106c50880df4f2c756d8d90b5955df30a9bd5a537d6dd",
    "shop/report.py": "175b0901816ebab6c4fd193ec8e85c31a948e936cfca824b7d35d9b48029a564",
    "shop/users.py": "a4597837377d5edb2c576eb5cb1bd26f73ce3815a544795d2ea4cab70b906d68",
}
OUTPUT = "ada: 3 tea, 2 scone\ngrace: 1 tea\nalan: 1 cake\nfirst buyer: ada\nuser 2 is grace\n"

MAX_BYTES = 1 << 20


def _read(path: str) -> bytes:
    """``path``'s bytes. It must be a regular file of at most 1 MiB: a link, a FIFO or a device left there
    fails the check rather than hang the verifier (a hung verifier is an infrastructure error, not a 0)."""
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_size <= MAX_BYTES, f"{path}: not a regular file of <= 1 MiB"
    with open(path, "rb") as f:
        return f.read(MAX_BYTES + 1)


def _python_files() -> dict[str, str]:
    found = {}
    for top, dirs, files in os.walk("/app"):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(top, name)
                found[os.path.relpath(path, "/app")] = hashlib.sha256(_read(path)).hexdigest()
    return found


def test_each_file_is_the_original_with_the_name_changed() -> None:
    assert _python_files() == EXPECTED


def test_main_prints_the_same_report() -> None:
    run = subprocess.run([sys.executable, "-I", "-c", "import runpy, sys; sys.path.insert(0, '/app'); "
                          "runpy.run_path('/app/main.py', run_name='__main__')"],
                         capture_output=True, text=True, timeout=20, cwd="/app")
    assert run.returncode == 0 and run.stdout == OUTPUT, run.stderr[-2000:]


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
