"""Per-file test times from a pytest JUnit report (scripts/test.sh writes .venv/test-report.xml): the table
kept in tests/DURATIONS.md. Usage: python scripts/durations.py [REPORT] > tests/DURATIONS.md"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def _file_of(classname: str) -> str:
    parts = classname.split(".")
    if parts and parts[-1][:1].isupper():  # a test class: its module is the file
        parts = parts[:-1]
    return "/".join(parts) + ".py"


def main(path: str = ".venv/test-report.xml") -> None:
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None, f"{path}: no testsuite"
    per_file: dict[str, list[float]] = defaultdict(list)
    for case in suite.iter("testcase"):
        per_file[_file_of(case.get("classname", ""))].append(float(case.get("time", 0)))
    total = sum(sum(v) for v in per_file.values())
    count = sum(map(len, per_file.values()))
    print(f"# Test times per file\n\nFrom `{path}` ({suite.get('timestamp', '?')}): {count} tests, "
          f"{total / 60:.1f} minutes in tests (a fixture's set-up counts in the first test that uses it).\n"
          "Regenerate: `bash scripts/test.sh`, then `python scripts/durations.py > tests/DURATIONS.md`.\n")
    print("| file | tests | seconds |\n|---|---|---|")
    for name, times in sorted(per_file.items(), key=lambda kv: -sum(kv[1])):
        print(f"| `{name}` | {len(times)} | {sum(times):.0f} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
