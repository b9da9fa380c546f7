"""/app/library.db, opened read-only, holds exactly the table and the rows of the CSV the task shipped (the
answer key below), with the asked types."""

import os
import sqlite3
import stat
import sys

COLUMNS = [("id", "INTEGER", 0, 1), ("title", "TEXT", 1, 0), ("author", "TEXT", 1, 0),
           ("year", "INTEGER", 0, 0), ("isbn", "TEXT", 0, 0)]
ROWS = [
    (1, "The Pragmatic Lighthouse", "Ada Byron", 1999, "978-0-00-000001-1"),
    (2, "Compilers, Briefly", "Grace Hopper", 1986, "978-0-00-000002-8"),
    (3, "Untitled Notes", "Anonymous", None, "978-0-00-000003-5"),
    (4, 'The "Last" Algorithm', "Alan Turing", 1950, "978-0-00-000004-2"),
    (5, "Bits and Pieces", "Claude Shannon", 1948, None),
]

MAX_BYTES = 1 << 20


def _read(path: str) -> bytes:
    """``path``'s bytes. It must be a regular file of at most 1 MiB: a link, a FIFO or a device left there
    fails the check rather than hang the verifier (a hung verifier is an infrastructure error, not a 0)."""
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_size <= MAX_BYTES, f"{path}: not a regular file of <= 1 MiB"
    with open(path, "rb") as f:
        return f.read(MAX_BYTES + 1)


def _db() -> sqlite3.Connection:
    _read("/app/library.db")  # a small regular file, or no database at all
    db = sqlite3.connect("file:/app/library.db?mode=ro", uri=True)
    db.execute("PRAGMA trusted_schema = OFF")
    return db


def test_only_the_books_table_exists() -> None:
    with _db() as db:
        assert db.execute("SELECT type, name FROM sqlite_schema").fetchall() == [("table", "books")]


def test_the_columns_are_exact() -> None:
    with _db() as db:
        info = db.execute("PRAGMA table_info(books)").fetchall()
    assert [(name, kind.upper(), notnull, pk) for _cid, name, kind, notnull, _default, pk in info] == COLUMNS


def test_the_rows_and_their_types_are_exact() -> None:
    with _db() as db:
        rows = db.execute("SELECT id, title, author, year, isbn FROM books ORDER BY id").fetchall()
    assert rows == ROWS
    assert [type(r[3]) for r in rows] == [type(r[3]) for r in ROWS]


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
