"""ARCHITECTURE.md's module tables stay true: every module of middleware/, learner/ and adapters/ has its
line, and no line names a module that does not exist (issue 19: the map is how the next engineer finds their
way), and docs/limits.md's table names each limit's default and flag as the code has them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

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

    from steptap.middleware.cli.flags import flag_name as _flag
    from steptap.middleware.config import ProxyConfig, add_proxy_flags

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



# --- every path, module, command and flag the docs name exists (issue 41) ---------------------------------
# Where people read: README.md, ARCHITECTURE.md, docs/*.md; and module docstrings, for what they name in other
# modules. Other engineers edit docs in parallel: each message names the file, the line, what it names and
# what to do about it.
DOCS = ("README.md", "ARCHITECTURE.md",
        *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")))
TOP = ("middleware", "adapters", "learner", "tests", "docs", "scripts", "bench", "examples", ".ci")
REPO_PATH = re.compile(r"(?<![\w./~$-])((?:{})/[\w./-]*[\w/])".format("|".join(re.escape(t) for t in TOP)))
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
# `steptap CMD ...` where a shell would run it: first on the line, or after &&, ;, |, (, $(, VAR=value, a path
STEPTAP_CALL = re.compile(r"(?:^|&&|;|\||\(|\$\()\s*(?:[A-Z_]+=\S*\s+)*(?:\S*/)?steptap ([a-z][a-z-]*)"
                          r"([^`\n|;&#]*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)")
MODULE_REF = re.compile(r"\bsteptap\.((?:middleware|adapters|learner)(?:\.\w+)+)")
QUOTED = re.compile(r"\"[^\"]*\"|'[^']*'")
MODULE_SPAN = re.compile(r"`([\w/.-]+\.py)`")  # `wal.py`, `log/writer.py`: some file of the repository
UPSTREAM = {"qwen2_vl.py", "transformers_utils/processor.py"}  # vLLM's and transformers' files (platform.md)


def _tracked() -> tuple[set[str], set[str]]:
    """The repository's files (tracked, or new and not ignored) and every folder holding one."""
    import subprocess

    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    files = {line for line in out.splitlines() if line}
    dirs = {"/".join(Path(f).parts[:i]) for f in files for i in range(1, len(Path(f).parts))}
    return files, dirs


def _module_file(dotted: str) -> Path:
    """``steptap.middleware.server.serve`` -> middleware/server/serve.py (or the package's __init__.py)."""
    base = ROOT.joinpath(*dotted.removeprefix("steptap.").split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def command_flags() -> dict[str, set[str]]:
    """Every ``steptap`` subcommand and the flags it takes: the generated parsers built here (serve, up,
    learn), and the ``add_argument`` literals of the command's module and the project modules it imports."""
    import argparse
    import ast

    from steptap.learner.config import add_config_flags
    from steptap.middleware.cli.main import COMMANDS
    from steptap.middleware.launch.up_parser import build_parser
    from steptap.middleware.server.serve import _parser as serve_parser

    learn = argparse.ArgumentParser()
    add_config_flags(learn)
    built = {"serve": serve_parser(), "up": build_parser(), "learn": learn}
    out: dict[str, set[str]] = {}
    for name, (target, _, _) in COMMANDS.items():
        actions = built[name]._actions if name in built else []  # argparse keeps no public list of them
        flags = {"--help"} | {s for a in actions for s in a.option_strings}
        main = _module_file(target.split(":")[0])
        modules = [main] + [_module_file(n.module) for n in ast.walk(ast.parse(main.read_text()))
                            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("steptap.")]
        for path in (m for m in modules if m.is_file()):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "add_argument"):
                    flags |= {a.value for a in node.args if isinstance(a, ast.Constant)
                              and isinstance(a.value, str) and a.value.startswith("--")}
        out[name] = flags
    return out


