#!/bin/bash
set -euo pipefail
python3 - <<'PY'
import csv
import sqlite3

db = sqlite3.connect("/app/library.db")
db.execute("CREATE TABLE books (id INTEGER PRIMARY KEY, title TEXT NOT NULL, author TEXT NOT NULL, "
           "year INTEGER, isbn TEXT)")
with open("/app/books.csv", newline="") as f:
    rows = [(int(r["id"]), r["title"], r["author"], int(r["year"]) if r["year"] else None, r["isbn"] or None)
            for r in csv.DictReader(f)]
db.executemany("INSERT INTO books VALUES (?, ?, ?, ?, ?)", rows)
db.commit()
db.close()
PY
