"""``steptap serve``: flags -> ``ProxyConfig`` -> ``create_app`` -> ``web.run_app``."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import msgspec

from steptap.middleware.config import ProxyConfig, generation_defaults, parse_force_sampling
from steptap.middleware.flags import SECRET_ENV, add_proxy_flags


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
    return value or os.environ.get(SECRET_ENV[name]) or None


def config_from_args(argv: list[str]) -> ProxyConfig:
    parser = _parser()
    args = parser.parse_args(argv)
    values = vars(args)
    try:
        values["force_sampling"] = parse_force_sampling(args.force_sampling)
        for name in SECRET_ENV:
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