def _defined(path: Path) -> set[str]:
    """The top-level names of a module: its functions, classes, assignments and imports."""
    import ast

    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def module_problem(dotted: str) -> str | None:
    """Why ``steptap.<dotted>`` names nothing (None when a module, or a name one defines, exists)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:cut]))
        if not path.is_file():
            continue
        if cut == len(parts) or parts[cut] in _defined(path):
            return None
        missing = "/".join(parts[:cut + 1])
        return (f"no module {missing}.py, nor a name {parts[cut]!r} in {path.relative_to(ROOT)}"
                if path.name == "__init__.py" else f"{path.relative_to(ROOT)} defines no {parts[cut]!r}")
    return f"no package {parts[0]}/"


def _code_of(text: str) -> list[tuple[int, str]]:
    """(line, text) of each inline code span and each line of a fenced block (continuations joined)."""
    out = [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in CODE_SPAN.finditer(text)]
    for m in FENCE.finditer(text):
        start = text.count("\n", 0, m.start()) + 2
        joined, first = "", start
        for i, line in enumerate(m.group(1).splitlines()):
            if not joined:
                first = start + i
            joined += line.rstrip("\\")
            if not line.endswith("\\"):
                out.append((first, joined))
                joined = ""
    return sorted(out, key=lambda item: item[0])  # by line; spans of one line in their order


def doc_problems(name: str, text: str, flags: dict[str, set[str]], files: set[str],
                 dirs: set[str]) -> list[str]:
    """What ``text`` (the doc ``name``) names that does not exist, one message each, saying what to fix."""
    problems = []
    for m in REPO_PATH.finditer(text):
        path = m.group(1).rstrip(".").rstrip("/")
        if any(c in path for c in "<>{}*") or path in files or path in dirs:
            continue
        line = text.count("\n", 0, m.start()) + 1
        problems.append(f"{name}:{line}: names {path}, which does not exist: fix the path or drop the "
                        "mention")
    for m in MODULE_SPAN.finditer(text):
        path = m.group(1)
        if path not in UPSTREAM and not any(f == path or f.endswith("/" + path) for f in files):
            line = text.count("\n", 0, m.start()) + 1
            problems.append(f"{name}:{line}: names `{path}`, which no file of the repository is: fix the "
                            "name (a module moved or was split?) or drop it")
    for line, code in _code_of(text):
        for m in MODULE_REF.finditer(code):
            why = module_problem(m.group(1).rstrip("."))
            if why:
                problems.append(f"{name}:{line}: `steptap.{m.group(1)}`: {why}")
        for m in STEPTAP_CALL.finditer(code):
            command, rest = m.group(1), m.group(2).split(" -- ")[0]
            if command not in flags:
                problems.append(f"{name}:{line}: `steptap {command}`: no such command (`steptap --help` "
                                f"lists {', '.join(sorted(flags))})")
                continue
            for flag in FLAG.findall(QUOTED.sub("", rest)):
                if flag not in flags[command]:
                    problems.append(f"{name}:{line}: `steptap {command} {flag}`: steptap {command} has no "
                                    f"{flag}; fix the doc (or the command)")
    return problems


def test_every_path_module_command_and_flag_the_docs_name_exists() -> None:
    files, dirs = _tracked()
    flags = command_flags()
    problems = [p for doc in DOCS for p in doc_problems(doc, (ROOT / doc).read_text(), flags, files, dirs)]
    assert not problems, "docs name what does not exist:\n" + "\n".join(problems)


def test_the_docs_check_fails_on_a_wrong_path_module_command_and_flag() -> None:
    text = ("See middleware/log/nowhere.py, docs/log.md and `middleware/log/`, `wal.py` and `walrus.py`.\n"
            "Run `steptap serve --backend unix:/x --no-such-flag` or `steptap serve --help`,\n"
            "`steptap frobnicate`, `steptap.middleware.records.NoSuchName`, `steptap.middleware.nomodule`.\n"
            "```\nagent --> steptap proxy --> vLLM\n"
            "steptap up --learn-args=\"--lr 1e-5\" \\\n  --not-up\nsteptap run -- claude --print\n```\n")
    files, dirs = _tracked()
    flags = command_flags()
    assert doc_problems("x.md", text, flags, files, dirs) == [
        "x.md:1: names middleware/log/nowhere.py, which does not exist: fix the path or drop the "
        "mention",
        "x.md:1: names `walrus.py`, which no file of the repository is: fix the name (a module moved or was "
        "split?) or drop it",
        "x.md:2: `steptap serve --no-such-flag`: steptap serve has no --no-such-flag; fix the doc (or the "
        "command)",
        f"x.md:3: `steptap frobnicate`: no such command (`steptap --help` lists {', '.join(sorted(flags))})",
        "x.md:3: `steptap.middleware.records.NoSuchName`: middleware/records.py defines no 'NoSuchName'",
        "x.md:3: `steptap.middleware.nomodule`: no module middleware/nomodule.py, nor a name 'nomodule' in "
        "middleware/__init__.py",
        "x.md:6: `steptap up --not-up`: steptap up has no --not-up; fix the doc (or the command)",
    ]


# --- module docstrings name what other modules define -------------------------------------------------------
DOTTED = re.compile(r"``([A-Za-z_]\w*)\.([A-Za-z_]\w*)(?:\(\))?``")
NOT_NAMES = {"py", "md", "json", "jsonl", "toml", "txt", "sh", "log", "parquet", "html", "js", "css", "gz"}


class _Names:
    """What each project module and class defines, for resolving ``module.name`` and ``Class.member``."""

    def __init__(self, root: Path) -> None:
        import ast

        self.root = root
        self.modules: dict[Path, set[str]] = {}  # file -> its top-level names and its classes' members
        self.classes: dict[str, set[str]] = {}  # class name -> members (of every class so named, and bases)
        bases: dict[str, list[str]] = {}
        for folder in ("middleware", "adapters", "learner"):
            for path in sorted((root / folder).rglob("*.py")):
                tree = ast.parse(path.read_text())
                names = _defined(path)
                for node in tree.body:
                    if isinstance(node, ast.ClassDef):
                        members = _members(node)
                        names |= members
                        self.classes.setdefault(node.name, set()).update(members)
                        bases.setdefault(node.name, []).extend(
                            b.id for b in node.bases if isinstance(b, ast.Name))
                self.modules[path] = names
        for name, of in bases.items():  # a subclass has its project bases' members too
            for base in of:
                self.classes[name] |= self.classes.get(base, set())

    def problem(self, path: Path, owner: str, name: str) -> str | None:
        """Why ``owner.name``, in ``path``'s docstring, names nothing (None if it does, or if ``owner`` is
        neither a project class nor a module ``path`` imports or sits beside)."""
        if owner in self.classes:
            return None if name in self.classes[owner] else f"class {owner} has no {name!r}"
        target = self._module(path, owner)
        if target is None or name in self.modules[target]:
            return None
        return f"{target.relative_to(self.root)} defines no {name!r}"

    def _module(self, path: Path, stem: str) -> Path | None:
        import ast

        sibling = path.with_name(f"{stem}.py")
        if sibling in self.modules:
            return sibling
        for node in ast.walk(ast.parse(path.read_text())):  # ``from steptap.middleware import files``
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("steptap."):
                for alias in node.names:
                    if (alias.asname or alias.name) == stem:
                        found = _module_file(f"{node.module}.{alias.name}")
                        if found in self.modules:
                            return found
        return None


def _members(cls: Any) -> set[str]:
    import ast

    out = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id in ("self", "cls") and isinstance(node.ctx, ast.Store)):
            out.add(node.attr)
    return out


def docstring_problems(root: Path) -> list[str]:
    import ast

    names = _Names(root)
    problems = []
    for path in names.modules:
        doc = ast.get_docstring(ast.parse(path.read_text()))
        for m in DOTTED.finditer(doc or ""):
            if m.group(2) in NOT_NAMES:
                continue
            why = names.problem(path, m.group(1), m.group(2))
            if why:
                named, where = f"``{m.group(1)}.{m.group(2)}``", path.relative_to(root)
                problems.append(f"{where}: its docstring names {named}, but {why}: name what is there")
    return problems


def test_module_docstrings_name_what_other_modules_define() -> None:
    problems = docstring_problems(ROOT)
    assert not problems, "\n".join(problems)


def test_the_docstring_check_fails_on_a_name_that_moved(tmp_path: Path) -> None:
    (tmp_path / "middleware" / "log").mkdir(parents=True)
    (tmp_path / "middleware" / "log" / "writer.py").write_text('"""W."""\ndef write_all() -> None: ...\n')
    (tmp_path / "middleware" / "log" / "wal.py").write_text(
        '"""Appends go through ``writer.write_all`` and ``writer.sync``; ``Log.append`` and ``Log.gone``;\n'
        '``record.sync`` is no module here."""\nclass Log:\n    def append(self) -> None: ...\n')
    assert docstring_problems(tmp_path) == [
        "middleware/log/wal.py: its docstring names ``writer.sync``, but middleware/log/writer.py defines no "
        "'sync': name what is there",
        "middleware/log/wal.py: its docstring names ``Log.gone``, but class Log has no 'gone': name what is "
        "there",
    ]


