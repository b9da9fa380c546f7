"""The Python client of the proxy's control API and trajectory stream (aiohttp only; no ML stack).

    async with SteptapClient("http://127.0.0.1:8100", control_token) as c:
        s = await c.open_session(group_id="g1", group_size=4)
        ...  # the agent uses s.base_url / s.api_key
        await c.finish(s.id, reward=1.0)

    async for d in c.trajectories("learner"):      # at least once, de-duplicated (delivery_key)
        train_on(d.trajectory)
        await c.ack("learner", d.cursor)            # everything up to d.cursor is done

**Delivery.** The stream reconnects with backoff when the proxy restarts or the connection drops, resuming
after the last cursor it delivered (before the first delivery: the given cursor, else the consumer's
acknowledged one). The same trajectory can come twice (a restart re-sends from the acknowledged cursor); with
``dedup=True`` the iterator drops records it has already delivered (a bounded seen-set keyed by
``delivery_key``: trajectory id and ``created_at``, so a session id reused later is still delivered). A record
that cannot be decoded is skipped, counted in ``client.skipped[consumer]`` and logged, never fatal. With
``seen_file`` the ids acknowledged through ``ack`` are also written to that file, so after a consumer restart
they are still recognised; ids delivered but never acknowledged are deliberately re-delivered (the consumer
may not have finished with them).

``SyncSteptapClient`` offers the control calls synchronously (stdlib only), plus the health, model list,
weight swap and metrics that launchers and the learner poll. Both take the same URL (``proxy_url``:
``http(s)://host:port`` or ``unix:PATH``, with or without ``/v1``) and the same session options
(``SessionOptions``, ``tito`` included).
"""

from __future__ import annotations

from steptap.middleware.client.api import SessionInfo, SessionOptions, SteptapError, proxy_url
from steptap.middleware.client.stream import Delivery, SeenSet, SteptapClient, delivery_key
from steptap.middleware.client.sync import SyncSteptapClient, http_call, split_url
from steptap.middleware.client.tokens import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    default_control_token,
    forget_control_token,
    read_token_file,
)

__all__ = ["SteptapClient", "SyncSteptapClient", "http_call", "split_url", "default_control_token",
           "forget_control_token", "read_token_file", "TOKEN_ENV", "TOKEN_FILE_ENV", "SteptapError",
           "SessionInfo", "SessionOptions", "proxy_url",
           "Delivery", "SeenSet", "delivery_key"]
