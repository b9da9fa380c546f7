"""``steptap serve``: flags -> ``ProxyConfig`` -> ``create_app`` -> ``web.run_app``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import types
import typing
from typing import Any

import msgspec

from steptap.middleware.config import ProxyConfig, generation_defaults, parse_force_sampling


# Fields that are not plain flags: derived at start (sampling_defaults), or read from a file or the environment
# as well as a flag (the secrets), or parsed from a string (force_sampling).
_NOT_FLAGS = {"sampling_defaults"}
_SECRET_ENV = {"control_token": "STEPTAP_CONTROL_TOKEN", "backend_api_key": "STEPTAP_BACKEND_API_KEY"}


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
        if name in _NOT_FLAGS or (only is not None and name not in only):
            continue
        hint = hints[name]
        meta = next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, msgspec.Meta)), None)
        help_ = meta.description if meta is not None and meta.description else ""
        type_ = _base_type(typing.get_args(hint)[0] if hasattr(hint, "__metadata__") else hint)
        default = defaults[name]
        if default is msgspec.NODEFAULT:
            parser.add_argument(_flag(name), dest=name, required=True, help=help_)
        elif type_ is bool:
            flag = _flag(name) if not default else "--no-" + _flag(name)[2:]
            parser.add_argument(flag, dest=name, action="store_false" if default else "store_true",
                                default=default, help=f"turn off (on by default): {help_}" if default else help_)
        elif name in _SECRET_ENV:
            parser.add_argument(_flag(name), dest=name, default=None,
                                help=f"{help_}. Prefer ${_SECRET_ENV[name]} or {_flag(name)}-file: a command "
                                "line is visible to every local user in `ps`")
            parser.add_argument(_flag(name) + "-file", dest=name + "_file", default=None, metavar="PATH",
                                help=f"read {name.replace('_', ' ')} from this file (first line)")
        elif type_ is dict or typing.get_origin(type_) is dict:
            parser.add_argument(_flag(name), dest=name, default="", metavar="NAME=VALUE,...", help=help_)
        else:
            metavar = "S" if name.endswith("_s") else None
            parser.add_argument(_flag(name), dest=name, type=type_, default=default, metavar=metavar,
                                help=f"{help_} (default {default})" if default is not None else help_)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="steptap serve", description="Run the capture proxy in front of a vLLM server."
    )
    add_proxy_flags(p)
    return p


def _secret(args: argparse.Namespace, name: str) -> str | None:
    """A secret from its flag, else its file flag, else its environment variable."""
    value = getattr(args, name)
    path = getattr(args, name + "_file")
    if not value and path and os.path.exists(path):  # a missing control token file is written at start
        from steptap.middleware.launch.private_files import read_token_file

        value = read_token_file(path)
    return value or os.environ.get(_SECRET_ENV[name]) or None


def config_from_args(argv: list[str]) -> ProxyConfig:
    parser = _parser()
    args = parser.parse_args(argv)
    values = vars(args)
    try:
        values["force_sampling"] = parse_force_sampling(args.force_sampling)
        for name in _SECRET_ENV:
            values[name] = _secret(args, name)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    values["control_token"] = values["control_token"] or ""
    if args.model_dir:
        values["sampling_defaults"] = generation_defaults(args.model_dir)
    fields = set(ProxyConfig.__struct_fields__)
    try:
        return msgspec.convert({k: v for k, v in values.items() if k in fields}, ProxyConfig)
    except msgspec.ValidationError as exc:
        parser.error(str(exc))


def args_of(argv: list[str]) -> argparse.Namespace:
    return _parser().parse_args(argv)


def _write_generated_token(path: str | None, config: ProxyConfig) -> str:
    """Where a generated control token goes: ``--control-token-file`` when given, else a 0600 file in a 0700
    directory of the user cache, named for the port."""
    from pathlib import Path

    from steptap.middleware.launch.private_files import private_dir, write_private

    if path is None:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "steptap" / "tokens"
        path = str(private_dir(cache) / f"serve-{config.port or os.getpid()}.token")
    elif not Path(path).parent.exists():
        private_dir(Path(path).parent)
    write_private(path, config.control_token + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    from aiohttp import web

    from steptap.middleware.app import create_app
    from steptap.middleware.auth import CONTROL_TOKEN_KEY, generate_token

    argv = sys.argv[1:] if argv is None else argv
    config = config_from_args(argv)
    logging.basicConfig(
        level=os.environ.get("STEPTAP_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        import uvloop  # type: ignore[import-not-found]

        uvloop.install()
    except ImportError:
        pass
    token_file = None
    if not config.control_token:  # generated: kept in a 0600 file, never printed
        config.control_token = generate_token()
        token_file = _write_generated_token(args_of(argv).control_token_file, config)
    app = create_app(config)
    assert app[CONTROL_TOKEN_KEY] == config.control_token
    print(f"steptap proxy on {config.base_url()} -> {config.backend}; log: {config.log}", flush=True)
    if token_file is not None:
        print(f"control token (generated) in {token_file}", flush=True)
    web.run_app(app, host=config.host, port=config.port, print=None, access_log=None)
    return 0