# --- metrics.py is the one definition of every metric name it says it is ------------------------------------
METRIC_MAKERS = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum", "CounterMetricFamily",
                 "GaugeMetricFamily", "HistogramMetricFamily", "SummaryMetricFamily", "InfoMetricFamily"}
METRIC_NAME = re.compile(r"(?<![\w/.])(steptap_[a-z_]+[a-z])(?![\w/.])")
SAMPLE_SUFFIXES = ("_total", "_count", "_sum", "_bucket", "_created")


def metric_names() -> set[str]:
    from steptap.middleware import metrics

    return {v for k, v in vars(metrics).items() if k.isupper() and isinstance(v, str)
            and v.startswith("steptap_")}


def metric_literals(root: Path) -> list[str]:
    """Metrics made with a name written out instead of one of metrics.py's constants."""
    import ast

    wrong = []
    for path in sorted((root / "middleware").rglob("*.py")):
        tree = ast.parse(path.read_text())
        makers = set(METRIC_MAKERS)
        for node in ast.walk(tree):  # local aliases: ``g, c = GaugeMetricFamily, CounterMetricFamily``
            if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Tuple, ast.Name)):
                values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
                targets = node.targets[0].elts if isinstance(node.targets[0], ast.Tuple) else node.targets
                makers |= {t.id for t, v in zip(targets, values, strict=False) if isinstance(t, ast.Name)
                           and isinstance(v, ast.Name) and v.id in METRIC_MAKERS}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            first = node.args[0]
            if func in makers and isinstance(first, ast.Constant) and isinstance(first.value, str):
                wrong.append(f"{path.relative_to(root)}:{node.lineno}: metric {first.value!r} named here: "
                             "add it to middleware/metrics.py's names and use the constant")
    return wrong


