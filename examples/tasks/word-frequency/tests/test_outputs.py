"""/app/top_words.txt is exactly the top ten of the book the task shipped (the answer key below; the tie at
count 2 is broken alphabetically)."""

import sys

EXPECTED = [("the", 18), ("he", 6), ("light", 4), ("at", 3), ("by", 3), ("keeper", 3), ("lamp", 3),
            ("one", 3), ("was", 3), ("and", 2)]


def test_the_top_ten_are_exact() -> None:
    with open("/app/top_words.txt", encoding="utf-8", newline="") as f:
        assert f.read() == "".join(f"{word} {count}\n" for word, count in EXPECTED)


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
