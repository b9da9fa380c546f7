"""The proxy's allocator tuning (middleware/server/malloc.py): a session's growing blocks reuse the heap
instead of fresh pages each call, counted in page faults, in a process of its own (the tuning is
process-wide)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# A long session's pattern: each call's block a little larger than the last, the two before it still held
_GROWING = """
import resource, sys
from steptap.middleware.server import malloc
print(malloc.tune() if sys.argv[1] == "tuned" else None)
held, before = [], resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(40):
    held.append(b"x" * (1_000_000 + 20_000 * i))  # written whole: every page touched
    if len(held) > 2:
        held.pop(0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(mode: str, **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", _GROWING, mode], env={**clean, **env}, capture_output=True,
                         text=True, check=True, timeout=60).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_growing_blocks_reuse_the_heap_once_tuned() -> None:
    tuned, tuned_faults = _run("tuned")
    _, plain_faults = _run("plain")
    assert tuned == "True"
    # each plain block over glibc's raised threshold is mapped anew: ~250 faults a block; tuned, the heap
    # grows by what the blocks grow
    assert plain_faults > 40 * 200
    assert tuned_faults * 4 < plain_faults, (tuned_faults, plain_faults)


def test_the_users_own_thresholds_are_kept() -> None:
    assert _run("tuned", MALLOC_MMAP_THRESHOLD_="131072")[0] == "False"
    assert _run("tuned", GLIBC_TUNABLES="glibc.malloc.trim_threshold=1")[0] == "False"
    assert _run("tuned", GLIBC_TUNABLES="glibc.pthread.rseq=0")[0] == "True"  # another tunable


def test_the_collectors_young_threshold_is_raised_and_the_older_ones_kept() -> None:
    import gc

    from steptap.middleware.server import malloc

    before = gc.get_threshold()
    try:
        malloc.tune_gc()
        assert gc.get_threshold() == (malloc.GC_YOUNG, before[1], before[2])
    finally:
        gc.set_threshold(*before)