def test_every_metric_is_named_in_metrics_py_and_the_docs_name_only_those() -> None:
    wrong = metric_literals(ROOT)
    assert not wrong, "\n".join(wrong)
    names = metric_names()
    assert len(names) > 40, names
    files, _ = _tracked()
    stems = {Path(f).stem for f in files} | {Path(f).name for f in files}
    problems = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for m in METRIC_NAME.finditer(text):
            name = m.group(1)
            base = next((name.removesuffix(s) for s in SAMPLE_SUFFIXES if name.endswith(s)), name)
            if name not in names and base not in names and name not in stems:
                line = text.count("\n", 0, m.start()) + 1
                problems.append(f"{doc}:{line}: metric {name} is not one the proxy exports "
                                "(middleware/metrics.py names them all): fix its name")
    assert not problems, "\n".join(problems)


def test_the_metric_check_fails_on_a_name_written_out(tmp_path: Path) -> None:
    (tmp_path / "middleware" / "weights").mkdir(parents=True)
    (tmp_path / "middleware" / "weights" / "routes.py").write_text(
        "from prometheus_client.core import GaugeMetricFamily\nfrom steptap.middleware import metrics as m\n"
        "def collect():\n    g = GaugeMetricFamily\n    yield g('steptap_made_up', 'x', 1)\n"
        "    yield GaugeMetricFamily(m.POLICY_VERSION, 'y', 2)\n")
    assert metric_literals(tmp_path) == [
        "middleware/weights/routes.py:5: metric 'steptap_made_up' named here: add it to "
        "middleware/metrics.py's names and use the constant"]
