"""Command-line flags generated from a config Struct: the one generator (``ProxyConfig`` for ``steptap serve``
and ``steptap up``, ``LearnerConfig`` for ``steptap learn``). A field's help is its ``msgspec.Meta``
description (``described``), its default the Struct's, so flags, help and defaults never drift."""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Collection, Mapping
from typing import Any, Literal

import msgspec


def described(text: str) -> msgspec.Meta:
    """A field's description: its flag's help (``Annotated[int, described("...")]``)."""
    return msgspec.Meta(description=text)


def flag_name(name: str) -> str:
    """A plain flag's name: ``reward_timeout_s`` -> ``--reward-timeout`` (seconds say so in the metavar)."""
    return "--" + name.removesuffix("_s").replace("_", "-")


def _base_type(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) and args else hint


def _default(field: msgspec.structs.FieldInfo) -> Any:
    return field.default if field.default_factory is msgspec.NODEFAULT else field.default_factory()


def add_struct_flags(
    parser: argparse.ArgumentParser, struct: type[msgspec.Struct], *, layered: bool = False,
    only: Collection[str] | None = None, skip: Collection[str] = (), hidden: Collection[str] = (),
    repeated: Collection[str] = (), secrets: Mapping[str, str] | None = None,
) -> None:
    """One ``--field-name`` flag per field of ``struct`` (``dest`` the field's name).

    Plain (``steptap serve``): each flag's default is the field's; ``*_s`` fields drop the suffix
    (``--reward-timeout``, seconds say so in the metavar); a boolean is ``--x`` (default off) or ``--no-x``
    (default on); a list field is repeated (``action=append``), a dict one is ``NAME=VALUE,...``; a field
    without a default is required. ``repeated``: str fields that may be given more than once (a list comes
    back); ``secrets``: field -> environment variable, with a ``--x-file`` flag beside it.

    ``layered`` (``steptap learn``, whose config file sits under its flags): every default is None (unset),
    the help names the field's default; names keep the field's name; booleans take ``--x`` and ``--no-x``;
    sequences are ``nargs="*"``."""
    hints = typing.get_type_hints(struct, include_extras=True)
    fields = {f.name: f for f in msgspec.structs.fields(struct)}
    for name in struct.__struct_fields__:
        if name in skip or (only is not None and name not in only):
            continue
        hint = hints[name]
        meta = next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, msgspec.Meta)), None)
        desc = meta.description if meta is not None and meta.description else ""
        type_ = _base_type(typing.get_args(hint)[0] if hasattr(hint, "__metadata__") else hint)
        default = _default(fields[name])
        if layered:
            _layered(parser, name, type_, default, desc)
        else:
            _plain(parser, name, type_, default, argparse.SUPPRESS if name in hidden else desc,
                   name in repeated, (secrets or {}).get(name))


def _layered(parser: argparse.ArgumentParser, name: str, type_: Any, default: Any, desc: str) -> None:
    flag = "--" + name.replace("_", "-")
    shown = list(default) if isinstance(default, tuple) else default
    help_ = f"{desc} (default {shown!r})".lstrip()
    if type_ is bool:
        parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        return
    origin = typing.get_origin(type_)
    kw: dict[str, Any] = {"type": type_}
    if origin is Literal:
        choices = typing.get_args(type_)
        kw = {"type": type(choices[0]), "choices": choices}
    elif origin in (list, tuple):
        kw = {"nargs": "*", "type": typing.get_args(type_)[0]}
    parser.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=help_, **kw)


def _plain(parser: argparse.ArgumentParser, name: str, type_: Any, default: Any, help_: str, repeated: bool,
           secret_env: str | None) -> None:
    # reward_timeout_s -> --reward-timeout (seconds say so in the metavar); auto_create -> --auto-create
    flag = flag_name(name)
    if repeated:
        parser.add_argument(flag, dest=name, action="append", default=[], help=help_)
    elif default is msgspec.NODEFAULT:
        parser.add_argument(flag, dest=name, required=True, help=help_)
    elif type_ is bool:
        parser.add_argument(flag if not default else "--no-" + flag[2:], dest=name,
                            action="store_false" if default else "store_true", default=default,
                            help=f"turn off (on by default): {help_}" if default else help_)
    elif secret_env is not None:
        parser.add_argument(flag, dest=name, default=None,
                            help=f"{help_}. Prefer ${secret_env} or {flag}-file: a command line is visible "
                            "to every local user in `ps`")
        parser.add_argument(flag + "-file", dest=name + "_file", default=None, metavar="PATH",
                            help=f"read {name.replace('_', ' ')} from this file (first line)")
    elif typing.get_origin(type_) is Literal:
        parser.add_argument(flag, dest=name, choices=typing.get_args(type_), default=default,
                            help=f"{help_} (default {default})")
    elif type_ is list or typing.get_origin(type_) is list:
        parser.add_argument(flag, dest=name, action="append", default=[], metavar="VALUE", help=help_)
    elif type_ is dict or typing.get_origin(type_) is dict:
        parser.add_argument(flag, dest=name, default="", metavar="NAME=VALUE,...", help=help_)
    else:
        parser.add_argument(flag, dest=name, type=type_, default=default, metavar="S" if name.endswith("_s")
                            else None, help=f"{help_} (default {default})" if default is not None else help_)
