"""What a model call uses of the app (``Services``), looked up once a call: ``request.app[SERVICES_KEY]``.

aiohttp finds ``request.app`` through the route's match and each ``app[KEY]`` through a Python method: a plain
call made 19 such lookups, about 45 of its ~900 Python calls (bench/call_counts.py). The app's wiring (app.py)
builds one ``Services`` when the log opens; the call's parts (relay, serving, recorder, the writers) read its
attributes. The app keys stay for everything else (control routes, the console, the metrics)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from steptap.middleware.backend.pool import ReplicaPool
    from steptap.middleware.config import ProxyConfig
    from steptap.middleware.metrics import Metrics
    from steptap.middleware.proxy.call_state import CallStates
    from steptap.middleware.proxy.vision import ImageMemory
    from steptap.middleware.sessions.manager import SessionManager
    from steptap.middleware.weights.swapper import WeightSwapper


@dataclass(frozen=True, slots=True)
class Services:
    config: ProxyConfig
    sessions: SessionManager
    pool: ReplicaPool
    call_states: CallStates  # what the proxy holds for each session between its calls
    swapper: WeightSwapper
    metrics: Metrics
    images: ImageMemory  # the images of calls in flight, bounded in aggregate


SERVICES_KEY = web.AppKey("steptap_services", Services)
