"""/app/active_emails.txt lists exactly the active users' addresses of the users.json the task shipped (the
answer key below), lowercased, once each, sorted."""

import sys

EXPECTED = [
    "ada@example.org", "alan.1@example.com", "barbara.4@example.com", "dennis.7@example.com",
    "donald@example.net", "edsger@example.org", "ken@example.org", "linus@example.org",
    "margaret@example.net",
]


def test_the_addresses_are_exact() -> None:
    with open("/app/active_emails.txt", encoding="utf-8", newline="") as f:
        assert f.read() == "".join(e + "\n" for e in EXPECTED)


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
