"""Prometheus metrics (``GET /metrics``). One ``CollectorRegistry`` per app, never the global one, so several
proxies (tests, one process) keep separate counts."""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from steptap.middleware.auth import require_control
from steptap.middleware.config import CONFIG_KEY

# Metric names, the one definition: every metric the proxy exports is named here once, its exporters (this
# module, weights/routes.py, backend/pool.py) and its readers (`steptap up`'s live view, dashboards, docs) use
# these constants (tests/unit/test_docs_true.py holds both sides). prometheus_client adds ``_total`` to a
# counter's sample, ``_count``/``_sum``/``_bucket`` to a histogram's; ``sample()`` says which sample a reader
# wants.
CALLS = "steptap_calls"
CALL_LATENCY = "steptap_call_latency_seconds"
STEPS = "steptap_steps"
SESSIONS_OPEN = "steptap_sessions_open"
TRAJECTORIES = "steptap_trajectories"
# Trajectories closed as infrastructure errors, by cause (records.InfraCause)
INFRA_ERRORS = "steptap_infra_errors"
REWARD_VALUE = "steptap_reward_value"
REWARD_SUM = "steptap_reward_sum"
POLICY_VERSION = "steptap_policy_version"  # exported by the weight swapper's collector
WEIGHT_SWAPS = "steptap_weight_swaps"
WEIGHT_SWAP_SECONDS = "steptap_weight_swap_seconds"
SWAP_STALL_MAX = "steptap_weight_swap_stall_max_seconds"  # the fleet's longest stall in any swap
SWAP_CUT_CALLS = "steptap_weight_swap_cut_calls"
SPANNING_CALLS = "steptap_calls_spanning_swaps"  # calls whose tokens came from several policy versions
UNSPLIT_CALLS = "steptap_calls_spanning_swaps_unsplit"  # of those, recorded as one version (split unknown)
# Response tokens recorded per policy version (label: version)
TOKENS_BY_VERSION = "steptap_tokens_by_version"
UPSTREAM_ERRORS = "steptap_upstream_errors"
DROPPED_FIELDS = "steptap_dropped_fields"
REFUSED_CALLS = "steptap_refused_calls"
PROMPT_TOKENS = "steptap_prompt_tokens"
RESPONSE_TOKENS = "steptap_response_tokens"
PREFIX_STEPS = "steptap_prefix_steps"
CALL_CLASS_STEPS = "steptap_call_class_steps"
TITO_TURNS = "steptap_tito_turns"
TITO_STREAMS = "steptap_tito_streams"
SESSIONS_OPENED = "steptap_sessions_opened"
SESSION_STEPS_HELD = "steptap_session_steps_held"
SESSION_BYTES_HELD = "steptap_session_bytes_held"
CALLS_INFLIGHT = "steptap_calls_inflight"
BODY_BYTES_IN_FLIGHT = "steptap_body_bytes_in_flight"
REWARDS = "steptap_rewards"
HELD_TRAJECTORIES = "steptap_held_trajectories"
HELD_ENDED = "steptap_held_ended"
LATE_REWARDS = "steptap_late_rewards"
CURATION_MARKS = "steptap_curation_marks"
REWARD_CALLBACK_ERRORS = "steptap_reward_callback_errors"
GROUPS_COMPLETE = "steptap_groups_complete"
LOG_COMMIT_SECONDS = "steptap_log_commit_seconds"
STREAM_LAG_RECORDS = "steptap_stream_lag_records"
LOG_RECORDS = "steptap_log_records"
LOG_COMMITS = "steptap_log_commits"
LOG_TORN_RECORDS = "steptap_log_torn_records"
LOG_CORRUPT_RECORDS = "steptap_log_corrupt_records"
LOG_SEGMENTS = "steptap_log_segments"
LOG_DISK_BYTES = "steptap_log_disk_bytes"
LOG_UNDECODABLE_RECORDS = "steptap_log_undecodable_records"
LOG_WRITE_ERRORS = "steptap_log_write_errors"
LOG_DEGRADED = "steptap_log_degraded"
WEIGHT_SWAP_FAILURES = "steptap_weight_swap_failures"
WEIGHT_SWAP_PAUSED_SECONDS = "steptap_weight_swap_paused_seconds"
WEIGHT_SWAP_STALL_SECONDS = "steptap_weight_swap_stall_seconds"
WEIGHT_SWAP_HELD_CALLS = "steptap_weight_swap_held_calls"
WEIGHT_SWAP_IN_FLIGHT = "steptap_weight_swap_in_flight"
WEIGHT_SWAP_LAST_TIMESTAMP = "steptap_weight_swap_last_timestamp"
REPLICA_UP = "steptap_replica_up"
REPLICA_IN_FLIGHT = "steptap_replica_in_flight"
REPLICA_CALLS = "steptap_replica_calls"
REPLICA_TAKEN_OUT = "steptap_replica_taken_out"
SESSIONS_MOVED = "steptap_sessions_moved"
# The run's health (middleware/health.py): what the proxy counts...
REPLIES_CUT = "steptap_replies_cut"  # steps cut by max_tokens (finish_reason "length")
IDLE_MAX = "steptap_sessions_idle_max_seconds"  # the longest an open session has gone without a call
HELD_MAX = "steptap_held_oldest_seconds"  # the oldest held trajectory's wait for its reward
# ... and, when the proxy knows the learner's metrics file (--console-learner-metrics), the learner's latest
# batch: shares of groups with reward variance, of generated tokens in the loss, of replies cut; the mean
# logprob gap to vLLM and the versions the trained tokens lag; one sample per finding (labels cause, level)
HEALTH_GROUPS_VARIED = "steptap_health_groups_varied_share"
HEALTH_TOKENS_TRAINED = "steptap_health_tokens_trained_share"
HEALTH_REPLIES_CUT = "steptap_health_replies_cut_share"
HEALTH_LOGPROB_GAP = "steptap_health_logprob_gap"
HEALTH_VERSION_LAG = "steptap_health_version_lag"
HEALTH_FINDING = "steptap_health_finding"


