"""Prometheus metrics (``GET /metrics``). One ``CollectorRegistry`` per app, never the global one, so several
proxies (tests, one process) keep separate counts."""

from __future__ import annotations

from collections.abc import Iterator
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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from steptap.middleware.auth import require_control
from steptap.middleware.config import CONFIG_KEY

# Metric names, the one definition: the proxy exports them and readers (`steptap up`'s live view, dashboards)
# use these constants. prometheus_client adds ``_total`` to a counter's sample,
# ``_count``/``_sum``/``_bucket`` to a histogram's; ``sample()`` says which sample a reader wants.
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


def sample(name: str, kind: str = "") -> str:
    """The sample name a reader sees: ``sample(STEPS, "total")`` is ``steptap_steps_total``."""
    return f"{name}_{kind}" if kind else name


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_COMMIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.calls = Counter(
            CALLS, "HTTP calls by route and status", ["route", "status"], registry=r
        )
        self.call_latency = Histogram(
            CALL_LATENCY,
            "model call latency (proxy view)",
            ["route", "stream"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "steptap_upstream_errors", "backend failures by kind", ["kind"], registry=r
        )
        self.dropped_fields = Counter(
            "steptap_dropped_fields",
            "parts of a request accepted but not honoured (fields, hosted tools; named in the step's notes), "
            "by label",
            ["endpoint", "field"], registry=r
        )
        self.refused_calls = Counter(
            "steptap_refused_calls", "model calls refused with a 4xx (by the proxy or the backend)",
            ["endpoint"],
            registry=r
        )
        self.steps = Counter(STEPS, "recorded steps", ["status", "anonymous"], registry=r)
        self.prompt_tokens = Counter("steptap_prompt_tokens", "prompt tokens of recorded steps", registry=r)
        self.response_tokens = Counter(
            "steptap_response_tokens", "response tokens of recorded steps", registry=r
        )
        self.prefix = Counter(
            "steptap_prefix_steps",
            "steps by prefix continuity (every break counted by cause)",
            ["cause"],
            registry=r,
        )
        self.call_class = Counter(
            "steptap_call_class_steps",
            "steps by the line of their session (main, side, branch) and the rule that decided it",
            ["call_class", "rule"],
            registry=r,
        )
        self.tito_turns = Counter(
            "steptap_tito_turns",
            "token-in-token-out sessions' turns: 'tokens' when sent as ids, else the fallback's cause",
            ["path"],
            registry=r,
        )
        self.tito_streams = Counter(
            "steptap_tito_streams",
            "token-in-token-out streamed turns by route: 'chat' (vLLM's chat route on the prompt's ids), "
            "'derender_reasoning' (after a reply with reasoning), 'derender_content' (images or echo)",
            ["route"],
            registry=r,
        )
        self.sessions_opened = Counter(
            "steptap_sessions_opened", "sessions opened", ["anonymous"], registry=r
        )
        self.sessions_open = Gauge(SESSIONS_OPEN, "named sessions currently open", registry=r)
        # What open sessions hold in memory, and the calls in flight: each bounded by a limit
        # (docs/limits.md).
        self.steps_held = Gauge("steptap_session_steps_held", "steps held by open sessions", registry=r)
        self.bytes_held = Gauge(
            "steptap_session_bytes_held", "encoded bytes of the steps open sessions hold", registry=r
        )
        self.calls_inflight = Gauge("steptap_calls_inflight", "model calls in flight", registry=r)
        self.body_bytes = Gauge(
            "steptap_body_bytes_in_flight", "estimated memory of the model-call bodies in flight", registry=r
        )
        self.trajectories = Counter(
            TRAJECTORIES, "closed trajectories by status", ["status"], registry=r
        )
        self.infra_errors = Counter(
            INFRA_ERRORS, "trajectories closed as infrastructure errors (never trained), by cause", ["cause"],
            registry=r)
        self.rewards = Counter("steptap_rewards", "rewards attached", ["target", "source"], registry=r)
        self.held = Gauge("steptap_held_trajectories",
                          "finished sessions waiting for their pending reward (off the stream)", registry=r)
        self.held_ended = Counter("steptap_held_ended", "held trajectories ended: rewarded, default, dropped",
                                  ["outcome"], registry=r)
        self.late_rewards = Counter("steptap_late_rewards", "rewards given after the trajectory was streamed "
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
            "steptap_curation_marks", "curation marks written (docs/console.md)", ["action", "target"],
            registry=r)
        self.reward_errors = Counter(
            "steptap_reward_callback_errors",
            "reward callbacks that raised or timed out",
            ["kind"],
            registry=r,
        )
        self.groups_complete = Counter(
            "steptap_groups_complete", "groups complete, by reason", ["reason"], registry=r
        )
        self.log_commit = Histogram(
            "steptap_log_commit_seconds",
            "time from append to durable (proxy view)",
            buckets=_COMMIT_BUCKETS,
            registry=r,
        )
        # Stream lag is the stream owner's to set (records between the log's end and a consumer's ack).
        self.stream_lag = Gauge(
            "steptap_stream_lag_records",
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
        yield CounterMetricFamily("steptap_log_records", "records appended since start", st.records)
        yield CounterMetricFamily("steptap_log_commits", "group commits (one fdatasync each)", st.commits)
        yield GaugeMetricFamily(
            "steptap_log_torn_records", "torn records cut from the tail at open", st.torn_records
        )
        yield GaugeMetricFamily(
            "steptap_log_corrupt_records", "bad frames found in sealed segments", st.corrupt_records
        )
        yield GaugeMetricFamily("steptap_log_segments", "retained local segments", st.segments)
        yield GaugeMetricFamily("steptap_log_disk_bytes", "bytes held by the retained local segments",
                                self.log.disk_bytes)
        yield CounterMetricFamily("steptap_log_undecodable_records",
                                  "records a reader could not decode and skipped", st.undecodable_records)
        yield CounterMetricFamily("steptap_log_write_errors", "failed group commits (disk full, I/O error)",
                                  st.write_errors)
        yield GaugeMetricFamily("steptap_log_degraded", "1 while the log cannot write (model calls get 503)",
                                1 if self.log.degraded else 0)


METRICS_KEY = web.AppKey("steptap_metrics", Metrics)


async def metrics_handler(request: web.Request) -> web.Response:
    if request.app[CONFIG_KEY].metrics_need_token:
        require_control(request)
    body = request.app[METRICS_KEY].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
