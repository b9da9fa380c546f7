"""/app/app.ini, read as INI, holds exactly the asked sections and values (the answer key below)."""

import configparser
import sys

EXPECTED = {
    "server": {"host": "0.0.0.0", "port": "8080"},
    "database": {"url": "sqlite:///data/app.db", "pool_size": "5"},
    "features": {"signup": "true", "beta_search": "true"},
    "logging": {"level": "debug", "file": "/var/log/app.log"},
}


def test_the_settings_are_exact() -> None:
    config = configparser.ConfigParser(interpolation=None)
    with open("/app/app.ini", encoding="utf-8") as f:
        config.read_file(f)
    assert {s: dict(config[s]) for s in config.sections()} == EXPECTED


def _main() -> int:
    """Runs every test_ function (the file also runs under pytest, where there is one)."""
    failed = 0
    for name, test in list(globals().items()):
        if name.startswith("test_") and callable(test):
            try:
                test()
            except Exception as exc:  # a failed assertion, or an output that cannot be read
                failed += 1
                print(f"FAILED {name}: {exc!r}")
            else:
                print(f"passed {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_main())
