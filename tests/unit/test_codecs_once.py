"""Codecs are made once, in the module that owns their type (ARCHITECTURE.md, `records.py`): the records'
decoders and the one JSON and msgpack encoder live in records.py, the stream envelope's in wire.py, and
everyone else imports them. Read from the source with ast, like test_packaging.py."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("middleware", "learner", "adapters")
VLLM_SIDE = Path("middleware/launch/vllm_plugin")  # runs in vLLM's venv, not steptap's
ENCODER_OWNER = Path("middleware/records.py")  # msgspec encoders take no type: one of each, made there
FORMATS = {"json", "msgpack"}


def _codec_call(node: ast.Call) -> tuple[str, str] | None:
    """``("json", "Decoder")`` for ``msgspec.json.Decoder(...)``, ``("msgpack", "decode")`` ..., else None."""
    func = node.func
    if (isinstance(func, ast.Attribute) and func.attr in ("Encoder", "Decoder", "decode")
            and isinstance(func.value, ast.Attribute) and func.value.attr in FORMATS):
        return func.value.attr, func.attr
    return None


def _type_arg(node: ast.Call, kind: str) -> ast.expr | None:
    if kind == "Decoder" and node.args:
        return node.args[0]
    return next((k.value for k in node.keywords if k.arg == "type"), None)


def _defined(tree: ast.Module) -> set[str]:
    """Top-level classes and type aliases (``LogRecord = Step | ...``) of a module."""
    names = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    names |= {t.id for n in tree.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name)}
    return names


def codecs_outside_their_owner(root: Path) -> list[str]:
    """Each encoder made outside records.py; each decoder (or ``decode(..., type=T)``) whose type is defined
    in another module; each decoder made twice for one type and format."""
    trees = {p.relative_to(root): ast.parse(p.read_text()) for folder in FOLDERS
             for p in sorted((root / folder).rglob("*.py")) if (root / VLLM_SIDE) not in p.parents}
    owners: dict[str, set[Path]] = {}
    for rel, tree in trees.items():
        for name in _defined(tree):
            owners.setdefault(name, set()).add(rel)
    wrong, seen = [], {}
    for rel, tree in trees.items():
        for node in ast.walk(tree):
            call = _codec_call(node) if isinstance(node, ast.Call) else None
            if call is None:
                continue
            fmt, kind = call
            if kind == "Encoder":
                if rel != ENCODER_OWNER:
                    wrong.append(f"{rel}:{node.lineno}: a {fmt} Encoder (import records.{fmt}_encoder)")
                continue
            type_ = _type_arg(node, kind)
            if type_ is None:
                continue
            foreign = sorted(n.id for n in ast.walk(type_) if isinstance(n, ast.Name)
                             and n.id in owners and rel not in owners[n.id])
            if foreign:
                wrong.append(f"{rel}:{node.lineno}: a {fmt} decoder of {', '.join(foreign)}, "
                             f"owned by {sorted(map(str, owners[foreign[0]]))[0]}")
            if kind == "Decoder":
                key = (fmt, ast.unparse(type_))
                if key in seen:
                    wrong.append(f"{rel}:{node.lineno}: a second {fmt} Decoder({key[1]}) "
                                 f"(first: {seen[key]})")
                seen.setdefault(key, f"{rel}:{node.lineno}")
    return sorted(wrong, key=lambda w: (w.split(":")[0], int(w.split(":")[1])))


def test_codecs_are_made_once_by_their_owner() -> None:
    wrong = codecs_outside_their_owner(ROOT)
    assert not wrong, "\n".join(wrong)


def test_the_codec_check_catches_a_second_codec(tmp_path: Path) -> None:
    """The check fails on the ways back: an encoder of one's own, a decoder of a record type outside
    records.py (also as ``decode(type=...)``), and a decoder of a module's own type made twice."""
    (tmp_path / "middleware" / "client").mkdir(parents=True)
    (tmp_path / "middleware" / "records.py").write_text(
        "import msgspec\nclass Step(msgspec.Struct): pass\nclass Trajectory(msgspec.Struct): pass\n"
        "LogRecord = Step | Trajectory\njson_encoder = msgspec.json.Encoder()\n"
        "step_decoder = msgspec.msgpack.Decoder(Step)\n")
    assert codecs_outside_their_owner(tmp_path) == []
    (tmp_path / "middleware" / "client" / "api.py").write_text(
        "import msgspec\nfrom steptap.middleware.records import LogRecord, Trajectory\n"
        "class Info(msgspec.Struct): pass\n"
        "_enc = msgspec.json.Encoder()\n_traj = msgspec.json.Decoder(Trajectory)\n"
        "_log = msgspec.msgpack.Decoder(LogRecord | None)\n"
        "def f(b): return msgspec.json.decode(b, type=Trajectory)\n"
        "_info = msgspec.json.Decoder(Info)\n_info2 = msgspec.json.Decoder(Info)\n")
    found = codecs_outside_their_owner(tmp_path)
    assert [w.split(": ", 1)[1].split(" (")[0].split(",")[0] for w in found] == [
        "a json Encoder", "a json decoder of Trajectory", "a msgpack decoder of LogRecord",
        "a json decoder of Trajectory", "a second json Decoder(Info)"], found
