"""Who owns a session's state (issue 41 item 2), read from the source with ``ast``: ``LiveSession``
(``sessions/session.py``) is the session domain's, written only from ``middleware/sessions/``; what the proxy
keeps for a session between its calls (its latest token prompt, its TITO turn's state) is the proxy's own
``CallState`` (``proxy/call_state.py``), handed to the recorder in the call's ``CallContext``. Neither class
has a field typed ``Any``. Each rule is also run on a deliberate violation (``tmp_path``) and must fail on it.

A write is found by its target: an attribute of an expression that names a session (``session``,
``self.session``, ``call.session``...), in an assignment, an augmented or annotated one, a tuple unpacked, a
``for`` or ``with`` target, or a ``setattr`` on it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MIDDLEWARE = ROOT / "middleware"


def _names_a_session(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return "session" in node.id.lower() and node.id != "ClientSession"
    return isinstance(node, ast.Attribute) and node.attr.lower().endswith("session")


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    if isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor)):
        return [node.target]
    if isinstance(node, ast.withitem) and node.optional_vars is not None:
        return [node.optional_vars]
    return []


def _flat(target: ast.expr) -> list[ast.expr]:
    if isinstance(target, (ast.Tuple, ast.List)):
        return [t for elt in target.elts for t in _flat(elt)]
    return [target.value] if isinstance(target, ast.Starred) else [target]


def session_writes(root: Path) -> list[str]:
    """``path:line: attr`` for each attribute of a session assigned under ``root`` (a middleware tree)
    outside ``sessions/``."""
    wrong: list[tuple[str, int, str]] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "sessions":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            for target in (t for top in _targets(node) for t in _flat(top)):
                if isinstance(target, ast.Attribute) and _names_a_session(target.value):
                    wrong.append((rel.as_posix(), target.lineno, target.attr))
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                    and node.args and _names_a_session(node.args[0])):
                wrong.append((rel.as_posix(), node.lineno, "setattr"))
    return [f"{rel}:{line}: {attr}" for rel, line, attr in sorted(wrong)]


def any_fields(path: Path, cls: str) -> list[str]:
    """``Class.field`` for each field of class ``cls`` in ``path`` whose annotation names ``Any`` (in the
    class body, or ``self.field: ...`` in its methods)."""
    tree = ast.parse(path.read_text())
    [node] = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls]
    found: list[str] = []
    for ann in (n for n in ast.walk(node) if isinstance(n, ast.AnnAssign)):
        annotation = ann.annotation
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):  # a quoted one
            annotation = ast.parse(annotation.value, mode="eval").body
        if any((isinstance(n, ast.Name) and n.id == "Any")
               or (isinstance(n, ast.Attribute) and n.attr == "Any") for n in ast.walk(annotation)):
            target = ann.target
            found.append(f"{cls}.{target.attr if isinstance(target, ast.Attribute) else ast.unparse(target)}")
    return found


def test_no_attribute_of_a_session_is_written_outside_sessions() -> None:
    wrong = session_writes(MIDDLEWARE)
    assert not wrong, ("a LiveSession attribute written outside middleware/sessions/ (the proxy keeps its "
                       "own state in proxy/call_state.py's CallState):\n" + "\n".join(wrong))


def test_the_session_and_the_proxy_state_have_no_any_field() -> None:
    assert any_fields(MIDDLEWARE / "sessions" / "session.py", "LiveSession") == []
    assert any_fields(MIDDLEWARE / "proxy" / "call_state.py", "CallState") == []


def test_the_rules_fail_on_a_write_from_the_proxy_and_an_any_field(tmp_path: Path) -> None:
    (tmp_path / "sessions").mkdir()
    (tmp_path / "proxy").mkdir()
    (tmp_path / "sessions" / "session.py").write_text(
        "from typing import Any\nimport typing\n"
        "class LiveSession:\n    kind: typing.Any\n"
        "    def __init__(self) -> None:\n        self.tito_state: Any = None\n        self.n: int = 0\n"
        "        self.later: 'list[Any] | None' = None\n"
        "def reset(session: LiveSession) -> None:\n    session.n = 0\n")  # sessions/ may write it
    (tmp_path / "proxy" / "tito.py").write_text(
        "def turn(session, call, state):\n"
        "    session.tito_state = 1\n"
        "    spare, session.tito_spare = 1, 2\n"
        "    call.session.grown = state.grown = None\n"
        "    self_session = session\n    self_session.bytes += 3\n"
        "    setattr(session, 'kept', None)\n"
        "    state.prompt = None\n")  # the proxy's own state: fine
    assert session_writes(tmp_path) == [
        "proxy/tito.py:2: tito_state",
        "proxy/tito.py:3: tito_spare",
        "proxy/tito.py:4: grown",
        "proxy/tito.py:6: bytes",
        "proxy/tito.py:7: setattr",
    ]
    assert any_fields(tmp_path / "sessions" / "session.py", "LiveSession") == [
        "LiveSession.kind", "LiveSession.tito_state", "LiveSession.later"]
