"""/app/library.db, opened read-only, holds exactly the table and the rows of the CSV the task shipped (the
answer key below), with the asked types."""

import sqlite3
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


def _db() -> sqlite3.Connection:
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
