"""``metrics.TallyHistogram`` (issue 45: the two histograms every model call observes, tallied on the loop)
exports what prometheus_client's ``Histogram`` exports for the same observations: the same ``_bucket``
samples with the same ``le`` labels, ``_count`` and ``_sum``; only the ``_created`` timestamps are
prometheus_client's own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from steptap.middleware.metrics import TallyHistogram

BUCKETS = (0.005, 0.01, 0.5, 1, 2.5)
# On a bound (a bucket holds values <= its bound), between bounds, past the last, zero and negative
VALUES = [0.005, 0.0049, 0.01, 0.3, 1.0, 1.0000001, 2.5, 7.0, 0.0, -1.0]


def _text(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_labelled_families_export_what_prometheus_client_does() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    tally = TallyHistogram(ours, "t_seconds", "doc", ["route", "stream"], BUCKETS)
    hist = Histogram("t_seconds", "doc", ["route", "stream"], buckets=BUCKETS, registry=theirs)
    assert _text(ours) == _text(theirs)  # no series before the first observation
    for i, v in enumerate(VALUES):
        labels = ("/v1/chat/completions", "true" if i % 3 else "false")
        tally.observe(v, *labels)
        hist.labels(*labels).observe(v)
    assert _text(ours) == _text(theirs)
    assert any('le="+Inf"' in line and line.endswith(" 6.0") for line in _text(ours))


def test_an_unlabelled_family_is_exported_from_the_start() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    tally = TallyHistogram(ours, "c_seconds", "doc", buckets=BUCKETS)
    hist = Histogram("c_seconds", "doc", buckets=BUCKETS, registry=theirs)
    assert _text(ours) == _text(theirs) and "c_seconds_count 0.0" in _text(ours)
    for v in VALUES:
        tally.observe(v)
        hist.observe(v)
    assert _text(ours) == _text(theirs)