def sample(name: str, kind: str = "") -> str:
    """The sample name a reader sees: ``sample(STEPS, "total")`` is ``steptap_steps_total``."""
    return f"{name}_{kind}" if kind else name


def parse_text(text: str) -> dict[str, float]:
    """Prometheus text -> every sample summed over its labels, by sample name (``_total`` kept as exposed);
    a sample labelled by ``version``, ``status`` or ``anonymous`` also under ``name{value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + float(s.value)
            for label in ("version", "status", "anonymous"):
                if label in s.labels:
                    key = f"{s.name}{{{s.labels[label]}}}"
                    out[key] = out.get(key, 0.0) + float(s.value)
    return out


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_COMMIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


class Tally(defaultdict[Any, float]):
    """A counter family counted where it happens and exported when ``/metrics`` is read (``collect``):
    ``tally["a", "b"] += 1`` (two labels), ``tally["a"] += 1`` (one), ``tally[()] += n`` (none). That is one
    dict update in C, where prometheus_client's ``Counter.inc`` costs about five Python calls and a lock
    (issue 45: the counters every model call moves, ~50 of its ~860 calls). Written on the event loop's thread
    only, as everything that counts these runs there; read through its samples (``name_total``), as a
    Counter is."""

    # a collector is a registry's key: one tally is itself, not its counts
    __hash__ = object.__hash__  # type: ignore[assignment]
    __eq__ = object.__eq__

    def __init__(self, registry: CollectorRegistry, name: str, doc: str, labels: Sequence[str] = ()) -> None:
        super().__init__(float)
        self.name, self.doc, self.labels = name, doc, list(labels)
        registry.register(self)

    def value(self, *labels: str) -> float:
        return self.get(labels[0] if len(labels) == 1 else labels, 0.0)

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        if not self.labels:
            family.add_metric([], self.get((), 0.0))
        else:
            for key, value in list(self.items()):
                family.add_metric([key] if isinstance(key, str) else list(key), value)
        yield family


class TallyHistogram:
    """A histogram family tallied where it happens and exported when ``/metrics`` is read, as ``Tally`` is for
    counters: ``observe(value, *labels)`` is a bisect and two list updates, where prometheus_client's
    ``labels(...).observe`` is about ten Python calls and two locks (every model call observes two: its
    latency and its log commit). Event loop's thread only; the same samples (``_bucket``, ``_count``,
    ``_sum``) and ``le`` labels as prometheus_client's ``Histogram``."""

    def __init__(self, registry: CollectorRegistry, name: str, doc: str, labels: Sequence[str] = (),
                 buckets: Sequence[float] = ()) -> None:
        self.name, self.doc, self.labels = name, doc, list(labels)
        self.bounds = tuple(float(b) for b in buckets)  # +Inf is the last slot of every series
        self._le = [*(floatToGoString(b) for b in self.bounds), "+Inf"]  # type: ignore[no-untyped-call]
        # labels -> per-bucket counts (not cumulative), then the sum
        self.series: dict[tuple[str, ...], list[float]] = {}
        if not self.labels:  # an unlabelled histogram is exported from the start, as prometheus_client's is
            self.series[()] = [0.0] * (len(self.bounds) + 2)
        registry.register(self)

    def observe(self, value: float, *labels: str) -> None:
        counts = self.series.get(labels)
        if counts is None:
            counts = self.series[labels] = [0.0] * (len(self.bounds) + 2)
        counts[bisect_left(self.bounds, value)] += 1  # a bucket holds values <= its bound
        counts[-1] += value

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for key, counts in list(self.series.items()):
            total, cumulative = 0.0, []
            for le, n in zip(self._le, counts[:-1], strict=True):  # the sum last
                total += n
                cumulative.append((le, total))
            family.add_metric(list(key), cumulative, counts[-1])
        yield family


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        # What every call counts is tallied (``Tally``); the rest is prometheus_client's own
        self.calls = Tally(r, CALLS, "HTTP calls by route and status", ["route", "status"])
        self.call_latency = TallyHistogram(r, CALL_LATENCY, "model call latency (proxy view)",
                                           ["route", "stream"], _LATENCY_BUCKETS)
        self.upstream_errors = Counter(
            UPSTREAM_ERRORS, "backend failures by kind", ["kind"], registry=r
        )
        self.dropped_fields = Counter(
            DROPPED_FIELDS,
            "parts of a request accepted but not honoured (fields, hosted tools; named in the step's notes), "
            "by label",
            ["endpoint", "field"], registry=r
        )
        self.refused_calls = Counter(
            REFUSED_CALLS, "model calls refused with a 4xx (by the proxy or the backend)",
            ["endpoint"],
            registry=r
        )
        self.steps = Tally(r, STEPS, "recorded steps", ["status", "anonymous"])
        self.prompt_tokens = Tally(r, PROMPT_TOKENS, "prompt tokens of recorded steps")
        self.response_tokens = Tally(r, RESPONSE_TOKENS, "response tokens of recorded steps")
        self.replies_cut = Tally(r, REPLIES_CUT, "recorded steps cut by max_tokens (finish_reason length)")
        self.prefix = Tally(r, PREFIX_STEPS, "steps by prefix continuity (every break counted by cause)",
                            ["cause"])
        self.call_class = Tally(
            r, CALL_CLASS_STEPS,
            "steps by the line of their session (main, side, branch) and the rule that decided it",
            ["call_class", "rule"])
        self.tito_turns = Counter(
            TITO_TURNS,
            "token-in-token-out sessions' turns: 'tokens' when sent as ids, else the fallback's cause",
            ["path"],
            registry=r,
        )
        self.tito_streams = Counter(
            TITO_STREAMS,
            "token-in-token-out streamed turns by route: 'chat' (vLLM's chat route on the prompt's ids), "
            "'derender_reasoning' (after a reply with reasoning), 'derender_content' (images or echo)",
            ["route"],
            registry=r,
        )
        self.sessions_opened = Tally(r, SESSIONS_OPENED, "sessions opened", ["anonymous"])
        self.sessions_open = Gauge(SESSIONS_OPEN, "named sessions currently open", registry=r)
        # What open sessions hold in memory, and the calls in flight: each bounded by a limit
        # (docs/limits.md).
        self.steps_held = Gauge(SESSION_STEPS_HELD, "steps held by open sessions", registry=r)
        self.bytes_held = Gauge(
            SESSION_BYTES_HELD, "encoded bytes of the steps open sessions hold", registry=r
        )
        self.calls_inflight = Gauge(CALLS_INFLIGHT, "model calls in flight", registry=r)
        self.body_bytes = Gauge(
            BODY_BYTES_IN_FLIGHT, "estimated memory of the model-call bodies in flight", registry=r
        )
        self.trajectories = Tally(r, TRAJECTORIES, "closed trajectories by status", ["status"])
        self.infra_errors = Tally(
            r, INFRA_ERRORS, "trajectories closed as infrastructure errors (never trained), by cause",
            ["cause"])
        self.rewards = Counter(REWARDS, "rewards attached", ["target", "source"], registry=r)
        self.held = Gauge(HELD_TRAJECTORIES,
                          "finished sessions waiting for their pending reward (off the stream)", registry=r)
        self.held_ended = Counter(HELD_ENDED, "held trajectories ended: rewarded, default, dropped",
                                  ["outcome"], registry=r)
        self.late_rewards = Counter(LATE_REWARDS, "rewards given after the trajectory was streamed "
                                    "(recorded, never trained)", ["source"], registry=r)
        self.reward_values = Histogram(
            REWARD_VALUE,
            "scalar trajectory rewards at close",
            buckets=(-10, -1, -0.5, 0, 0.25, 0.5, 0.75, 1, 2, 10),
            registry=r,
        )
        # The histogram has negative buckets, so prometheus_client leaves out its _sum: keep the sum here
        # (a gauge, since rewards may be negative) for the mean reward of closed trajectories.
        self.reward_sum = Gauge(REWARD_SUM, "sum of scalar trajectory rewards at close", registry=r)
        self.curation_marks = Counter(
            CURATION_MARKS, "curation marks written (docs/console.md)", ["action", "target"],
            registry=r)
        self.reward_errors = Counter(
            REWARD_CALLBACK_ERRORS,
            "reward callbacks that raised or timed out",
            ["kind"],
            registry=r,
        )
        self.groups_complete = Counter(
            GROUPS_COMPLETE, "groups complete, by reason", ["reason"], registry=r
        )
        self.log_commit = TallyHistogram(r, LOG_COMMIT_SECONDS, "time from append to durable (proxy view)",
                                         buckets=_COMMIT_BUCKETS)
        # Stream lag is the stream owner's to set (records between the log's end and a consumer's ack).
        self.stream_lag = Gauge(
            STREAM_LAG_RECORDS,
            "finished trajectories after the consumer's acknowledged cursor",
            ["consumer"],
            registry=r,
        )

        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached: prometheus_client validates and locks on every ``labels()``
        call, which shows on the hot path."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def watch_log(self, log: Any) -> None:
        """Expose the log's own counters (read at scrape time): appends, commits, torn or corrupt records."""
        self.registry.register(_LogCollector(log))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LogCollector:
    def __init__(self, log: Any) -> None:
        self.log = log

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        st = self.log.stats
        yield CounterMetricFamily(LOG_RECORDS, "records appended since start", st.records)
        yield CounterMetricFamily(LOG_COMMITS, "group commits (one fdatasync each)", st.commits)
        yield GaugeMetricFamily(
            LOG_TORN_RECORDS, "torn records cut from the tail at open", st.torn_records
        )
        yield GaugeMetricFamily(
            LOG_CORRUPT_RECORDS, "bad frames found in sealed segments", st.corrupt_records
        )
        yield GaugeMetricFamily(LOG_SEGMENTS, "retained local segments", st.segments)
        yield GaugeMetricFamily(LOG_DISK_BYTES, "bytes held by the retained local segments",
                                self.log.disk_bytes)
        yield CounterMetricFamily(LOG_UNDECODABLE_RECORDS,
                                  "records a reader could not decode and skipped", st.undecodable_records)
        yield CounterMetricFamily(LOG_WRITE_ERRORS, "failed group commits (disk full, I/O error)",
                                  st.write_errors)
        yield GaugeMetricFamily(LOG_DEGRADED, "1 while the log cannot write (model calls get 503)",
                                1 if self.log.degraded else 0)


METRICS_KEY = web.AppKey("steptap_metrics", Metrics)


async def metrics_handler(request: web.Request) -> web.Response:
    if request.app[CONFIG_KEY].metrics_need_token:
        require_control(request)
    body = request.app[METRICS_KEY].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
