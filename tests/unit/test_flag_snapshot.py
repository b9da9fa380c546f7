"""The flags each command generates from its config Struct (``steptap serve``, ``steptap up``, ``steptap
learn``): names, destinations, defaults, choices and arities, snapshotted so moving the generator changes
none of them. ``tests/unit/flag_snapshot.json`` was written from the code before the two generators became
one; regenerate it only for a deliberate change (``STEPTAP_WRITE_FLAG_SNAPSHOT=1``)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from steptap.learner.config import add_config_flags
from steptap.middleware.launch.up_parser import build_parser
from steptap.middleware.server.serve import _parser as serve_parser

SNAPSHOT = Path(__file__).with_name("flag_snapshot.json")


def _learn_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="steptap learn")
    add_config_flags(p)
    return p


def _describe(parser: argparse.ArgumentParser) -> list[dict[str, Any]]:
    out = []
    for a in parser._actions:  # argparse keeps no public list of its actions
        if isinstance(a, argparse._HelpAction):
            continue
        out.append({
            "flags": list(a.option_strings), "dest": a.dest, "default": a.default, "nargs": a.nargs,
            "const": a.const, "choices": list(a.choices) if a.choices is not None else None,
            "required": a.required, "hidden": a.help == argparse.SUPPRESS,
            "type": getattr(a.type, "__name__", None), "action": type(a).__name__,
        })
    return out


def _snapshot() -> dict[str, Any]:
    parsers = {"serve": serve_parser(), "up": build_parser(), "learn": _learn_parser()}
    # through JSON, so tuples and lists compare as the file holds them
    return json.loads(json.dumps({name: _describe(p) for name, p in parsers.items()}))


def test_each_command_keeps_its_flags_and_defaults() -> None:
    now = _snapshot()
    if os.environ.get("STEPTAP_WRITE_FLAG_SNAPSHOT") == "1":
        SNAPSHOT.write_text("{\n" + ",\n".join(  # one flag a line: a change reads as one line
            f" {json.dumps(cmd)}: [\n" + ",\n".join("  " + json.dumps(a) for a in acts) + "\n ]"
            for cmd, acts in now.items()) + "\n}\n")
    assert now == json.loads(SNAPSHOT.read_text())


def test_every_flag_has_help() -> None:
    for name, parser in {"serve": serve_parser(), "up": build_parser(), "learn": _learn_parser()}.items():
        for a in parser._actions:
            if name != "up" and a.option_strings and not isinstance(a, argparse._HelpAction):
                assert a.help, f"steptap {name} {a.option_strings[0]} has no help"
