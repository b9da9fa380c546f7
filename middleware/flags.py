"""``ProxyConfig`` as command-line flags: one flag per field, generated from the struct (help from its
``msgspec.Meta`` descriptions, defaults from its defaults), shared by ``steptap serve`` and ``steptap up``."""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any

import msgspec

from steptap.middleware.client import TOKEN_ENV
from steptap.middleware.config import ProxyConfig

# Fields that are not plain flags: derived at start (sampling_defaults), or read from a file or the
# environment as well as a flag (the secrets), or parsed from a string (force_sampling).
NOT_FLAGS = {"sampling_defaults", "backends"}  # backends: the second and later --backend
HIDDEN = {"reuse_port", "worker_port", "refuse_swaps"}  # set by `steptap serve --workers` for each worker
SECRET_ENV = {"control_token": TOKEN_ENV, "backend_api_key": "STEPTAP_BACKEND_API_KEY",
              "viewer_token": "STEPTAP_VIEWER_TOKEN"}


def _flag(name: str) -> str:
    # reward_timeout_s -> --reward-timeout (seconds say so in the metavar); auto_create -> --auto-create
    return "--" + name.removesuffix("_s").replace("_", "-")


def _base_type(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) and args else hint


def add_proxy_flags(parser: argparse.ArgumentParser, only: set[str] | None = None) -> None:
    """One flag per ``ProxyConfig`` field, its help from the field's ``msgspec.Meta(description=...)`` and
    its default from the Struct, so flags and defaults never drift (``steptap up`` takes some of them too).
    Booleans are ``--x`` (default off) or ``--no-x`` (default on); ``*_s`` fields are seconds."""
    hints = typing.get_type_hints(ProxyConfig, include_extras=True)
    defaults = {f.name: f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()
                for f in msgspec.structs.fields(ProxyConfig)}
    for name in ProxyConfig.__struct_fields__:
        if name in NOT_FLAGS or (only is not None and name not in only):
            continue
        hint = hints[name]
        meta = next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, msgspec.Meta)), None)
        help_ = meta.description if meta is not None and meta.description else ""
        type_ = _base_type(typing.get_args(hint)[0] if hasattr(hint, "__metadata__") else hint)
        default = defaults[name]
        if name in HIDDEN:
            help_ = argparse.SUPPRESS
        if name == "backend":  # repeated for replicas; serve.config_from_args splits it
            parser.add_argument(_flag(name), dest=name, action="append", default=[], help=help_)
        elif default is msgspec.NODEFAULT:
            parser.add_argument(_flag(name), dest=name, required=True, help=help_)
        elif type_ is bool:
            flag = _flag(name) if not default else "--no-" + _flag(name)[2:]
            parser.add_argument(flag, dest=name, action="store_false" if default else "store_true",
                                default=default, help=f"turn off (on by default): {help_}" if default
                                else help_)
        elif name in SECRET_ENV:
            parser.add_argument(_flag(name), dest=name, default=None,
                                help=f"{help_}. Prefer ${SECRET_ENV[name]} or {_flag(name)}-file: a command "
                                "line is visible to every local user in `ps`")
            parser.add_argument(_flag(name) + "-file", dest=name + "_file", default=None, metavar="PATH",
                                help=f"read {name.replace('_', ' ')} from this file (first line)")
        elif typing.get_origin(type_) is typing.Literal:
            choices = typing.get_args(type_)
            parser.add_argument(_flag(name), dest=name, choices=choices, default=default,
                                help=f"{help_} (default {default})")
        elif type_ is list or typing.get_origin(type_) is list:  # repeatable
            parser.add_argument(_flag(name), dest=name, action="append", default=[], metavar="VALUE",
                                help=help_)
        elif type_ is dict or typing.get_origin(type_) is dict:
            parser.add_argument(_flag(name), dest=name, default="", metavar="NAME=VALUE,...", help=help_)
        else:
            metavar = "S" if name.endswith("_s") else None
            parser.add_argument(_flag(name), dest=name, type=type_, default=default, metavar=metavar,
                                help=f"{help_} (default {default})" if default is not None else help_)
