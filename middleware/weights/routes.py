"""The weight swap's HTTP side: ``POST /admin/weights`` (control token) and the swapper's Prometheus view."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from steptap.middleware import metrics as metric_names
from steptap.middleware.auth import require_control
from steptap.middleware.config import CONFIG_KEY
from steptap.middleware.errors import ApiError
from steptap.middleware.records import json_encoder
from steptap.middleware.weights.swapper import WeightSwapper
from steptap.middleware.weights.transfer import Transfer

# Every model call passes ``async with services.swapper.gate() as ticket`` (proxy/relay.py, services.py).
SWAPPER_KEY = web.AppKey("steptap_swapper", WeightSwapper)


class WeightsRequest(msgspec.Struct, forbid_unknown_fields=True):
    path: str | None = None
    lora_path: str | None = None
    version: int | None = None
    transfer: Transfer | None = None  # full weights the learner broadcasts meanwhile (weights/transfer.py)


_weights_request = msgspec.json.Decoder(WeightsRequest)
_json = json_encoder


def swapper_of(app: web.Application) -> WeightSwapper:
    swapper = app[SWAPPER_KEY]
    assert isinstance(swapper, WeightSwapper)
    return swapper


async def admin_weights(request: web.Request) -> web.Response:
    """``POST /admin/weights`` ``{path}``, ``{lora_path}`` or ``{transfer}`` (+ ``version``) -> ``{version}``
    (control)."""
    require_control(request)
    refused = request.app[CONFIG_KEY].refuse_swaps
    if refused:
        raise ApiError(409, "weight swaps are refused: this proxy is one of several workers sharing the same "
                            "vLLM replicas, and a swap through one would let the others record the old "
                            "version for calls the new weights sampled; give `steptap serve --workers N` at "
                            "least N "
                            f"--backend replicas ({refused})", "swaps_refused")
    try:
        body = _weights_request.decode(await request.read())
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ApiError(400,
                       f"expected {{\"path\": DIR}}, {{\"lora_path\": DIR}} or {{\"transfer\": {{...}}}} "
                            f"(+ \"version\"): {exc}",
                       "invalid_request") from None
    swapper = swapper_of(request.app)
    # Shielded: an admin client that hangs up must not cancel a swap halfway (calls held, backend paused).
    task = asyncio.ensure_future(swapper.swap(path=body.path, lora_path=body.lora_path, version=body.version,
                                              transfer=body.transfer))
    version = await asyncio.shield(task)  # a SwapError leaves through the edge (errors._STATUS)
    st = swapper.state()
    return web.Response(body=_json.encode({"version": version, "swap_s": st.last_swap_s,
                                           "paused_s": st.last_paused_s}), content_type="application/json")


class WeightsCollector:
    """Prometheus view of the swapper, read at scrape time: ``registry.register(WeightsCollector(sw))``."""

    def __init__(self, swapper: WeightSwapper) -> None:
        self.swapper = swapper

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        st = self.swapper.state()
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield g(metric_names.POLICY_VERSION, "policy version of the weights being served", st.version)
        yield c(metric_names.WEIGHT_SWAPS, "successful weight swaps", st.swaps)
        yield c(metric_names.WEIGHT_SWAP_FAILURES, "refused or failed weight swaps", st.failures)
        yield g(
            metric_names.WEIGHT_SWAP_SECONDS,
            "duration of the last swap (calls held meanwhile)",
            st.last_swap_s or 0.0,
        )
        yield g(
            metric_names.WEIGHT_SWAP_PAUSED_SECONDS,
            "how long the backend was paused in the last swap",
            st.last_paused_s or 0.0,
        )
        yield g(metric_names.WEIGHT_SWAP_STALL_SECONDS,
                "the fleet's longest stall in the last swap (a call held at the gate or frozen in vLLM)",
                st.last_stall_s or 0.0)
        yield g(metric_names.SWAP_STALL_MAX, "the fleet's longest stall in any swap", st.max_stall_s)
        yield c(metric_names.SWAP_CUT_CALLS, "calls cut by a drain swap's bound", st.cut_calls)
        yield c(metric_names.SPANNING_CALLS, "calls whose tokens came from two or more policy versions",
                st.spanning_calls)
        yield c(metric_names.UNSPLIT_CALLS,
                "calls spanning a swap whose split the proxy could not see (plain chat, "
                "a slow reader): recorded as the version they started on", st.unsplit_calls)
        tokens = c(metric_names.TOKENS_BY_VERSION, "response tokens recorded per policy version (latest 16)",
                   labels=["version"])
        for version, n in sorted(st.tokens_by_version.items()):
            tokens.add_metric([str(version)], n)
        yield tokens
        yield g(metric_names.WEIGHT_SWAP_HELD_CALLS, "model calls waiting for a swap to finish", st.held)
        yield g(metric_names.WEIGHT_SWAP_IN_FLIGHT, "model calls through the swap gate", st.in_flight)
        yield g(metric_names.WEIGHT_SWAP_LAST_TIMESTAMP, "unix time of the last swap", st.last_swap_at or 0.0)
