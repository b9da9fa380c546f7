"""Children that die with their launcher.

A launcher that dies hard (SIGKILL, the OOM killer) runs no cleanup; its children (vLLM servers, proxies,
workers, often leaders of their own sessions) would go on holding their ports and memory, and a restart would
find them there. Linux's ``PR_SET_PDEATHSIG`` has the kernel signal each child when its parent dies. Stdlib
only: ``steptap serve --workers`` (``server/workers.py``) and the rest of ``launch/`` use it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get ``sig`` when this process dies; None where it cannot.

    The kernel sends it when the thread that forked the child exits, so it is set only for children started
    from the main thread (a worker thread that ends would kill its children); elsewhere None."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # loaded here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:  # runs in the child between fork and exec
        prctl(_PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:  # the launcher died before prctl took hold
            os.kill(os.getpid(), sig)

    return preexec
