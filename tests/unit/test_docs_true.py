"""ARCHITECTURE.md's module tables stay true: every module of middleware/, learner/ and adapters/ has its
line, and no line names a module that does not exist (issue 19: the map is how the next engineer finds their
way), and docs/limits.md's table names each limit's default and flag as the code has them."""

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


# --- docs/limits.md's table: each limit's default and flag are the code's (issue 19: `read_bufsize` was
# documented "config only" while `--read-bufsize` existed) ------------------------------------------------
LIMIT_ROW = re.compile(r"^\| `(\w+)` \| ([^|]+) \| ([^|]+) \|")
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "s": 1, "h": 3600, "days": 86400}


def _amount(text: str) -> float:
    """``"64 MiB"`` -> 67108864, ``"1,000"`` -> 1000, ``"60 s"`` -> 60."""
    number, _, unit = text.strip().partition(" ")
    return float(number.replace(",", "")) * UNITS[unit] if unit else float(number.replace(",", ""))


def limits_table_mismatches(text: str) -> list[str]:
    import argparse

    import msgspec

    from steptap.middleware.config import ProxyConfig, add_proxy_flags
    from steptap.middleware.flags import flag_name as _flag

    parser = argparse.ArgumentParser()
    add_proxy_flags(parser)
    flags = {s for a in parser._actions for s in a.option_strings}
    defaults = {f.name: f.default for f in msgspec.structs.fields(ProxyConfig)}
    wrong = []
    for line in text.splitlines():
        if not (m := LIMIT_ROW.match(line)) or m.group(1) not in defaults:
            continue
        name, default, flag = m.group(1), m.group(2), m.group(3)
        if _amount(default) != defaults[name]:
            wrong.append(f"{name}: documented default {default.strip()}, the code's {defaults[name]}")
        named = re.findall(r"`(--[\w-]+)`", flag)
        if named != [_flag(name)] or named[0] not in flags:
            wrong.append(f"{name}: documented flag {flag.strip()}, the code's `{_flag(name)}`")
    return wrong


def test_the_limits_table_has_the_codes_defaults_and_flags() -> None:
    text = (ROOT / "docs" / "limits.md").read_text()
    rows = sum(bool(LIMIT_ROW.match(line)) for line in text.splitlines())
    assert rows > 15, f"the parser found {rows} rows: did the table's shape change?"
    wrong = limits_table_mismatches(text)
    assert not wrong, "\n".join(wrong)
    # and the check fails on the two ways a row goes stale
    stale = "| `max_n` | 32 | `--max-n` | x |\n| `read_bufsize` | 4 MiB | (config only) | x |\n"
    assert limits_table_mismatches(stale) == [
        "max_n: documented default 32, the code's 64",
        "read_bufsize: documented flag (config only), the code's `--read-bufsize`"]
