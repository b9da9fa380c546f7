"""/app/app.ini, read as INI, holds exactly the asked sections and values (the answer key below)."""

import configparser
import os
import stat
import sys

EXPECTED = {
    "server": {"host": "0.0.0.0", "port": "8080"},
    "database": {"url": "sqlite:///data/app.db", "pool_size": "5"},
    "features": {"signup": "true", "beta_search": "true"},
    "logging": {"level": "debug", "file": "/var/log/app.log"},
}

MAX_BYTES = 1 << 20


def _read(path: str) -> bytes:
    """``path``'s bytes. It must be a regular file of at most 1 MiB: a link, a FIFO or a device left there
    fails the check rather than hang the verifier (a hung verifier is an infrastructure error, not a 0)."""
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_size <= MAX_BYTES, f"{path}: not a regular file of <= 1 MiB"
    with open(path, "rb") as f:
        return f.read(MAX_BYTES + 1)


def test_the_settings_are_exact() -> None:
    config = configparser.ConfigParser(interpolation=None)
    config.read_string(_read("/app/app.ini").decode())
    assert {s: dict(config[s]) for s in config.sections()} == EXPECTED


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
