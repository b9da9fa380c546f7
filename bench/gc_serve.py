"""``steptap serve`` with the cyclic collector watched: what its passes cost the proxy, and what they find.

    .venv/bin/python bench/proxy_overhead.py --targets steptap --concurrency 32 --modes stream \
        --long-concurrency '' --rounds 1 --seconds 1000 --requests 2000 \
        --steptap-cmd "$PWD/.venv/bin/python $PWD/bench/gc_serve.py"
    GC_OUT=runs/gc.json GC_SAVEALL=1 ...   # the same, and the types of what the passes found

As ``--steptap-cmd`` (a baseline's ``-c BOOT`` form too): times each pass by generation (``gc.callbacks``,
the thread's CPU time) and, at exit, writes to ``GC_OUT`` (default ``/tmp/gc.json``) per generation the
passes, their CPU seconds and the objects they freed, and the process's CPU seconds. ``GC_SAVEALL=1`` keeps
what the passes find (``gc.DEBUG_SAVEALL``) and adds the 40 commonest types: a type counted once a call is a
reference cycle each call leaves (issue 45: the stream relay's). Start-up's own passes and garbage are in the
figures: compare two runs of different ``--requests``, or new and old code.
"""

from __future__ import annotations

import atexit
import collections
import gc
import json
import os
import runpy
import sys
import time

_passes = {g: [0, 0.0, 0] for g in range(3)}  # generation -> passes, CPU seconds, objects freed
_began = [0.0]


def _watch(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _began[0] = time.thread_time()
        return
    row = _passes[info["generation"]]
    row[0] += 1
    row[1] += time.thread_time() - _began[0]
    row[2] += info["collected"]


def _write() -> None:
    out: dict[str, object] = {"passes": _passes, "cpu_s": time.process_time()}
    if os.environ.get("GC_SAVEALL"):
        gc.collect()
        kinds = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
        out["found"] = len(gc.garbage)
        out["found_types"] = kinds.most_common(40)
    with open(os.environ.get("GC_OUT", "/tmp/gc.json"), "w") as f:
        json.dump(out, f, indent=1)


def main() -> None:
    gc.callbacks.append(_watch)
    if os.environ.get("GC_SAVEALL"):
        gc.set_debug(gc.DEBUG_SAVEALL)
    atexit.register(_write)
    if sys.argv[1:2] == ["-c"]:  # a baseline's tree: proxy_overhead's boot code
        code = sys.argv[2]
        sys.argv = ["-c", *sys.argv[3:]]
        exec(compile(code, "<boot>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = ["steptap", *sys.argv[1:]]
        runpy.run_module("steptap.middleware.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
