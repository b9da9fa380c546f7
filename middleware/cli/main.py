"""The one ``steptap`` command. Each subcommand lives in the package that owns it and is imported only when
it runs, so ``steptap serve`` and ``steptap vllm`` never import the ML stack."""

from __future__ import annotations

import importlib
import sys

# name -> ("module:function", one-line help, the install extra it needs beyond the proxy's own dependencies).
# Each function takes argv (list[str]) and returns an exit code.
COMMANDS: dict[str, tuple[str, str, str | None]] = {
    "serve": ("steptap.middleware.server.serve:main", "run the capture proxy in front of a vLLM server",
              None),
    "vllm": ("steptap.middleware.launch.vllm_command:main",
             "start and supervise a vLLM server in its own virtualenv", None),
    "tiny-model": ("steptap.learner.tiny_model:main", "build the offline tiny test model", "learner"),
    "pretrained-model": ("steptap.learner.pretrained:main",
                         "convert a pip-shipped pretrained model (smollm2)",
                         "pretrained"),
    "trained-model": ("steptap.learner.trained:main",
                      "a learner checkpoint's policy as a model directory (LoRA merged) or its adapter",
                      "learner"),
    "learn": ("steptap.learner.daemon:main", "run the learner daemon on the trajectory stream", "learner"),
    "plot": ("steptap.learner.plot:main", "plot reward and loss curves from a metrics file", "learner"),
    "up": ("steptap.middleware.launch.up:main", "start vLLM, the proxy and the learner together", "up"),
    "run": ("steptap.adapters.run:main", "run any program as an agent in a fresh session", None),
    "adapters": ("steptap.adapters.registry:main", "list the installed agent-framework adapters", None),
    "env": ("steptap.adapters.env.cli:main_env", "run a parquet dataset of environment tasks as GRPO groups",
            "env"),
    "eval": ("steptap.adapters.env.cli:main_eval", "evaluate a dataset as eval sessions: accuracy by version",
             "env"),
    "tasks": ("steptap.adapters.tasks.cli:main",
              "run agents on task datasets in sandboxes, rewarded by the tasks' verifiers", None),
    "export": ("steptap.adapters.export:main",
               "write finished trajectories as parquet (a row per step) or Harbor's RolloutDetail", "env"),
    "doctor": ("steptap.adapters.doctor:main", "a run's health after the fact, from its files", None),
}


def _usage() -> str:
    lines = ["usage: steptap COMMAND [ARGS...]", "", "commands:"]
    width = max(map(len, COMMANDS))
    lines += [
        f"  {name:<{width}} {help_}" + (f"  [needs steptap[{extra}]]" if extra else "")
        for name, (_, help_, extra) in COMMANDS.items()
    ]
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
    target, _, extra = COMMANDS[name]
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or str(exc)
        hint = (f"Install the extra it needs: pip install 'steptap[{extra}]'" if extra
                else "Reinstall steptap: pip install --force-reinstall steptap")
        print(f"steptap {name}: needs {missing!r}, which is not installed ({exc}).\n{hint}", file=sys.stderr)
        return 2
    return int(getattr(module, func_name)(rest) or 0)

