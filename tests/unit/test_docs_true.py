"""ARCHITECTURE.md's module tables stay true: every module of middleware/, learner/ and adapters/ has its
line, and no line names a module that does not exist (issue 19: the map is how the next engineer finds their
way)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("middleware", "adapters", "learner")
# Files that are not modules of their own: package markers, and the vLLM plugin's sources (installed into
# vLLM's venv, listed as one folder under launch/).
SKIP = re.compile(r"(^|/)__init__\.py$|^middleware/launch/vllm_plugin/")
SECTION = re.compile(r"^### `(\w+)/`")  # "### `middleware/` = ..."
SUBPACKAGE = re.compile(r"^\| `([\w/]+)/` \|")  # a table headed "| `proxy/` | ... |"
ROW = re.compile(r"^\| `([\w/.*]+\.py)` \|")  # "| `relay.py` | ... |"


def listed() -> set[str]:
    """Every module path the tables name, as ``package/sub/module.py``."""
    out: set[str] = set()
    package = sub = ""
    for line in (ROOT / "ARCHITECTURE.md").read_text().splitlines():
        if m := SECTION.match(line):
            package, sub = m.group(1), ""
        elif line.startswith("| module |"):
            sub = ""  # a table of the package's own modules (the kernel's, the learner's, ...)
        elif m := SUBPACKAGE.match(line):
            sub = m.group(1)
        elif (m := ROW.match(line)) and package:
            out.add("/".join(p for p in (package, sub, m.group(1)) if p))
    return out


def modules() -> set[str]:
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if not SKIP.search(rel):
                found.add(rel)
    return found


def _covered(module: str, names: set[str]) -> bool:
    """A line names the module itself, or a glob row (``frameworks/*.py``) covers its folder."""
    return module in names or any(n.endswith("/*.py") and module.rsplit("/", 1)[0] == n[:-5] for n in names)


def test_every_module_has_its_line_in_architecture_md() -> None:
    names = listed()
    assert len(names) > 50, f"the parser found only {len(names)} lines: did the tables' shape change?"
    missing = sorted(m for m in modules() if not _covered(m, names))
    assert not missing, f"modules with no line in ARCHITECTURE.md: {missing}"


def test_every_line_of_architecture_md_names_a_module_that_exists() -> None:
    stale = sorted(n for n in listed() if "*" not in n and not (ROOT / n).is_file())
    assert not stale, f"ARCHITECTURE.md names modules that do not exist: {stale}"


def test_the_parser_finds_a_known_module_in_each_kind_of_table() -> None:
    names = listed()
    for known in ("middleware/records.py", "middleware/proxy/relay.py", "learner/engines/base.py",
                  "adapters/env/base.py"):
        assert known in names
