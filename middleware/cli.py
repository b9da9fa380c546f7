"""The one ``steptap`` command. Each subcommand lives in the package that owns it and is imported only when
it runs, so ``steptap serve`` and ``steptap vllm`` never import the ML stack."""

from __future__ import annotations

import importlib
import sys

# name -> ("module:function", one-line help). Each function takes argv (list[str]) and returns an exit code.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("steptap.middleware.serve:main", "run the capture proxy in front of a vLLM server"),
    "vllm": ("steptap.middleware.launch.vllm_server:main", "start and supervise a vLLM server in its own virtualenv"),
    "tiny-model": ("steptap.learner.tiny_model:main", "build the offline tiny test model"),
    "pretrained-model": ("steptap.learner.pretrained:main", "convert a pip-shipped pretrained model (smollm2)"),
    "learn": ("steptap.learner.daemon:main", "run the learner daemon on the trajectory stream"),
    "plot": ("steptap.learner.plot:main", "plot reward and loss curves from a metrics file"),
    "up": ("steptap.middleware.launch.up:main", "start vLLM, the proxy and the learner together"),
    "run": ("steptap.adapters.run:main", "run any program as an agent in a fresh session"),
    "adapters": ("steptap.adapters.registry:main", "list the installed agent-framework adapters"),
}


def _usage() -> str:
    lines = ["usage: steptap COMMAND [ARGS...]", "", "commands:"]
    width = max(map(len, COMMANDS))
    lines += [f"  {name:<{width}} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"steptap: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    target, _ = COMMANDS[name]
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        extra = "learner" if ".learner." in module_name else "adapters"
        print(
            f"steptap {name}: cannot import {module_name} ({exc}).\n"
            f"Install the extra it needs: pip install 'steptap[{extra}]'",
            file=sys.stderr,
        )
        return 2
    return int(getattr(module, func_name)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
