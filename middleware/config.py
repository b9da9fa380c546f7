"""``ProxyConfig``: every knob of ``steptap serve`` with its default, in one msgspec Struct."""

from __future__ import annotations

import msgspec
from aiohttp import web

DEFAULT_LOG_DIR = "./steptap-log"  # a proxy that loses data by default is wrong: log locally unless told


class ProxyConfig(msgspec.Struct, kw_only=True):
    backend: str = ""  # the vLLM server's base URL (http://host:port, without /v1)
    backends: list[str] = []  # more replicas (--backend repeated); proxy/replicas.py routes among them
    backends_file: str | None = None  # one replica URL a line, re-read when it changes or on SIGHUP
    health_interval_s: float = 2.0  # replica health checks (an out replica is readmitted at most this late)
    reuse_port: bool = False  # SO_REUSEPORT on the shared port (a worker of `steptap serve --workers N`)
    worker_port: int | None = None  # a worker's own port besides the shared one (the learner's, its sessions')
    refuse_swaps: str | None = None  # why POST /admin/weights is refused (workers sharing replicas)
    swap_drain_timeout_s: float = 60.0  # a swap waits this long for calls in flight, then cuts them (failed)
    backend_api_key: str | None = None  # sent to the backend as a bearer token (vLLM --api-key)
    host: str = "127.0.0.1"
    port: int = 8400
    log: str = DEFAULT_LOG_DIR  # local directory or fsspec URL of the trajectory log
    control_token: str = ""  # empty: generated at start (auth.generate_token) and printed
    public_url: str | None = None  # base of the URLs handed to agents; default http://host:port
    any_model: bool = False  # route every model name to the backend's served model
    auto_create: bool = True  # an unknown session id on the path opens that session
    force_sampling: dict[str, float] = {}  # e.g. {"temperature": 1.0, "top_p": 1.0} for every call
    # What vLLM uses when a request omits a sampling value: the model's generation_config.json when it sets
    # one (vLLM's default --generation-config auto), else OpenAI's defaults. Recorded in Step.sampling.
    sampling_defaults: dict[str, float] = {}
    model_dir: str | None = None  # the served weights (the weight swap's fallback; generation_config source)
    metrics_need_token: bool = False  # GET /metrics needs the control token too
    reward: str | None = None  # "module:function" called with each finished Trajectory
    reward_timeout_s: float = 30.0
    session_idle_timeout_s: float | None = None  # default idle timeout of sessions that set none
    group_timeout_s: float | None = None  # a group is complete when full or when this has passed
    upstream_timeout_s: float = 600.0  # no byte from the backend for this long: 504 (or a cut stream)
    upstream_connect_timeout_s: float = 10.0
    read_bufsize: int = 4 * 1024 * 1024  # SSE lines with logprobs get long; a line > 2x this fails
    sweep_interval_s: float = 1.0  # how often idle sessions and group timeouts are checked

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
    return {k: float(data[k]) for k in ("temperature", "top_p", "top_k", "min_p") if data.get(k) is not None}


def parse_force_sampling(text: str) -> dict[str, float]:
    """``temperature=1.0,top_p=1.0`` -> ``{"temperature": 1.0, "top_p": 1.0}``."""
    allowed = {"temperature", "top_p", "top_k", "min_p"}
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in allowed:
            raise ValueError(
                f"--force-sampling: expected NAME=VALUE with NAME in {sorted(allowed)}, got {part!r}"
            )
        out[name.strip()] = float(value)
    return out


CONFIG_KEY = web.AppKey("steptap_config", ProxyConfig)
