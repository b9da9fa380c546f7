"""glibc's allocator, tuned for buffers that grow with a session's context.

A long session's every call allocates blocks a little larger than the last call's: the prompt id list (8 bytes
a token: ~0.9 MB at 115k tokens), its JSON, the agent's body. glibc serves a block over its mmap threshold
with fresh pages from the kernel, and raises the threshold only to the size of a freed block: a block larger
than any freed one, which a growing prompt always is, is mapped anew, and the kernel zero-fills each of its
pages on first touch. Measured at 115k tokens on the instant upstream (``bench/long_session.py``): ~130
page faults a turn, and a turn's handler 4.1 ms; with the threshold above such blocks, 5 faults and 3.0 ms.

So a proxy serves blocks up to ``MMAP_THRESHOLD`` from its heap, which reuses freed ones, and keeps up to
``TRIM_THRESHOLD`` of free heap instead of returning it at once. Either threshold set in the environment
(``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``: glibc's own tunables) takes
precedence: nothing is changed. Elsewhere than glibc (musl, macOS) it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 64 << 20


def tune() -> bool:
    """Set the thresholds for this process; whether they were set."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if (os.environ.get("MALLOC_MMAP_THRESHOLD_") or os.environ.get("MALLOC_TRIM_THRESHOLD_")
            or "malloc.mmap_threshold" in tunables or "malloc.trim_threshold" in tunables):
        return False  # the user's own
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    # mallopt answers 1 on success
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


# Python's cyclic collector: a young-generation pass runs each time the tracked containers allocated exceed
# those freed by this many. Python's 700 is soon reached by the calls in flight (their bodies, replies and
# steps), so a pass ran every few calls and walked every in-flight container: ~45 us a plain call at c=32
# (issue 45). An anonymous call leaves no cycle behind; a cycle elsewhere is still collected, later.
GC_YOUNG = 10_000


def tune_gc() -> None:
    """The collector's young threshold raised to ``GC_YOUNG`` for this process (the older ones kept)."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG, middle, old)
